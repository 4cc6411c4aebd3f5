#!/usr/bin/env python3
"""Decode at the defaults with the moved page frames (mremap with MREMAP_DONTUNMAP, the default since
2026-12-05), against the same with reads behind compute forced on at 2 compute threads
(PYBMOE_MOE_STREAM_OVERLAP=1: the auto rule keeps it off where the compute threads take every CPU) and the
memfd frames (PYBMOE_MOE_STREAM_FRAMES=memfd, the default before). llama-bench -n 32, 2 threads, cold,
under the limit (the file's size / FACTOR), rotating rounds; the disk probed before each round and the
all-resident decode measured first, for each run's limits (pybmoe.bench.stream.limit_columns).

    run-decode.py ROUNDS OUT.csv FACTOR ROUTINGS NAME=MODEL.gguf ...   (traces: /work/traces/ROUTING-NAME.csv)
"""
import os
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import disk, stream
from pybmoe.engine import memlimit

rounds, out, factor, routings = int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split(",")
configs = [("defaults", {}), ("overlap", {"PYBMOE_MOE_STREAM_OVERLAP": "1"}),
           ("memfd", {"PYBMOE_MOE_STREAM_FRAMES": "memfd"})]
logs = out.parent / f"{out.stem}-logs"
rows = []
for spec in sys.argv[5:]:
    name, _, path = spec.partition("=")
    model = Path(path)
    resident = stream.resident_ts(model, "tg", logs, name, n_prompt=0, n_gen=32)
    print(name, "resident", round(resident, 2), file=sys.stderr, flush=True)
    limit = int(model.stat().st_size / 2**20 / factor)
    for routing in routings:
        trace = Path("/work/traces") / f"{routing}-{name}.csv"
        with memlimit.MemoryLimit(limit) as lim:
            for rep in range(rounds):
                bw = disk.probe(model).mib_s
                k = rep % len(configs)
                for label, env in configs[k:] + configs[:k]:
                    for v in ("PYBMOE_MOE_STREAM_OVERLAP", "PYBMOE_MOE_STREAM_FRAMES"):
                        os.environ.pop(v, None)
                    os.environ.update(env)
                    r = stream.run_point(model, stream.StreamPoint("defaults", "auto"), "tg", limit=lim, cold=True,
                                         log_path=logs / f"{name}-{factor:g}x-{routing}-{label}-{rep}.log",
                                         n_prompt=0, n_gen=32, threads=2, ubatch=512, io_threads=None,
                                         floor_mib=None, route_replay=trace)
                    miss = r.get("stream_read_mib_per_token")
                    rows.append(dict(model=name, factor=factor, routing=routing, limit_mib=limit, point=label,
                                     repeat=rep, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"),
                                     read_mib=r.get("stream_read_mib"), io_wait_s=r.get("stream_io_wait_s"),
                                     resident_ts=resident, probe_mib_s=bw, miss_mib_per_token=miss,
                                     **stream.limit_columns(r["avg_ts"], miss, bw, 1.0 / resident)))
                    print(name, routing, label, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
                    pd.DataFrame(rows).to_csv(out, index=False)
for v in ("PYBMOE_MOE_STREAM_OVERLAP", "PYBMOE_MOE_STREAM_FRAMES"):
    os.environ.pop(v, None)
d = pd.DataFrame(rows)
s = d.groupby(["model", "routing", "point"], sort=False).agg(
    ts=("ts", "median"), io_wait_s=("io_wait_s", "median"), hit_pct=("hit_pct", "median"),
    vs_limit=("vs_limit", "median"), vs_overlap_limit=("vs_overlap_limit", "median")).reset_index()
base = s[s.point == "defaults"].set_index(["model", "routing"]).ts
s["/ defaults"] = [t / base[(m, r)] for m, r, t in zip(s.model, s.routing, s.ts)]
s.to_csv(out.with_name(out.stem + "-summary.csv"), index=False)
print(s.round(3).to_string(index=False))
