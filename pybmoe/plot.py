"""Plots of replay results (matplotlib, Agg backend: no display needed).

Plots are built from the tidy frames of :mod:`pybmoe.sim`, never from raw traces.
"""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd


def hit_rate_plot(df: pd.DataFrame, path: str | os.PathLike, *, n_layer: int, top_k: int, n_expert: int,
                  title: str = "") -> Path:
    """Write a PNG of hit rate (%, pooled over workloads) against the budget, one line per policy.

    ``df`` is a :func:`pybmoe.sim.sweep` frame. The x axis is the effective budget in (layer,
    expert) entries, with slots per layer on top. The token cycle (``n_layer * top_k`` entries)
    is marked, and the band ``((n_layer - 1) * top_k, cycle)`` where a global LRU goes from 0% to
    its full hit rate is shaded. Returns the path. Raises :class:`ValueError` for an empty frame.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .sim import pooled, token_cycle, zero_hit_entries

    if len(df) == 0:
        raise ValueError("nothing to plot: the frame has no rows; accepted: a sweep() frame")
    p = pooled(df).sort_values(["policy", "budget_entries"])
    cycle = token_cycle(n_layer, top_k, n_expert)
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    styles = {"layer-lru": ("C0", "o"), "global-lru": ("C1", "s"), "fifo": ("C2", "^"), "lfu": ("C3", "v"),
              "belady": ("C4", "D"), "static": ("C5", "x")}
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
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
