"""Whether a benchmark point's repeats agree: the spread of its repeats and the machine's load beside it.

A median of repeats that spread over a factor of 100 (65.0, 2.19 and 0.45 tok/s: another job took
the cores) is not a measurement, and a table of medians does not show it. Every run of ``pybmoe
sweep`` and ``pybmoe bench-stream`` records the 1-minute load average just before it
(:func:`load_average`, column ``load_1m``); the summaries add, per point:

- ``spread``: the largest repeat over the smallest (``max_ts / min_ts``; NaN with one run or a
  zero);
- ``max_load_1m``: the highest load average any of its runs started under;
- ``noisy``: ``spread`` over :data:`SPREAD_LIMIT` (1.5).

The printed tables carry a ``noisy`` column (``spread 29.7x, load 3.1``), and :func:`noisy_lines`
gives one line per noisy point to print under them. The number of CPUs is beside the load: a load
above it means the runs shared the cores.
"""
from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np
import pandas as pd

#: A point whose repeats spread more than this factor (largest tok/s over smallest) is flagged noisy.
SPREAD_LIMIT = 1.5


def load_average() -> float:
    """The 1-minute load average now (NaN where the system does not give one)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return math.nan


def flag_spread(summary: pd.DataFrame, runs: pd.DataFrame, keys: Sequence[str], *, limit: float = SPREAD_LIMIT,
                min_col: str = "min_ts", max_col: str = "max_ts") -> pd.DataFrame:
    """``summary`` (one row per ``keys``, with ``min_col`` and ``max_col``) with ``spread``,
    ``max_load_1m`` (from ``runs``' ``load_1m`` column, grouped by ``keys``; NaN without it) and
    ``noisy`` (``spread > limit``). Raises :class:`ValueError` for a ``limit`` under 1."""
    if not limit >= 1:
        raise ValueError(f"spread limit {limit}; accepted: a factor >= 1")
    s = summary.copy()
    lo, hi = s[min_col].astype(float), s[max_col].astype(float)
    s["spread"] = (hi / lo.where(lo > 0)).where(np.isfinite(hi))
    if "load_1m" in runs and len(runs):
        load = runs.groupby(list(keys), sort=False, dropna=False)["load_1m"].max().rename("max_load_1m")
        s = s.drop(columns=["max_load_1m"], errors="ignore").join(load, on=list(keys))
    else:
        s["max_load_1m"] = math.nan
    s["noisy"] = (s["spread"] > limit).fillna(False).astype(bool)
    return s


def noisy_note(row) -> str:
    """The ``noisy`` cell of a printed table: ``spread 29.7x, load 3.1`` for a noisy point, else ""."""
    if not bool(getattr(row, "noisy", False)):
        return ""
    load = getattr(row, "max_load_1m", math.nan)
    return f"spread {row.spread:.1f}x" + ("" if pd.isna(load) else f", load {load:.1f}")


def noisy_lines(summary: pd.DataFrame, label_cols: Sequence[str], *, limit: float = SPREAD_LIMIT,
                min_col: str = "min_ts", max_col: str = "max_ts") -> list[str]:
    """One line per noisy point of ``summary`` (:func:`flag_spread`'s frame), named by ``label_cols``:
    its repeats' range, the factor over ``limit``, and the load average beside the CPU count."""
    if "noisy" not in summary:
        return []
    cpus = os.cpu_count() or 1
    lines = []
    for r in summary[summary["noisy"]].itertuples(index=False):
        name = " ".join(f"{c}={getattr(r, c)}" for c in label_cols)
        load = getattr(r, "max_load_1m", math.nan)
        beside = (f"; the 1-minute load average was up to {load:.1f} on {cpus} CPUs"
                  + (" (the runs shared the cores)" if load > cpus else "")) if not pd.isna(load) else ""
        lines.append(f"noisy: {name}: its repeats spread {getattr(r, min_col):.3g} .. {getattr(r, max_col):.3g} tok/s "
                     f"({r.spread:.1f}x, over {limit:g}x){beside}: its median is not a measurement; rerun it on a "
                     "quiet machine")
    return lines
