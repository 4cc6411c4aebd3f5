"""Plots of replay and benchmark results (matplotlib, Agg backend: no display needed).

Plots are built from tidy frames (:mod:`pybmoe.routing.sim` sweeps, :mod:`pybmoe.bench.sweeps` sweeps), never
from raw traces or logs.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from .noise import SPREAD_LIMIT


def _pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, ax, path: str | os.PathLike, title: str, title_size: float) -> Path:
    """Title ``ax`` (when ``title``), lay ``fig`` out, write it to ``path`` (parents created), close it."""
    if title:
        ax.set_title(title, fontsize=title_size)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def hit_rate_plot(df: pd.DataFrame, path: str | os.PathLike, *, n_layer: int, top_k: int, n_expert: int,
                  title: str = "") -> Path:
    """Write a PNG of hit rate (%, pooled over workloads) against the budget, one line per policy.

    ``df`` is a :func:`pybmoe.routing.sim.sweep` frame. The x axis is the effective budget in (layer,
    expert) entries, with slots per layer on top. The token cycle (``n_layer * top_k`` entries)
    is marked, and the band ``((n_layer - 1) * top_k, cycle)`` where a global LRU goes from 0% to
    its full hit rate is shaded. Returns the path. Raises :class:`ValueError` for an empty frame.
    """
    plt = _pyplot()

    from ..routing.sim import pooled, token_cycle, zero_hit_entries

    if len(df) == 0:
        raise ValueError("nothing to plot: the frame has no rows; accepted: a sweep() frame")
    p = pooled(df).sort_values(["policy", "budget_entries"])
    cycle = token_cycle(n_layer, top_k, n_expert)
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    styles = {"layer-lru": ("C0", "o"), "global-lru": ("C1", "s"), "fifo": ("C2", "^"), "lfu": ("C3", "v"),
              "belady": ("C4", "D"), "static": ("C5", "x"), "global-lru-scan": ("C6", "P")}
    for policy in dict.fromkeys(df["policy"]):
        g = p[p["policy"] == policy]
        color, marker = styles.get(policy, (None, "."))
        ax.plot(g["budget_entries"], 100 * g["hit_rate"], marker=marker, markersize=3.5, linewidth=1.4,
                color=color, label=policy)
    ax.axvspan(zero_hit_entries(n_layer, top_k, n_expert), cycle, color="0.85", zorder=0)
    ax.axvline(cycle, color="k", linestyle="--", linewidth=1)
    ax.annotate(f"token cycle\n{n_layer}×{top_k} = {cycle}", xy=(cycle, 2), xytext=(6, 0),
                textcoords="offset points", fontsize=8, va="bottom")
    ax.set_xlabel("budget: (layer, expert) entries")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, n_layer * n_expert * 1.02)
    ax.grid(True, alpha=0.3)
    top = ax.secondary_xaxis("top", functions=(lambda x: x / n_layer, lambda s: s * n_layer))
    top.set_xlabel("slots per layer")
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, ax, path, title, 10)


def sweep_plot(runs: pd.DataFrame, path: str | os.PathLike, *, title: str = "") -> Path:
    """Write a PNG of one mode of a :func:`pybmoe.bench.sweeps.sweep`: tok/s (top) and hit % (bottom)
    against slots per layer.

    ``runs`` holds the rows of one mode (``pp`` or ``tg``) of ``sweep.csv``: columns ``slots``,
    ``inserts``, ``n_ubatch``, ``n_threads``, ``backend``, ``avg_ts`` (tok/s), ``hit_pct`` (%)
    and ``overflow`` (and ``spec``, ``max_batch``, when present). One line per configuration (insert
    cap, cached batch, ubatch, threads, backend, speculation): the
    median over repeats with min–max bars, the cache-off median (``slots = 0``) of that
    configuration drawn as a dashed horizontal line of the same colour, overflowed runs as
    red crosses (left out of the medians), and a point whose repeats spread more than
    :data:`pybmoe.bench.noise.SPREAD_LIMIT` ringed in red (noisy). Returns the path; raises :class:`ValueError` for an
    empty frame or more than one mode.
    """
    plt = _pyplot()

    if len(runs) == 0:
        raise ValueError("nothing to plot: the frame has no rows; accepted: the rows of one mode of sweep.csv")
    if "mode" in runs and runs["mode"].nunique() > 1:
        raise ValueError(f"one mode per plot; got {sorted(runs['mode'].unique())}")
    ok = runs[~runs["overflow"].astype(bool)]
    bad = runs[runs["overflow"].astype(bool)]
    cfg_keys = ["backend", "n_threads", "n_ubatch"] + (["spec"] if "spec" in runs else [])
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6.4), dpi=120, sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    color_i, noisy_shown = 0, False
    for cfg, g in ok.groupby(cfg_keys, sort=True):
        base = g[g["slots"] == 0]["avg_ts"].median()
        label_cfg = f"{cfg[0]}, t={cfg[1]}, ub={cfg[2]}" + (f", spec={cfg[3]}" if len(cfg) > 3 else "")
        on = g[g["slots"] > 0]
        mbs = on["max_batch"] if "max_batch" in on else pd.Series(0, index=on.index)
        variants = sorted(set(zip(on["inserts"], mbs))) or [(0, 0)]
        for ins, mb in variants:
            color = f"C{color_i % 10}"
            color_i += 1
            h = on[(on["inserts"] == ins) & (mbs == mb)].groupby("slots")
            med = h["avg_ts"].median()
            lo, hi = h["avg_ts"].min(), h["avg_ts"].max()
            lab = f"{label_cfg}, inserts={'∞' if ins == 0 else ins}" + (f", max_batch={mb}" if mb else "")
            if len(med):
                ax.errorbar(med.index, med.values, yerr=[med.values - lo.values, hi.values - med.values],
                            marker="o", markersize=4, capsize=3, linewidth=1.4, color=color, label=lab)
                hit = h["hit_pct"].median()
                bx.plot(hit.index, hit.values, marker="o", markersize=4, linewidth=1.4, color=color, label=lab)
                wide = (hi / lo.where(lo > 0)) > SPREAD_LIMIT
                if wide.any():
                    ax.scatter(med.index[wide.to_numpy()], med.values[wide.to_numpy()], s=120, facecolors="none",
                               edgecolors="#cc3311", linewidths=1.5, zorder=6,
                               label=None if noisy_shown else f"noisy: repeats spread over {SPREAD_LIMIT:g}x")
                    noisy_shown = True
            if not np.isnan(base):
                ax.axhline(base, color=color, linestyle="--", linewidth=1)
                ax.plot([0], [base], marker="s", markersize=5, color=color)
                ax.annotate(f"cache off {base:.1f} tok/s", xy=(0, base), xytext=(6, 4), textcoords="offset points",
                            fontsize=8, color=color)
    if len(bad):
        y = bad["avg_ts"].fillna(0)
        ax.scatter(bad["slots"], y, marker="x", color="red", s=40, zorder=5, label="overflow (not a result)")
        bx.scatter(bad["slots"], np.zeros(len(bad)), marker="x", color="red", s=40, zorder=5)
    from matplotlib.ticker import MaxNLocator
    hi_slots = max(float(runs["slots"].max()), 1.0)
    bx.set_xlim(-0.04 * hi_slots - 0.5, 1.06 * hi_slots + 0.5)
    bx.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("tok/s (median, min–max)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    bx.set_ylabel("hit rate (%)")
    bx.set_ylim(0, 100)
    bx.set_xlabel("slots per layer (0 = cache off)")
    bx.grid(True, alpha=0.3)
    return _save(fig, ax, path, title, 10)


def device_bench_plot(df: pd.DataFrame, path: str | os.PathLike, *, title: str = "") -> Path:
    """Write a PNG of one mode of ``tools/device-bench.sh`` (:mod:`pybmoe.bench.devbench`): measured tok/s
    per point (bars, ± llama-bench's standard deviation) with the bandwidth model's bound drawn as a
    black tick on each bar (top), and the cache's hit rate (bottom).

    ``df`` holds the rows of one mode of ``device-bench.csv`` (columns ``point``, ``avg_ts``,
    ``stddev_ts``, ``model_ts``, ``hit_pct``, ``placement``, ``overflow``), in the order to draw.
    Overflowed points are drawn red. Returns the path; raises :class:`ValueError` for an empty frame.
    """
    plt = _pyplot()

    if len(df) == 0:
        raise ValueError("nothing to plot: the frame has no rows; accepted: the rows of one mode of device-bench.csv")
    x = np.arange(len(df))
    colors = {"host": "C7", "cache": "C0", "vram": "C2"}
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    ts = df["avg_ts"].to_numpy(dtype=float)
    err = df["stddev_ts"].fillna(0).to_numpy(dtype=float)
    col = ["red" if bool(o) else colors.get(p, "C1") for p, o in zip(df["placement"], df["overflow"])]
    ax.bar(x, np.nan_to_num(ts), yerr=err, color=col, capsize=3, width=0.6)
    for xi, v in zip(x, ts):
        if np.isfinite(v):
            ax.annotate(f"{v:.1f}", xy=(xi, v), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    bound = df["model_ts"].to_numpy(dtype=float)
    ax.scatter(x, bound, marker="_", s=900, color="black", linewidths=2, zorder=5,
               label="bandwidth model (upper bound on tok/s)")
    top = np.nanmax(np.concatenate([np.nan_to_num(ts + err), np.where(np.isfinite(bound), bound, 0)]))
    ax.set_ylim(0, max(top, 1e-9) * 1.15)
    ax.set_ylabel("tok/s")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    hit = df["hit_pct"].to_numpy(dtype=float)
    bx.bar(x, np.nan_to_num(hit), color=[colors.get(p, "C1") for p in df["placement"]], width=0.6)
    bx.set_ylim(0, 100)
    bx.set_ylabel("hit rate (%)")
    bx.grid(True, axis="y", alpha=0.3)
    bx.set_xticks(x)
    bx.set_xticklabels(df["point"].tolist(), rotation=20, fontsize=8)
    return _save(fig, ax, path, title, 9)


#: How ``pybmoe bench-stream``'s points are drawn: (colour, hatch) by kind.
STREAM_STYLE = {"mmap": ("#999999", ""), "defaults": ("#cc6677", ""), "stream": ("#4477aa", ""),
                "resident": ("#dddddd", "//"), "server": ("#ddaa33", "")}


def _stream_kind(point: str) -> str:
    return "stream" if point.startswith("stream:") else point.split("/")[0]


def stream_figure(summary: pd.DataFrame, runs: pd.DataFrame | None, mode: str, *, title: str = ""):
    """The figure of one mode (``pp`` or ``tg``) of ``pybmoe bench-stream`` (:mod:`pybmoe.bench.stream`):
    tok/s per point (top) and the stream tier's hit rate (bottom).

    Top: the median as a bar, each repeat as a dot and its min–max as an error bar (the spread), the
    ratio over mmap written on the bar (in red, with ``noisy: Nx spread``, for a point whose repeats spread
    more than :data:`pybmoe.bench.noise.SPREAD_LIMIT`), and, where the summary has them, the point's limits as ticks:
    the serial limit (``median_limit_ts``, reads then compute) and the overlapped one
    (``median_overlap_limit_ts``, reads hidden behind compute), tok/s. The all-resident point runs with no
    memory limit and a warm page cache: its bar is hatched and its label says so. Bottom: the tier's
    median hit rate (``median_hit_pct``, %) of each point; mmap and resident have no tier (n/a).

    ``summary``: :func:`pybmoe.bench.stream.summarize`'s frame (``point``, ``mode``, ``median_ts``,
    ``min_ts``, ``max_ts``, ``ratio``, ``median_hit_pct``; the limit columns optional); ``runs``: the
    runs (``point``, ``mode``, ``avg_ts``; None: no dots). Returns the matplotlib Figure (two axes); raises
    :class:`ValueError` when ``summary`` has no row of ``mode``.
    """
    plt = _pyplot()
    d = summary[summary["mode"] == mode].reset_index(drop=True)
    if d.empty:
        raise ValueError(f"nothing to plot: no row of mode {mode!r}; accepted: {sorted(set(summary['mode']))}")
    x = np.arange(len(d))
    kinds = [_stream_kind(p) for p in d.point]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(5.5, 1.3 * len(d)) + 2.6, 5.6), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1.3]})
    err = np.vstack([d.median_ts - d.min_ts, d.max_ts - d.median_ts])
    for xi, r, k in zip(x, d.itertuples(), kinds):
        color, hatch = STREAM_STYLE.get(k, STREAM_STYLE["stream"])
        ax.bar(xi, r.median_ts, color=color, hatch=hatch, edgecolor="#555555" if hatch else color,
               label="resident: no memory limit, warm page cache" if k == "resident" else None)
        noisy = bool(getattr(r, "noisy", False))
        ax.annotate(f"{r.ratio:.2f}x" + (f"\nnoisy: {r.spread:.1f}x spread" if noisy else ""), (xi, r.max_ts),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points",
                    color="#cc3311" if noisy else "black")
    ax.errorbar(x, d.median_ts, yerr=err, fmt="none", ecolor="black", capsize=3, linewidth=1,
                label="min–max of the repeats")
    m = runs[runs["mode"] == mode] if runs is not None else pd.DataFrame({"point": [], "avg_ts": []})
    pos = {p: i for i, p in enumerate(d.point)}
    rx = [pos[p] for p in m.point if p in pos]
    ry = [ts for p, ts in zip(m.point, m.avg_ts) if p in pos]
    jitter = (np.arange(len(rx)) % 5 - 2) * 0.05
    ax.scatter(np.asarray(rx, dtype=float) + jitter, ry, s=12, color="black", zorder=4, label="each repeat")
    for col, style, lab in (("median_limit_ts", "_", "serial limit (reads + compute)"),
                            ("median_overlap_limit_ts", "1", "overlapped limit (max of reads, compute)")):
        if col in d and d[col].notna().any():
            ax.scatter(x, d[col], marker=style, s=500 if style == "_" else 120, color="#117733", zorder=5,
                       linewidths=2, label=lab)
    ax.set_ylabel(f"{'decode' if mode == 'tg' else 'prefill'} tok/s (median)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)
    hit = d.median_hit_pct.to_numpy(dtype=float)
    bx.bar(x, np.nan_to_num(hit), color=[STREAM_STYLE.get(k, STREAM_STYLE["stream"])[0] for k in kinds])
    for xi, h in zip(x, hit):
        bx.annotate("n/a" if np.isnan(h) else f"{h:.0f}%", (xi, 0 if np.isnan(h) else h), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    bx.set_ylim(0, 110)
    bx.set_ylabel("tier hit rate (%)")
    bx.grid(True, axis="y", alpha=0.3)
    labels = [f"{p}\n(no limit, warm)" if k == "resident" else p for p, k in zip(d.point, kinds)]
    bx.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def stream_plot(summary: pd.DataFrame, runs: pd.DataFrame | None, path: str | os.PathLike, mode: str, *,
                title: str = "") -> Path:
    """Write :func:`stream_figure` of ``mode`` to ``path`` (PNG, parents created); returns the path."""
    fig = stream_figure(summary, runs, mode, title=title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
