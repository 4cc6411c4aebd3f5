"""Issue 23's read shape: the tier's decode misses read in the GGUF's layout (one O_DIRECT read per
projection and run of consecutive experts, as ``read_jobs`` makes them) against a sidecar layout (one
record per expert, its projections back to back: one read per run), on each model's own file, 4 lanes,
the same experts both ways (:func:`pybmoe.bench.disk.probe` with ``top_k`` and ``layout``).

Two step patterns: decode (the model's top-k experts of one layer per step) and a prefill ubatch of 32
tokens (87 % of a layer's experts per step, which uniform routing gives there). Rounds rotate the order
(AB, BA, ...); each round reads new random experts (its seed), the same ones in both layouts.

    run-read-shape.py ROUNDS OUT.csv NAME=MODEL.gguf ...
"""
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import disk
from pybmoe.routing import sizing

rounds, out = int(sys.argv[1]), Path(sys.argv[2])
models = dict(a.split("=", 1) for a in sys.argv[3:])
rows = []
for rep in range(rounds):
    for name, path in models.items():
        shape = sizing.model_shape(path)
        for pattern, k in (("decode", shape.top_k), ("prefill-ub32", int(round(0.87 * shape.n_expert)))):
            layouts = ("gguf", "record") if rep % 2 == 0 else ("record", "gguf")
            for layout in layouts:
                p = disk.probe(path, lanes=4, total_mib=512.0, seed=rep, top_k=k, layout=layout)
                rows.append(dict(model=name, pattern=pattern, top_k=k, layout=layout, round=rep, mib_s=p.mib_s,
                                 reads=p.reads, seconds=p.seconds, largest_read_kib=p.read_bytes / 1024,
                                 direct=p.direct))
                print(name, pattern, layout, rep, f"{p.mib_s:.0f} MiB/s, {p.reads} reads", file=sys.stderr, flush=True)
        pd.DataFrame(rows).to_csv(out, index=False)
d = pd.DataFrame(rows)
m = d.groupby(["model", "pattern", "layout"], sort=False).mib_s.median().unstack("layout")
# per round, record over gguf (the same experts), then the median of the ratios
r = d.pivot_table(index=["model", "pattern", "round"], columns="layout", values="mib_s")
m["record_vs_gguf"] = (r.record / r.gguf).groupby(["model", "pattern"], sort=False).median()
print(m.round(3).to_string())
