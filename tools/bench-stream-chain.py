#!/usr/bin/env python3
"""Decode at the defaults against the chain limit and issue 23's overlapped limit.

For each model (NAME=MODEL.gguf:TWIN.gguf, the twin the same model with narrow experts:
``pybmoe-make-synth ... --n-ff-exp 32``, or 256 for Q4_K):

1. the all-resident decode of the model and of its twin, ``--resident-runs`` warm runs each
   (both files read into the page cache first), interleaved, no limit: the expert matmuls' seconds per token
   (:func:`pybmoe.bench.stream.expert_seconds`) and the compute (1 / the model's median);
2. for each routing (``TRACES/ROUTING-NAME.csv``), under the limit file size / ``--factor``,
   ``--rounds`` rotating rounds of the points ``defaults`` (``--moe-stream-cache-mb auto`` and nothing
   else), ``overlap`` and ``blocking`` (the same with ``PYBMOE_MOE_STREAM_OVERLAP=1`` and ``0``: reads
   behind compute forced on and off at 2 compute threads, where the auto rule times both ways; the
   first run of this tool, before that rule, had no ``blocking`` point: there the defaults were
   blocking), ``llama-bench -n 32 -t 2``, cold; the disk
   probed (:func:`pybmoe.bench.disk.probe`) right before and right after each run, the run's bandwidth
   their mean.

Each run gets ``limit_ts``, ``overlap_limit_ts`` and ``chain_limit_ts`` with the measured tok/s over each
(:func:`pybmoe.bench.stream.limit_columns`, module doc of :mod:`pybmoe.bench.stream`). Writes
``OUT/chain.csv`` (one row per run), ``OUT/chain-summary.csv`` (medians per model, routing and point),
``OUT/chain-resident.csv``, ``OUT/chain.png`` and ``OUT/logs/``.

    tools/bench-stream-chain.py --out DIR A=/work/models/A.gguf:/work/exp/A-ff32.gguf ...
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from pybmoe.bench import disk, stream
from pybmoe.engine import memlimit

POINTS = [("defaults", {}), ("overlap", {"PYBMOE_MOE_STREAM_OVERLAP": "1"}), ("blocking", {"PYBMOE_MOE_STREAM_OVERLAP": "0"})]


def n_ff_exp(model: Path) -> int:
    """The model's expert FFN width, elements, from its GGUF header."""
    import gguf
    r = gguf.GGUFReader(str(model))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    f = r.fields.get(f"{arch}.expert_feed_forward_length")
    if f is None:
        raise SystemExit(f"{model}: no {arch}.expert_feed_forward_length in its header")
    return int(f.parts[-1][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="NAME=MODEL.gguf:TWIN.gguf")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--resident-runs", type=int, default=3)
    ap.add_argument("--routings", default="uniform,granite")
    ap.add_argument("--traces", type=Path, default=Path("/work/traces"))
    a = ap.parse_args()
    models = []
    for spec in a.models:
        name, _, paths = spec.partition("=")
        model, _, twin = paths.partition(":")
        if not (name and model and twin):
            ap.error(f"not NAME=MODEL.gguf:TWIN.gguf: {spec}")
        models.append((name, Path(model), Path(twin)))
    a.out.mkdir(parents=True, exist_ok=True)
    logs = a.out / "logs"
    rows, res_rows = [], []
    for name, model, twin in models:
        ff, tff = n_ff_exp(model), n_ff_exp(twin)
        ts = {"model": [], "twin": []}
        stream.warm_page_cache(model)  # all resident: every page in RAM before the timed runs
        stream.warm_page_cache(twin)
        for i in range(a.resident_runs):
            for kind, path in (("model", model), ("twin", twin))[::1 if i % 2 == 0 else -1]:
                r = stream.run_point(path, stream.StreamPoint("resident"), "tg", limit=None, cold=False,
                                     log_path=logs / f"{name}-resident-{kind}-{i}.log", n_prompt=0, n_gen=32,
                                     threads=2, ubatch=512, io_threads=None, floor_mib=None, route_replay=None)
                ts[kind].append(r["avg_ts"])
                res_rows.append(dict(model=name, kind=kind, n_ff_exp=ff if kind == "model" else tff, run=i,
                                     ts=r["avg_ts"]))
        resident, twin_ts = float(np.median(ts["model"])), float(np.median(ts["twin"]))
        expert = stream.expert_seconds(resident, twin_ts, ff, tff)
        pd.DataFrame(res_rows).to_csv(a.out / "chain-resident.csv", index=False)
        print(f"{name}: resident {resident:.2f} tok/s, twin {twin_ts:.2f}, expert {expert * 1e3:.1f} ms "
              f"of {1e3 / resident:.1f} ms per token", file=sys.stderr, flush=True)
        limit = int(model.stat().st_size / 2**20 / a.factor)
        for routing in a.routings.split(","):
            trace = a.traces / f"{routing}-{name}.csv"
            with memlimit.MemoryLimit(limit) as lim:
                for rep in range(a.rounds):
                    k = rep % len(POINTS)
                    for label, env in POINTS[k:] + POINTS[:k]:
                        before = disk.probe(model).mib_s
                        os.environ.pop("PYBMOE_MOE_STREAM_OVERLAP", None)  # the caller's, too
                        os.environ.update(env)
                        try:
                            r = stream.run_point(model, stream.StreamPoint("defaults", "auto"), "tg", limit=lim,
                                                 cold=True, log_path=logs / f"{name}-{a.factor:g}x-{routing}-{label}-{rep}.log",
                                                 n_prompt=0, n_gen=32, threads=2, ubatch=512, io_threads=None,
                                                 floor_mib=None, route_replay=trace)
                        finally:
                            os.environ.pop("PYBMOE_MOE_STREAM_OVERLAP", None)
                        after = disk.probe(model).mib_s
                        bw = (before + after) / 2
                        miss = r.get("stream_read_mib_per_token")
                        rows.append(dict(model=name, factor=a.factor, routing=routing, limit_mib=limit, point=label,
                                         repeat=rep, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"),
                                         io_wait_s=r.get("stream_io_wait_s"), miss_mib_per_token=miss,
                                         probe_before=before, probe_after=after, probe_mib_s=bw,
                                         resident_ts=resident, expert_s_per_token=expert,
                                         **stream.limit_columns(r["avg_ts"], miss, bw, 1.0 / resident, expert)))
                        print(f"{name} {routing} {label} {rep}: {r['avg_ts']:.2f} tok/s, probe {before:.0f}/{after:.0f}, "
                              f"chain {rows[-1]['vs_chain_limit']:.3f}, overlapped {rows[-1]['vs_overlap_limit']:.3f}",
                              file=sys.stderr, flush=True)
                        pd.DataFrame(rows).to_csv(a.out / "chain.csv", index=False)
    d = pd.DataFrame(rows)
    s = d.groupby(["model", "routing", "point"], sort=False).agg(
        ts=("ts", "median"), ts_min=("ts", "min"), ts_max=("ts", "max"), hit_pct=("hit_pct", "median"),
        miss_mib_per_token=("miss_mib_per_token", "median"), probe_mib_s=("probe_mib_s", "median"),
        io_wait_s=("io_wait_s", "median"), vs_limit=("vs_limit", "median"),
        vs_chain_limit=("vs_chain_limit", "median"), vs_overlap_limit=("vs_overlap_limit", "median")).reset_index()
    s.to_csv(a.out / "chain-summary.csv", index=False)
    print(s.round(3).to_string(index=False))
    plot(s, a.out / "chain.png")


def plot(s: pd.DataFrame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = s[s.point == "defaults"]
    labels = [f"{m} {r}" for m, r in zip(d.model, d.routing)]
    x = np.arange(len(d))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (col, lab) in enumerate([("vs_limit", "serial limit"), ("vs_chain_limit", "chain limit"),
                                    ("vs_overlap_limit", "overlapped limit")]):
        ax.bar(x + (i - 1) * 0.27, d[col], 0.27, label=f"defaults / {lab}")
    ax.axhline(0.9, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, labels)
    ax.set_ylabel("measured / limit (median)")
    ax.set_title("decode at the defaults, 3x limit: measured over each limit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
