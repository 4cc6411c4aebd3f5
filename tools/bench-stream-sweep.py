#!/usr/bin/env python3
"""The disk tier's defaults against stock mmap and a sweep of fixed budgets
(docs/benchmarks/stream-defaults-2026-12-03/README.md).

For every model given (``NAME=MODEL.gguf``, with ``NAME`` naming its two routing traces
``--traces DIR/uniform-NAME.csv`` and ``DIR/granite-NAME.csv``), every limit factor (the cgroup limit
is the model's file size divided by it) and every routing, one :func:`pybmoe.bench.stream.bench_stream`
run: stock mmap, ``defaults`` (``--moe-stream-cache-mb auto`` and nothing else), and fixed budgets
of 60 % and 90 % of the room (limit - dense weights - 100 MiB) with ``--dense-weights mmap`` and
``anon``. Then, per model at one limit, the load: ``pybmoe-logits -n 1`` (load, a short prompt and
one token) under the limit from a cold page cache, stock / defaults / defaults with the load's
lazy ranges off (``PYBMOE_MOE_STREAM_LAZY_LOAD=0``, the engine before), its wall time and block input.

Writes ``OUT/sweep-summary.csv`` (one row per setting, point and mode), ``OUT/sweep-settings.csv``
(per setting: defaults against mmap and against the best fixed point), ``OUT/sweep-load.csv``,
``OUT/sweep.png`` and each setting's own folder (bench_stream's CSVs, plots, logs).

Usage: tools/bench-stream-sweep.py --out DIR --traces DIR A=a.gguf B=b.gguf ... [--factors 2,3,5]
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from pybmoe import engine
from pybmoe.bench import stream
from pybmoe.engine import memlimit

MIB = 2**20


def dense_mib(model: Path) -> float:
    """MiB of the tensors that are not experts (the file's tensors, read with gguf)."""
    import gguf
    r = gguf.GGUFReader(str(model))
    return sum(int(t.n_bytes) for t in r.tensors if "_exps.weight" not in t.name) / MIB


def run_setting(name: str, model: Path, factor: float, routing: str, trace: Path, out: Path, args) -> pd.DataFrame:
    size = model.stat().st_size / MIB
    limit = int(size / factor)
    room = limit - dense_mib(model) - 100
    budgets = [str(int(room * f)) for f in (0.6, 0.9)]
    d = out / f"{name}-{factor:g}x-{routing}"
    res = stream.bench_stream(model, d, limit_mib=limit, budgets=budgets, dense=["mmap", "anon"], dense_only=True,
                              n_prompt=args.n_prompt, n_gen=args.n_gen, n_gen_mmap=args.n_gen_mmap,
                              repeats=args.repeats, threads=2,
                              route_replay=trace, include_resident=False)
    s = res.summary.copy()
    s.insert(0, "routing", routing)
    s.insert(0, "limit_mib", limit)
    s.insert(0, "factor", factor)
    s.insert(0, "model_mib", round(size))
    s.insert(0, "model", name)
    budget = res.runs.groupby("point").stream_budget_mb.median()
    s["budget_mb"] = [budget.get(p, np.nan) for p in s.point]
    return s


def settings_table(summary: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for key, g in summary.groupby(["model", "factor", "routing"], sort=False):
        tg, pp = g[g["mode"] == "tg"].set_index("point"), g[g["mode"] == "pp"].set_index("point")
        fixed = tg[tg.index.str.startswith("stream:")]
        best = fixed.median_ts.idxmax()
        rows.append(dict(model=key[0], factor=key[1], routing=key[2], limit_mib=int(g.limit_mib.iloc[0]),
                         defaults_budget_mb=tg.loc["defaults", "budget_mb"],
                         mmap_tg=tg.loc["mmap", "median_ts"], defaults_tg=tg.loc["defaults", "median_ts"],
                         defaults_tg_vs_mmap=tg.loc["defaults", "ratio"], best_fixed=best,
                         best_fixed_tg=fixed.median_ts.max(),
                         defaults_vs_best=tg.loc["defaults", "median_ts"] / fixed.median_ts.max(),
                         mmap_pp=pp.loc["mmap", "median_ts"], defaults_pp=pp.loc["defaults", "median_ts"],
                         defaults_pp_vs_mmap=pp.loc["defaults", "ratio"],
                         defaults_hit_pct=tg.loc["defaults", "median_hit_pct"],
                         defaults_majflt_per_token=tg.loc["defaults", "median_majflt_per_token"],
                         defaults_peak_mib=tg.loc["defaults", "median_peak_mib"]))
    return pd.DataFrame(rows)


def load_runs(name: str, model: Path, factor: float, out: Path) -> list[dict]:
    """Load + a short prompt + one token, cold, under the limit: wall time and block input."""
    import os
    limit = int(model.stat().st_size / MIB / factor)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for point, extra, env in (("mmap", [], {}), ("defaults", ["--moe-stream-cache-mb", "auto"], {}),
                                  ("defaults, lazy load off", ["--moe-stream-cache-mb", "auto"],
                                   {"PYBMOE_MOE_STREAM_LAZY_LOAD": "0"})):
            cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", f"{tmp}/l.bin", "-m", str(model),
                   "-p", "Hello", "-n", "1", "-c", "256", "-t", "2", "-ngl", "0", "--no-repack", *extra]
            with memlimit.MemoryLimit(limit) as lim:
                memlimit.drop_caches()
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                r = subprocess.run(lim.wrap(cmd), capture_output=True, text=True, env={**os.environ, **env})
                wall = time.perf_counter() - t0
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if r.returncode != 0:
                raise engine.EngineError(f"{' '.join(cmd)}: {r.stderr[-2000:]}")
            rows.append(dict(model=name, factor=factor, limit_mib=limit, point=point, first_token_s=wall,
                             block_input_mib=(after.ru_inblock - before.ru_inblock) * 512 / MIB,
                             dense_mib=dense_mib(model), model_mib=model.stat().st_size / MIB))
    return rows


def plot(settings: pd.DataFrame, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    labels = [f"{r.model} {r.factor:g}x {r.routing[:4]}" for r in settings.itertuples()]
    x = np.arange(len(settings))
    for ax, col, title, line in ((axes[0], "defaults_tg_vs_mmap", "decode: defaults / stock mmap", 10),
                                 (axes[1], "defaults_vs_best", "decode: defaults / best fixed point", 0.9),
                                 (axes[2], "defaults_pp_vs_mmap", "prefill: defaults / stock mmap", 1.0)):
        ax.bar(x, settings[col], color="#cc6677")
        ax.axhline(line, color="k", lw=0.8, ls="--")
        ax.set_xticks(x, labels, rotation=70, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=120)
    plt.close(fig)


def measure_resident(model: Path, trace: Path, n_gen: int) -> float:
    """All-resident decode tok/s (no limit, warm page cache, the same route replay): the compute part."""
    import io
    with open(model, "rb") as f:
        while f.read(16 << 20):
            pass
    cmd = [str(engine.find_binary("llama-bench")), "-m", str(model), "-p", "0", "-n", str(n_gen), "-r", "2", "-o", "csv",
           "-t", "2", "-ngl", "0", "--repack", "0", "--moe-route-replay", str(trace)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return float(pd.read_csv(io.StringIO(r.stdout)).avg_ts.iloc[0])


def predictions(out: Path, traces: Path, models: list[tuple[str, Path]], n_gen: int) -> pd.DataFrame:
    """Every stream decode point of the sweep against :func:`pybmoe.routing.sizing.predict_stream`: the
    point's budget (auto's after the context, from its log), the first n_gen + 1 tokens of its routing
    trace (llama-bench's warm-up untimed), the all-resident decode of the model and the disk probe's
    bandwidth, both measured here after the sweep."""
    from pybmoe.bench import disk
    from pybmoe.routing import sizing
    from pybmoe.routing import trace as tr
    summary = pd.read_csv(out / "sweep-summary.csv")
    rows = []
    for name, model in models:
        shape = sizing.model_shape(model)
        pr = disk.probe(model)
        for routing in summary.routing.unique():
            tpath = traces / f"{routing}-{name}.csv"
            t = tr.read_trace(tpath)
            res = measure_resident(model, tpath, n_gen)
            sel = summary[(summary.model == name) & (summary.routing == routing) & (summary["mode"] == "tg") &
                          (summary.point != "mmap")]
            for r in sel.itertuples():
                log = (out / f"{name}-{r.factor:g}x-{routing}" / "logs" /
                       f"{r.point.replace(':', '-')}-tg-0.log").read_text(errors="replace")
                rec = engine.stream_record(log)
                budget = rec["stream_budget_after_contexts_mb"] or rec["stream_budget_mb"]
                p = sizing.predict_stream(shape, t, float(budget), disk_mib_s=pr.mib_s, resident_tok_s=res,
                                          tokens=n_gen + 1, skip=1)
                rows.append(dict(model=name, factor=r.factor, routing=routing, point=r.point, budget_mb=budget,
                                 measured_ts=r.median_ts, predicted_ts=p.tok_s, error=p.tok_s / r.median_ts - 1,
                                 measured_hit_pct=r.median_hit_pct, predicted_hit_pct=100 * p.hit_rate,
                                 resident_ts=res, disk_probe_mib_s=pr.mib_s, probe_read_mib=pr.read_bytes / MIB))
    df = pd.DataFrame(rows)
    df.to_csv(out / "sweep-prediction.csv", index=False)
    return df


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--traces", type=Path, required=True, help="folder with uniform-NAME.csv and granite-NAME.csv")
    ap.add_argument("--factors", default="2,3,5")
    ap.add_argument("--routings", default="uniform,granite")
    ap.add_argument("-p", "--n-prompt", type=int, default=32)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--n-gen-mmap", type=int, default=8, help="stock mmap's generated tokens (it thrashes evenly)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--load-factor", type=float, default=3.0)
    ap.add_argument("--predict-only", action="store_true", help="only the predictions, from an existing sweep")
    ap.add_argument("models", nargs="+", help="NAME=MODEL.gguf")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    models = [(m.split("=", 1)[0], Path(m.split("=", 1)[1])) for m in a.models]
    if a.predict_only:
        df = predictions(a.out, a.traces, models, a.n_gen)
        print(df.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        return 0
    parts, load = [], []
    for name, model in models:
        for f in (float(x) for x in a.factors.split(",")):
            for routing in a.routings.split(","):
                t0 = time.time()
                parts.append(run_setting(name, model, f, routing, a.traces / f"{routing}-{name}.csv", a.out, a))
                pd.concat(parts).to_csv(a.out / "sweep-summary.csv", index=False)
                print(f"{name} {f:g}x {routing}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        load += load_runs(name, model, a.load_factor, a.out)
        pd.DataFrame(load).to_csv(a.out / "sweep-load.csv", index=False)
    summary = pd.concat(parts)
    settings = settings_table(summary)
    settings.to_csv(a.out / "sweep-settings.csv", index=False)
    plot(settings, a.out)
    print(settings.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(pd.DataFrame(load).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
