"""The defaults against fixed points, decode (tg32, cold, rotating rounds, medians), under the memory limit of a
sweep setting, with the prefetch window lent to decode (every point: auto's window and a fixed budget's).
A run the kernel kills (out of memory) is a row with ``killed`` set and no speed.

    run-lend.py MODEL FACTOR TRACE ROUNDS OUT.csv BUDGET+DENSE ...

The runs kept here (the three settings under 90 % of the best fixed point before the lend):
    ... C-L16-E256-K8-q4_k.gguf 5 granite-C.csv 4 c5-granite.csv 279+anon 239+anon 239+mmap
    ... A-L24-E128-K8-q4_0.gguf 5 granite-A.csv 4 a5-granite.csv 454+mmap 413+mmap
    ... B-L24-E64-K4-q8_0.gguf 3 granite-B.csv 4 b3-granite.csv 777+mmap 739+mmap
    ... B-L24-E64-K4-q8_0.gguf 3 uniform-B.csv 3 b3-uniform-budgets.csv 518+mmap 600+mmap 686+mmap
        (B 3x uniform, under 90 % in the 18-setting confirm: the fixed point's budget and larger ones)
    ... A-L24-E128-K8-q4_0.gguf 3 uniform-A.csv 3 a3-uniform.csv 947+mmap
        (A 3x uniform, the other one under 90 % there)
The second budget of each is the first less the window a fixed budget lends (a quarter of a layer), so that
decode holds what the first held before the lend.
"""
import re
import sys
from pathlib import Path

import pandas as pd

from pybmoe import engine
from pybmoe.bench import stream
from pybmoe.engine import memlimit

model, factor, trace, rounds, out = sys.argv[1:6]
model, out = Path(model), Path(out)
limit = int(model.stat().st_size / 2**20 / float(factor))
pts = [stream.StreamPoint("defaults", "auto")]
for spec in sys.argv[6:]:
    budget, _, dense = spec.partition("+")
    pts.append(stream.StreamPoint("stream", budget, dense or "auto"))
rows = []
with memlimit.MemoryLimit(limit) as lim:
    for rep in range(int(rounds)):
        k = rep % len(pts)
        for pt in pts[k:] + pts[:k]:
            log = out.parent / "logs" / f"{out.stem}-{pt.name.replace(':', '-')}-{rep}.log"
            try:
                r = stream.run_point(model, pt, "tg", limit=lim, cold=True, log_path=log, n_prompt=1, n_gen=32,
                                     threads=2, ubatch=512, io_threads=None, floor_mib=None, route_replay=Path(trace))
            except engine.EngineError as e:
                rows.append(dict(point=pt.name, repeat=rep, killed=True, error=str(e).splitlines()[0][:200]))
                print(pt.name, rep, "failed:", str(e).splitlines()[0][:120], file=sys.stderr, flush=True)
                pd.DataFrame(rows).to_csv(out, index=False)
                continue
            rows.append(dict(point=pt.name, repeat=rep, killed=False, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"),
                             io_wait_s=r.get("stream_io_wait_s"), read_mib_per_token=r.get("stream_read_mib_per_token"),
                             budget_mb=r.get("stream_budget_after_contexts_mb") or r.get("stream_budget_mb"),
                             window_experts=int(re.search(r"prefetch_experts=(\d+)", log.read_text()).group(1)),
                             resident_mib=r.get("stream_resident_mib"),
                             major_faults=r.get("stream_major_faults"), peak_mib=r.get("peak_mib"), limit_mib=limit))
            print(pt.name, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
            pd.DataFrame(rows).to_csv(out, index=False)
d = pd.DataFrame(rows)
ok = d[~d.killed]
print(ok.groupby("point", sort=False).agg(ts=("ts", "median"), hit=("hit_pct", "median"), resident=("resident_mib", "median"),
                                         peak=("peak_mib", "median")).round(3).to_string())
print("killed:", d[d.killed].groupby("point").size().to_dict())
