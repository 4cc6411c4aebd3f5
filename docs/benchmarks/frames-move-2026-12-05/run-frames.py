#!/usr/bin/env python3
"""Page frames moved (mremap, the default) against memfd frames (PYBMOE_MOE_STREAM_FRAMES=memfd) and stock
mmap, at the defaults (--moe-stream-cache-mb auto), under the limit (the file's size / FACTOR), cold,
rotating rounds. It needs the engine of commit e45111d (moved frames, PYBMOE_MOE_STREAM_FRAMES=memfd for the
old way); main keeps the memfd frames (docs/stream-tier.md, "Not done yet").

Usage: run-frames.py ROUNDS OUT.csv pp|tg FACTOR ROUTING [-p N] [-ub N] NAME=MODEL.gguf ...
(traces: /work/traces/ROUTING-NAME.csv; pp: -p N prompt tokens (32), tg: 32 tokens)."""
import argparse
import os
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import stream
from pybmoe.engine import memlimit

ap = argparse.ArgumentParser()
ap.add_argument("rounds", type=int)
ap.add_argument("out", type=Path)
ap.add_argument("mode", choices=["pp", "tg"])
ap.add_argument("factor", type=float)
ap.add_argument("routing")
ap.add_argument("-p", type=int, default=32)
ap.add_argument("-ub", type=int, default=512)
ap.add_argument("--traces", type=Path, default=Path("/work/traces"))
ap.add_argument("models", nargs="+")
a = ap.parse_args()
cfgs = [("mmap", stream.StreamPoint("mmap"), None), ("moved", stream.StreamPoint("defaults", "auto"), None),
        ("memfd", stream.StreamPoint("defaults", "auto"), "memfd")]
rows = []
for spec in a.models:
    name, _, path = spec.partition("=")
    model = Path(path)
    limit = int(model.stat().st_size / 2**20 / a.factor)
    with memlimit.MemoryLimit(limit) as lim:
        for rep in range(a.rounds):
            k = rep % len(cfgs)
            for label, pt, fr in cfgs[k:] + cfgs[:k]:
                if fr is None:
                    os.environ.pop("PYBMOE_MOE_STREAM_FRAMES", None)
                else:
                    os.environ["PYBMOE_MOE_STREAM_FRAMES"] = fr
                kw = dict(n_prompt=a.p, n_gen=0) if a.mode == "pp" else dict(n_prompt=0, n_gen=32)
                r = stream.run_point(model, pt, a.mode, limit=lim, cold=True,
                                     log_path=a.out.parent / "logs" / f"{a.out.stem}-{name}-{label}-{rep}.log",
                                     threads=2, ubatch=a.ub, io_threads=None, floor_mib=None,
                                     route_replay=a.traces / f"{a.routing}-{name}.csv", **kw)
                rows.append(dict(model=name, factor=a.factor, routing=a.routing, mode=a.mode, limit_mib=limit, point=label,
                                 repeat=rep, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"), read_mib=r.get("stream_read_mib"),
                                 io_wait_s=r.get("stream_io_wait_s"), budget_mb=r.get("stream_budget_after_contexts_mb")))
                print(name, label, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
                pd.DataFrame(rows).to_csv(a.out, index=False)
os.environ.pop("PYBMOE_MOE_STREAM_FRAMES", None)
d = pd.DataFrame(rows)
s = d.pivot_table(index="model", columns="point", values="ts", aggfunc="median")
s["moved / memfd"] = s["moved"] / s["memfd"]
s["moved / mmap"] = s["moved"] / s["mmap"]
print(s.round(3).to_string())
