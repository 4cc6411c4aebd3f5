#!/usr/bin/env python3
"""The sweep's comparisons with repeats, per setting of a ``tools/bench-stream-sweep.py`` run:

- ``tg``: ``defaults`` against that setting's best fixed point (by the sweep's single pass);
- ``pp``: ``defaults`` against stock mmap (prefill, ``-p 32``, the sweep's prompt).

``--repeats`` times each, interleaved (AB, BA on odd repeats), under the same limit and routing, from a
cold page cache. One pass of four fixed points picks its best on single runs whose disk speed swings by a
third from run to run (the io wait of equal reads), so the max over them is biased up; this pass
compares medians.

Writes OUT/sweep-confirm.csv (one row per run, with its mode) and OUT/sweep-confirm-summary.csv (per
setting and mode: the two medians and defaults / the other). ``--settings`` names the sweep's
sweep-settings.csv when OUT is a new folder (default: OUT/sweep-settings.csv).

Usage: tools/bench-stream-confirm.py --out DIR --traces DIR [--settings CSV] [--modes tg,pp] A=a.gguf ...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import stream
from pybmoe.engine import memlimit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where the CSVs and logs go")
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--settings", type=Path, help="the sweep's sweep-settings.csv (default: OUT/sweep-settings.csv)")
    ap.add_argument("--modes", default="tg", help="tg (defaults against the best fixed point), pp (against mmap)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-p", "--n-prompt", type=int, default=32)
    ap.add_argument("models", nargs="+", help="NAME=MODEL.gguf")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"tg", "pp"}:
        ap.error(f"--modes takes tg and/or pp, got {a.modes!r}")
    models = dict(m.split("=", 1) for m in a.models)
    settings = pd.read_csv(a.settings or a.out / "sweep-settings.csv")
    settings = settings[settings.model.isin(list(models))]
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in settings.itertuples():
        model = Path(models[s.model])
        budget, _, dense = s.best_fixed.removeprefix("stream:").partition("+")
        against = {"tg": stream.StreamPoint("stream", budget, dense or "auto"), "pp": stream.StreamPoint("mmap")}
        with memlimit.MemoryLimit(int(s.limit_mib)) as lim:
            for mode in modes:
                pts = [stream.StreamPoint("defaults", "auto"), against[mode]]
                for rep in range(a.repeats):
                    for pt in (pts if rep % 2 == 0 else pts[::-1]):
                        log = a.out / "confirm-logs" / f"{s.model}-{s.factor:g}x-{s.routing}-{mode}-{pt.name.replace(':', '-')}-{rep}.log"
                        r = stream.run_point(model, pt, mode, limit=lim, cold=True, log_path=log,
                                             n_prompt=a.n_prompt if mode == "pp" else 1, n_gen=a.n_gen, threads=2,
                                             ubatch=512, io_threads=None, floor_mib=None,
                                             route_replay=a.traces / f"{s.routing}-{s.model}.csv")
                        rows.append(dict(model=s.model, factor=s.factor, routing=s.routing, limit_mib=s.limit_mib,
                                         mode=mode, point=pt.name, repeat=rep, ts=r["avg_ts"],
                                         hit_pct=r.get("stream_hit_pct"), io_wait_s=r.get("stream_io_wait_s"),
                                         read_mib_per_token=r.get("stream_read_mib_per_token"),
                                         budget_mb=r.get("stream_budget_after_contexts_mb") or r.get("stream_budget_mb"),
                                         peak_mib=r.get("peak_mib")))
                        print(f"{s.model} {s.factor:g}x {s.routing} {mode} {pt.name} {rep}: {r['avg_ts']:.2f} tok/s",
                              file=sys.stderr, flush=True)
                pd.DataFrame(rows).to_csv(a.out / "sweep-confirm.csv", index=False)
    df = pd.DataFrame(rows)
    med = df.groupby(["model", "factor", "routing", "mode", "point"], sort=False).ts.median().reset_index()
    out = []
    for key, g in med.groupby(["model", "factor", "routing", "mode"], sort=False):
        d = g[g.point == "defaults"].ts.iloc[0]
        b = g[g.point != "defaults"]
        out.append(dict(model=key[0], factor=key[1], routing=key[2], mode=key[3], against=b.point.iloc[0],
                        defaults_ts=d, against_ts=b.ts.iloc[0], defaults_vs_against=d / b.ts.iloc[0]))
    summary = pd.DataFrame(out)
    summary.to_csv(a.out / "sweep-confirm-summary.csv", index=False)
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
