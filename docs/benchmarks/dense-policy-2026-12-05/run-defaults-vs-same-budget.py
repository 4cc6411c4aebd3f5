"""The defaults against a fixed budget equal to theirs (after the contexts, mmap dense weights as auto picks) and
the setting's best fixed point (mmap), tg32, cold, rotating rounds, medians; is the defaults' slower decode
auto itself or its budget?

    run-defaults-vs-same-budget.py MODEL FACTOR TRACE SAME_MIB BEST_MIB ROUNDS OUT.csv

The two runs kept here:
    ... C-L16-E256-K8-q4_k.gguf 5 granite-C.csv 219 279 5 c5-granite-defaults-vs-same-budget-5-rounds.csv
        (and 3 rounds: c5-granite-defaults-vs-same-budget.csv)
    ... B-L24-E64-K4-q8_0.gguf 3 granite-B.csv 686 777 5 b3-granite-defaults-vs-same-budget.csv
"""
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import stream
from pybmoe.engine import memlimit

model, factor, trace, same, best, rounds, out = sys.argv[1:8]
model, out = Path(model), Path(out)
limit = int(model.stat().st_size / 2**20 / float(factor))
pts = [stream.StreamPoint("defaults", "auto"), stream.StreamPoint("stream", same, "mmap"),
       stream.StreamPoint("stream", best, "mmap")]
rows = []
with memlimit.MemoryLimit(limit) as lim:
    for rep in range(int(rounds)):
        k = rep % len(pts)
        for pt in pts[k:] + pts[:k]:
            r = stream.run_point(model, pt, "tg", limit=lim, cold=True,
                                 log_path=out.parent / "logs" / f"{pt.name.replace(':', '-')}-{rep}.log",
                                 n_prompt=1, n_gen=32, threads=2, ubatch=512, io_threads=None, floor_mib=None,
                                 route_replay=Path(trace))
            rows.append(dict(point=pt.name, repeat=rep, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"),
                             io_wait_s=r.get("stream_io_wait_s"), read_mib_per_token=r.get("stream_read_mib_per_token"),
                             peak_mib=r.get("peak_mib")))
            print(pt.name, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
            pd.DataFrame(rows).to_csv(out, index=False)
d = pd.DataFrame(rows)
d["ms_per_mib"] = d.io_wait_s * 1000 / (d.read_mib_per_token * 33)
print(d.groupby("point").agg(ts=("ts", "median"), hit=("hit_pct", "median"), ms_per_mib=("ms_per_mib", "median"),
                             peak=("peak_mib", "median")).round(3).to_string())
