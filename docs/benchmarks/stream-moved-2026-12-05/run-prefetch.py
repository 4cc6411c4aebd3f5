#!/usr/bin/env python3
"""Prefill at the defaults with the prefetch's new order (the likeliest experts first, one read per expert
and projection, the reads of experts the next step does not want dropped unread) against the prefetch
before it (PYBMOE_MOE_STREAM_PREFETCH_ORDER=id: the first non-resident experts by id, in runs of consecutive
ids, none dropped) and stock mmap. llama-bench -p 32, 2 threads, cold, under the limit (the file's size /
FACTOR), rotating rounds, medians, tok/s.

    run-prefetch.py ROUNDS OUT.csv FACTOR ROUTINGS NAME=MODEL.gguf ...   (traces: /work/traces/ROUTING-NAME.csv)

It needs the engine with prefetch-drop.patch applied (the prefetch measured here, not kept: README.md);
main has no PYBMOE_MOE_STREAM_PREFETCH_ORDER, so its two stream points would be the same.
"""
import os
import re
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import stream
from pybmoe.engine import memlimit

rounds, out, factor, routings = int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split(",")
configs = [("mmap", stream.StreamPoint("mmap"), {}), ("defaults", stream.StreamPoint("defaults", "auto"), {}),
           ("by-id", stream.StreamPoint("defaults", "auto"), {"PYBMOE_MOE_STREAM_PREFETCH_ORDER": "id"})]
logs = out.parent / f"{out.stem}-logs"
rows = []
for spec in sys.argv[5:]:
    name, _, path = spec.partition("=")
    model = Path(path)
    limit = int(model.stat().st_size / 2**20 / factor)
    for routing in routings:
        trace = Path("/work/traces") / f"{routing}-{name}.csv"
        with memlimit.MemoryLimit(limit) as lim:
            for rep in range(rounds):
                k = rep % len(configs)
                for label, pt, env in configs[k:] + configs[:k]:
                    os.environ.pop("PYBMOE_MOE_STREAM_PREFETCH_ORDER", None)
                    os.environ.update(env)
                    log = logs / f"{name}-{factor:g}x-{routing}-{label}-{rep}.log"
                    r = stream.run_point(model, pt, "pp", limit=lim, cold=True, log_path=log, n_prompt=32, n_gen=0,
                                         threads=2, ubatch=512, io_threads=None, floor_mib=None, route_replay=trace)
                    m = re.search(r"prefetched ([\d.]+) MiB \(([\d.]+) MiB of it used(?:, ([\d.]+) MiB dropped unread)?\)",
                                  log.read_text())
                    rows.append(dict(model=name, factor=factor, routing=routing, limit_mib=limit, point=label, repeat=rep,
                                     ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"), read_mib=r.get("stream_read_mib"),
                                     io_wait_s=r.get("stream_io_wait_s"), block_read_mib=r["read_mib"],
                                     prefetch_mib=float(m.group(1)) if m else None,
                                     prefetch_used_mib=float(m.group(2)) if m else None,
                                     prefetch_dropped_mib=float(m.group(3)) if m and m.group(3) else None))
                    print(name, routing, label, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
                    pd.DataFrame(rows).to_csv(out, index=False)
os.environ.pop("PYBMOE_MOE_STREAM_PREFETCH_ORDER", None)
d = pd.DataFrame(rows)
s = d.pivot_table(index=["model", "routing"], columns="point", values="ts", aggfunc="median")
s["defaults / mmap"] = s["defaults"] / s["mmap"]
s["by-id / mmap"] = s["by-id"] / s["mmap"]
s["defaults / by-id"] = s["defaults"] / s["by-id"]
w = d.groupby(["model", "routing", "point"]).agg(waste=("prefetch_mib", "median"), used=("prefetch_used_mib", "median"))
s["prefetch waste MiB, defaults"] = (w.waste - w.used).xs("defaults", level="point")
s["prefetch waste MiB, by-id"] = (w.waste - w.used).xs("by-id", level="point")
s.reset_index().to_csv(out.with_name(out.stem + "-summary.csv"), index=False)
print(s.round(3).to_string())
