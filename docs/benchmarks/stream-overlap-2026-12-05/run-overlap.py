"""Reads behind compute against a blocking step, at the defaults (``--moe-stream-cache-mb auto``), under a sweep
setting's memory limit, cold, rotating rounds: ``defaults`` (reads behind compute, the default) against
``defaults`` with ``PYBMOE_MOE_STREAM_OVERLAP=0``, and stock mmap. Decode (``tg``: llama-bench -n 32) and
prefill (``pp``: -p 32), both on the setting's routing trace.

    run-overlap.py ROUNDS OUT.csv NAME=MODEL.gguf:FACTOR:TRACE:MODES ...

The run kept here (MODES tg, pp or tg+pp; the models and traces of docs/benchmarks.md's sweep):
    ... 3 overlap.csv C=C-L16-E256-K8-q4_k.gguf:3:granite-C.csv:tg+pp A=A-L24-E128-K8-q4_0.gguf:3:granite-A.csv:tg+pp
        B=B-L24-E64-K4-q8_0.gguf:3:uniform-B.csv:tg+pp
"""
import os
import re
import sys
from pathlib import Path

import pandas as pd

from pybmoe import engine
from pybmoe.bench import stream
from pybmoe.engine import memlimit

rounds, out = int(sys.argv[1]), Path(sys.argv[2])
rows = []
for spec in sys.argv[3:]:
    name, _, rest = spec.partition("=")
    model, factor, trace, modes = rest.rsplit(":", 3)
    model, trace = Path(model), Path(trace)
    limit = int(model.stat().st_size / 2**20 / float(factor))
    routing = trace.stem.split("-")[0]
    for mode in modes.split("+"):
        pts = [("on", stream.StreamPoint("defaults", "auto")), ("off", stream.StreamPoint("defaults", "auto"))]
        if mode == "pp":
            pts.append(("mmap", stream.StreamPoint("mmap")))
        with memlimit.MemoryLimit(limit) as lim:
            for rep in range(rounds):
                k = rep % len(pts)
                for label, pt in pts[k:] + pts[:k]:
                    os.environ["PYBMOE_MOE_STREAM_OVERLAP"] = "0" if label == "off" else "1"
                    log = out.parent / "logs" / f"{name}-{factor}x-{routing}-{mode}-{label}-{rep}.log"
                    try:
                        r = stream.run_point(model, pt, mode, limit=lim, cold=True, log_path=log, n_prompt=32, n_gen=32,
                                             threads=2, ubatch=512, io_threads=None, floor_mib=None, route_replay=trace)
                    except engine.EngineError as e:
                        rows.append(dict(model=name, factor=factor, routing=routing, mode=mode, point=label, repeat=rep,
                                         failed=str(e).splitlines()[0][:200]))
                        continue
                    text = log.read_text()
                    ov = re.search(r"overlap=(\d)", text)
                    rows.append(dict(model=name, factor=float(factor), routing=routing, mode=mode, point=label,
                                     repeat=rep, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"),
                                     io_wait_s=r.get("stream_io_wait_s"), read_mib=r.get("stream_read_mib"),
                                     overlap=int(ov.group(1)) if ov else None, peak_mib=r.get("peak_mib"),
                                     limit_mib=limit))
                    print(name, factor, routing, mode, label, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
                    pd.DataFrame(rows).to_csv(out, index=False)
os.environ.pop("PYBMOE_MOE_STREAM_OVERLAP", None)
d = pd.DataFrame(rows).dropna(subset=["ts"])
med = d.groupby(["model", "factor", "routing", "mode", "point"], sort=False).agg(
    ts=("ts", "median"), io_wait_s=("io_wait_s", "median"), hit=("hit_pct", "median")).reset_index()
print(med.round(3).to_string(index=False))
