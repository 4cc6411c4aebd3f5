"""Decode at the defaults with reads behind compute, by compute threads: ``-t 2`` or ``-t 1``, each blocking
(``PYBMOE_MOE_STREAM_OVERLAP=0``) or with reads behind compute (``=1``; ``-t 1`` leaves a core to the read
lanes). llama-bench -n 32, cold, under a sweep setting's limit, rotating rounds.

    run-threads.py ROUNDS OUT.csv [--configs LABEL,...] NAME=MODEL.gguf:FACTOR:TRACE ...

Logs go to OUT's folder, ``<OUT stem>-logs/`` (``threads.csv``'s, from before that rule, are in ``logs/``).
``--configs`` picks among t2-blocking, t2-overlap, t1-overlap and t1-blocking (default the first three).

The runs kept here:
    ... 3 t1-blocking.csv --configs t1-blocking,t1-overlap,t2-blocking C=C-L16-E256-K8-q4_k.gguf:3:granite-C.csv
        A=A-L24-E128-K8-q4_0.gguf:3:granite-A.csv B=B-L24-E64-K4-q8_0.gguf:3:uniform-B.csv
    ... 2 threads.csv C=C-L16-E256-K8-q4_k.gguf:3:granite-C.csv A=A-L24-E128-K8-q4_0.gguf:3:granite-A.csv
        B=B-L24-E64-K4-q8_0.gguf:3:uniform-B.csv
"""
import os
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import stream
from pybmoe.engine import memlimit

rounds, out = int(sys.argv[1]), Path(sys.argv[2])
known = {"t2-blocking": 2, "t2-overlap": 2, "t1-overlap": 1, "t1-blocking": 1}
args = sys.argv[3:]
labels = ["t2-blocking", "t2-overlap", "t1-overlap"]
if args[:1] == ["--configs"]:
    labels, args = args[1].split(","), args[2:]
configs = [(lab, known[lab], "1" if lab.endswith("overlap") else "0") for lab in labels]
rows = []
for spec in args:
    name, _, rest = spec.partition("=")
    model, factor, trace = rest.rsplit(":", 2)
    model, trace = Path(model), Path(trace)
    limit = int(model.stat().st_size / 2**20 / float(factor))
    routing = trace.stem.split("-")[0]
    with memlimit.MemoryLimit(limit) as lim:
        for rep in range(rounds):
            k = rep % len(configs)
            for label, threads, ov in configs[k:] + configs[:k]:
                os.environ["PYBMOE_MOE_STREAM_OVERLAP"] = ov
                log = out.parent / f"{out.stem}-logs" / f"{name}-{factor}x-{routing}-tg-{label}-{rep}.log"
                r = stream.run_point(model, stream.StreamPoint("defaults", "auto"), "tg", limit=lim, cold=True,
                                     log_path=log, n_prompt=1, n_gen=32, threads=threads, ubatch=512, io_threads=None,
                                     floor_mib=None, route_replay=trace)
                rows.append(dict(model=name, factor=float(factor), routing=routing, point=label, threads=threads,
                                 repeat=rep, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"),
                                 io_wait_s=r.get("stream_io_wait_s"), limit_mib=limit))
                print(name, label, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
                pd.DataFrame(rows).to_csv(out, index=False)
os.environ.pop("PYBMOE_MOE_STREAM_OVERLAP", None)
d = pd.DataFrame(rows)
print(d.groupby(["model", "point"], sort=False).agg(ts=("ts", "median"), io_wait_s=("io_wait_s", "median"))
      .round(3).to_string())
