#!/usr/bin/env python3
"""Prefill at the disk tier's defaults against stock mmap, and the scan guard against plain LRU
(docs/benchmarks/stream-prefill-2026-12-04/README.md and the runs after it).

For every model (``NAME=MODEL.gguf``; its routing traces are ``--traces DIR/ROUTING-NAME.csv``), every
limit factor (the cgroup limit is the file's size divided by it) and every routing, ``--repeats``
interleaved rounds (the order of the points rotates each round) of ``llama-bench -p N -n 0`` from a
cold page cache under the limit, at these points:

- ``mmap``: stock llama.cpp;
- ``defaults``: ``--moe-stream-cache-mb auto`` and nothing else (the policy ``global-lru-scan``);
- ``defaults/global-lru``: the same with ``PYBMOE_MOE_STREAM_POLICY=global-lru`` (the tier before
  the scan guard), unless ``--no-plain``.

Writes OUT/prefill-runs.csv (one row per run), OUT/prefill-summary.csv (per setting: each point's
median tok/s, min and max, and defaults / mmap, defaults / plain LRU), OUT/prefill.png and the runs'
logs (OUT/logs/).

``--limits``: each run's limit too (:func:`pybmoe.bench.stream.limit_ts`, issue 23's bound): each
model's all-resident prefill first (3 warm runs without a limit, median), the disk probed before each
round (:func:`pybmoe.bench.disk.probe`, random projections, 4 lanes), and per run ``probe_mib_s``,
``miss_mib_per_token`` (the tier's reads per token; mmap's block input per token, the load included),
``limit_ts``, ``overlap_limit_ts``, ``vs_limit`` and ``vs_overlap_limit``; the summary adds the
defaults' medians of the last four.

Usage: tools/bench-stream-prefill.py --out DIR --traces DIR [--factors 2,3,5] [--routings uniform,granite]
       [--repeats 3] [-p 32] A=a.gguf B=b.gguf ...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from pybmoe import engine
from pybmoe.bench import disk, stream
from pybmoe.engine import memlimit

MIB = 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where the CSVs, the plot and the logs go")
    ap.add_argument("--traces", type=Path, required=True, help="ROUTING-NAME.csv for every model and routing")
    ap.add_argument("--factors", default="2,3,5", help="limits: the model's size divided by each (default 2,3,5)")
    ap.add_argument("--routings", default="uniform,granite")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=32, help="prompt tokens (default 32, the sweep's)")
    ap.add_argument("--no-plain", action="store_true", help="leave out the plain-LRU point")
    ap.add_argument("--limits", action="store_true", help="each run's limit (see above)")
    ap.add_argument("models", nargs="+", help="NAME=MODEL.gguf")
    a = ap.parse_args()
    try:
        factors = [float(f) for f in a.factors.split(",") if f]
    except ValueError:
        ap.error(f"--factors takes numbers, got {a.factors!r}")
    routings = [r for r in a.routings.split(",") if r]
    models = {}
    for m in a.models:
        name, sep, path = m.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"{m!r}: expected NAME=MODEL.gguf naming a file")
        models[name] = Path(path)
    for name in models:
        for routing in routings:
            if not (a.traces / f"{routing}-{name}.csv").is_file():
                ap.error(f"no trace {a.traces / f'{routing}-{name}.csv'}")
    pts = [stream.StreamPoint("mmap"), stream.StreamPoint("defaults", "auto")]
    if not a.no_plain:
        pts.append(stream.StreamPoint("defaults", "auto", policy="global-lru"))
    a.out.mkdir(parents=True, exist_ok=True)
    resident = {}
    if a.limits:
        for name, model in models.items():
            resident[name] = stream.resident_ts(model, "pp", a.out / "logs", name, n_prompt=a.n_prompt, n_gen=0)
            print(f"{name} resident pp{a.n_prompt}: {resident[name]:.2f} tok/s", file=sys.stderr, flush=True)
    rows = []
    for name, model in models.items():
        for factor in factors:
            limit = int(model.stat().st_size / MIB / factor)
            for routing in routings:
                with memlimit.MemoryLimit(limit) as lim:
                    for rep in range(a.repeats):
                        bw = disk.probe(model).mib_s if a.limits else np.nan
                        k = rep % len(pts)
                        for pt in pts[k:] + pts[:k]:
                            tag = f"{name}-{factor:g}x-{routing}-{pt.name.replace(':', '-').replace('/', '-')}-{rep}"
                            try:
                                r = stream.run_point(model, pt, "pp", limit=lim, cold=True,
                                                     log_path=a.out / "logs" / f"{tag}.log", n_prompt=a.n_prompt, n_gen=0,
                                                     threads=2, ubatch=512, io_threads=None, floor_mib=None,
                                                     route_replay=a.traces / f"{routing}-{name}.csv")
                            except engine.EngineError as e:
                                # a point that does not load here (the tier refused the limit) is a row too
                                why = [ln for ln in str(e).splitlines() if "moe-stream" in ln and "minimum" in ln]
                                rows.append(dict(model=name, factor=factor, routing=routing, limit_mib=limit, point=pt.name,
                                                 repeat=rep, ts=np.nan, refused=(why or [str(e)[:300]])[-1]))
                                print(f"{tag}: refused", file=sys.stderr, flush=True)
                                continue
                            rows.append(dict(model=name, factor=factor, routing=routing, limit_mib=limit, point=pt.name,
                                             repeat=rep, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"),
                                             read_mib=r.get("stream_read_mib"), io_wait_s=r.get("stream_io_wait_s"),
                                             block_read_mib=r["read_mib"], major_faults=r["major_faults"],
                                             budget_mb=r.get("stream_budget_after_contexts_mb") or r.get("stream_budget_mb"),
                                             peak_mib=r.get("peak_mib")))
                            if a.limits:
                                miss = r.get("stream_read_mib_per_token") if pt.kind == "defaults" else r["read_mib_per_token"]
                                rows[-1].update(resident_ts=resident[name], probe_mib_s=bw, miss_mib_per_token=miss,
                                                **stream.limit_columns(r["avg_ts"], miss, bw, 1.0 / resident[name]))
                            print(f"{tag}: {r['avg_ts']:.2f} tok/s", file=sys.stderr, flush=True)
                            pd.DataFrame(rows).to_csv(a.out / "prefill-runs.csv", index=False)
    runs = pd.DataFrame(rows)
    keys = ["model", "factor", "routing", "limit_mib"]
    med = runs.pivot_table(index=keys, columns="point", values="ts", aggfunc="median")
    lo = runs.pivot_table(index=keys, columns="point", values="ts", aggfunc="min").add_suffix(" min")
    hi = runs.pivot_table(index=keys, columns="point", values="ts", aggfunc="max").add_suffix(" max")
    s = pd.concat([med, lo, hi], axis=1)
    s["defaults / mmap"] = s["defaults"] / s["mmap"]
    if "defaults/global-lru" in s:
        s["defaults / plain lru"] = s["defaults"] / s["defaults/global-lru"]
        hit = runs.pivot_table(index=keys, columns="point", values="hit_pct", aggfunc="median")
        s["hit % scan"] = hit["defaults"]
        s["hit % plain"] = hit["defaults/global-lru"]
    if a.limits:
        d = runs[runs.point == "defaults"]
        for col in ("limit_ts", "vs_limit", "overlap_limit_ts", "vs_overlap_limit"):
            s[f"defaults {col}"] = d.groupby(keys)[col].median()
    s = s.reset_index()
    s.to_csv(a.out / "prefill-summary.csv", index=False)
    plot(s, a.out / "prefill.png", a.n_prompt)
    print(s[[c for c in s.columns if " min" not in c and " max" not in c]].to_string(index=False))
    return 0


def plot(s: pd.DataFrame, path: Path, n_prompt: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(s)), 3.8))
    x = np.arange(len(s))
    ax.bar(x - 0.2, s["defaults / mmap"], 0.4, label="defaults / mmap", color="#cc6677")
    if "defaults / plain lru" in s:
        ax.bar(x + 0.2, s["defaults / plain lru"], 0.4, label="scan guard / plain LRU", color="#4477aa")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, [f"{r.model} {r.factor:g}x {r.routing}" for r in s.itertuples()], rotation=60, ha="right",
                  fontsize=8)
    ax.set_ylabel(f"prefill (pp{n_prompt}) ratio, medians")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
