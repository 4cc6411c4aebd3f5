"""Prefill (pp32, cold) at A 3x uniform: stock mmap, the defaults, and the defaults with a whole layer's
prefetch window (``PYBMOE_MOE_STREAM_PREFETCH=1``), rotating rounds.

    run-window.py A-L24-E128-K8-q4_0.gguf uniform-A.csv 3 window.csv
"""
import os, sys
from pathlib import Path
import pandas as pd
from pybmoe.bench import stream
from pybmoe.engine import memlimit
model = Path(sys.argv[1]); trace = Path(sys.argv[2]); rounds = int(sys.argv[3]); out = Path(sys.argv[4])
limit = int(model.stat().st_size / 2**20 / 3)
cfgs = [("mmap", stream.StreamPoint("mmap"), None), ("defaults", stream.StreamPoint("defaults", "auto"), None),
        ("window-layer", stream.StreamPoint("defaults", "auto"), "1")]
rows = []
with memlimit.MemoryLimit(limit) as lim:
    for rep in range(rounds):
        k = rep % len(cfgs)
        for label, pt, pf in cfgs[k:] + cfgs[:k]:
            if pf is None:
                os.environ.pop("PYBMOE_MOE_STREAM_PREFETCH", None)
            else:
                os.environ["PYBMOE_MOE_STREAM_PREFETCH"] = pf
            r = stream.run_point(model, pt, "pp", limit=lim, cold=True, log_path=out.parent / "logs" / f"{out.stem}-{label}-{rep}.log",
                                 n_prompt=32, n_gen=0, threads=2, ubatch=512, io_threads=None, floor_mib=None, route_replay=trace)
            rows.append(dict(point=label, repeat=rep, ts=r["avg_ts"], hit=r.get("stream_hit_pct"), read=r.get("stream_read_mib"),
                             io=r.get("stream_io_wait_s"), budget=r.get("stream_budget_after_contexts_mb"), window=r.get("stream_prefetch_experts")))
            print(label, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
            pd.DataFrame(rows).to_csv(out, index=False)
d = pd.DataFrame(rows)
print(d.groupby("point").agg(ts=("ts", "median"), hit=("hit", "median"), read=("read", "median"), io=("io", "median"), budget=("budget", "median"), window=("window", "median")).to_string())
