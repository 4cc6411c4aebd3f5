#!/usr/bin/env python3
"""The sweep's decode comparison with repeats: for every setting of a ``tools/bench-stream-sweep.py`` run,
``defaults`` against that setting's best fixed point (by the single pass), ``--repeats`` times each,
interleaved (ABAB..., BABA.. on odd repeats), tg only, under the same limit and routing, cold cache.
One pass of four fixed points picks its best on single runs whose disk speed swings by a third from run
to run (the io wait of equal reads), so the max over them is biased up; this pass compares medians.

Writes OUT/sweep-confirm.csv (one row per run) and OUT/sweep-confirm-summary.csv (per setting: the two
medians and defaults / best). Usage: tools/bench-stream-confirm.py --out DIR --traces DIR A=a.gguf ...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import stream


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the sweep's folder")
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("models", nargs="+", help="NAME=MODEL.gguf")
    a = ap.parse_args()
    models = dict(m.split("=", 1) for m in a.models)
    settings = pd.read_csv(a.out / "sweep-settings.csv")
    rows = []
    for s in settings.itertuples():
        model = Path(models[s.model])
        budget, _, dense = s.best_fixed.removeprefix("stream:").partition("+")
        pts = [stream.StreamPoint("defaults", "auto"), stream.StreamPoint("stream", budget, dense or "auto")]
        from pybmoe.engine import memlimit
        with memlimit.MemoryLimit(int(s.limit_mib)) as lim:
            for rep in range(a.repeats):
                for pt in (pts if rep % 2 == 0 else pts[::-1]):
                    r = stream.run_point(model, pt, "tg", limit=lim, cold=True,
                                         log_path=a.out / "confirm-logs" / f"{s.model}-{s.factor:g}x-{s.routing}-"
                                                                           f"{pt.name.replace(':', '-')}-{rep}.log",
                                         n_prompt=1, n_gen=a.n_gen, threads=2, ubatch=512, io_threads=None,
                                         floor_mib=None, route_replay=a.traces / f"{s.routing}-{s.model}.csv")
                    rows.append(dict(model=s.model, factor=s.factor, routing=s.routing, limit_mib=s.limit_mib,
                                     point=pt.name, repeat=rep, ts=r["avg_ts"], hit_pct=r["stream_hit_pct"],
                                     io_wait_s=r["stream_io_wait_s"], read_mib_per_token=r["stream_read_mib_per_token"]))
        pd.DataFrame(rows).to_csv(a.out / "sweep-confirm.csv", index=False)
        print(f"{s.model} {s.factor:g}x {s.routing} done", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    med = df.groupby(["model", "factor", "routing", "point"], sort=False).ts.median().reset_index()
    out = []
    for key, g in med.groupby(["model", "factor", "routing"], sort=False):
        d = g[g.point == "defaults"].ts.iloc[0]
        b = g[g.point != "defaults"]
        out.append(dict(model=key[0], factor=key[1], routing=key[2], best_fixed=b.point.iloc[0],
                        defaults_tg=d, best_fixed_tg=b.ts.iloc[0], defaults_vs_best=d / b.ts.iloc[0]))
    summary = pd.DataFrame(out)
    summary.to_csv(a.out / "sweep-confirm-summary.csv", index=False)
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
