#!/usr/bin/env python3
"""The VRAM tier as one pool per device (issue 42): structure, guard and policy chosen on real routing.

A benchmark of counts (no engine, no device): ``pybmoe.routing.sim`` replays the decode rows of each
trace (each workload from a cold cache, one stream, hits pooled over workloads) at budgets from a
quarter of the cache cycle (n_layer x top_k entries) to 75 % of all (layer, expert) entries, in whole
slots per layer so that per-layer slots and the pool hold the same number of experts.

Rows (``label``), each a policy of ``pybmoe simulate`` with the pool's guard / timing where given:

* the engine's timing (sync: a miss at step s is resident from s + 2, docs/expert-cache.md):
  ``layer-lru`` (per-layer slots, the engine today), ``pool-global`` (one bank, one LRU, no guard),
  ``pool`` (the default: floor-half-k guard), ``pool[floor-k]``, ``pool[floor-share]``,
  ``pool-classlru`` (the pool with ClassLRU's order);
* upstream's timing (instant: misses uploaded before the layer runs): ``layer-lru-instant``
  (``pool``, guard partition), ``global-lru`` (upstream b11480's one LRU), ``pool-instant``
  (floor-half-k), ``pool-instant[floor-share]``, ``classlru`` (upstream b12170's policy as published);
* ``belady``: the offline bound (one bank, instant).

Traces: granite-3.0-1b-a400m (bundled), Mixtral-8x7B and DeepSeek-R1 671B (``--real-traces``, the
shared captures; their licences allow no shipping, so only counts are written), and synthetic
routing from ``pybmoe.routing.synth`` (fixed seeds): granite's per-layer reuse over 1,024 tokens,
the same mapped to 128 experts top-1 (the shape of the issue's 128-expert top-1 model), Mixtral's
over 1,024 tokens, and uniform routing of granite's shape.

Writes ``OUT/hit-rates.csv`` (one row per trace, label and budget; ``min_layer_hit_rate``: the hit
rate of the worst layer), ``OUT/acceptance.csv`` (per trace: the worst deficit of each pool against
the better of per-layer and global LRU at the same timing, its worst layer against per-layer slots'
worst layer, and ClassLRU's miss reduction against LRU, min / max over the budgets from the cycle) and
``OUT/hit-rates.png`` and ``OUT/vs-per-layer.png``. Usage: ``python tools/bench-vram-pool.py [--real-traces DIR] [--out DIR]``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pybmoe.routing import sim, synth  # noqa: E402
from pybmoe.routing import trace as tr  # noqa: E402

#: label -> (policy, guard, timing); None: the policy's own
LABELS = {
    "layer-lru": ("layer-lru", None, None),
    "pool-global": ("pool-global", None, None),
    "pool": ("pool", None, None),
    "pool[floor-k]": ("pool", "floor-k", None),
    "pool[floor-share]": ("pool", "floor-share", None),
    "pool-classlru": ("pool-classlru", None, None),
    "layer-lru-instant": ("pool", "partition", "instant"),
    "global-lru": ("global-lru", None, None),
    "pool-instant": ("pool", None, "instant"),
    "pool-instant[floor-share]": ("pool", "floor-share", "instant"),
    "classlru": ("classlru", None, None),
    "belady": ("belady", None, None),
}
SYNC = ("layer-lru", "pool-global", "pool", "pool[floor-k]", "pool[floor-share]", "pool-classlru")
INSTANT = ("layer-lru-instant", "global-lru", "pool-instant", "pool-instant[floor-share]", "classlru")
REAL = ("granite", "mixtral-8x7b", "deepseek-r1-671b")


def traces(real_dir: Path, steps: int) -> dict[str, tr.Trace]:
    """The traces of the study, decode rows only."""
    granite = tr.read_trace("granite")
    mixtral = tr.read_trace(real_dir / "mixtral-8x7b" / "mixtral8x7b_gsm8k2_humaneval2.trace.csv")
    out = {
        "granite": granite,
        "mixtral-8x7b": mixtral,
        "deepseek-r1-671b": tr.read_trace(real_dir / "deepseek-r1-671b" / "deepseek_r1_671b_france.trace.csv"),
        "synth-granite": synth.synthesize(granite, steps, seed=42, name="synth-granite"),
        "synth-granite-e128-top1": synth.synthesize(granite, 2 * steps, seed=43, n_expert=128, top_k=1,
                                                    name="synth-granite-e128-top1"),
        "synth-mixtral": synth.synthesize(mixtral, steps, seed=44, name="synth-mixtral"),
        "uniform": synth.uniform(steps // 2, n_layer=24, n_expert=32, top_k=8, seed=45),
    }
    return {k: t.select("decode") for k, t in out.items()}


def slot_budgets(top_k: int, n_expert: int) -> list[int]:
    """Slots per layer: a quarter, half and three quarters of the cycle (top-k), then 9 points from the
    cycle to 75 % of the experts."""
    under = [s for s in (round(top_k * f) for f in (0.25, 0.5, 0.75)) if 1 <= s < top_k]
    above = np.unique(np.round(np.linspace(top_k, 0.75 * n_expert, 9)).astype(int))
    return sorted(set(under) | {int(s) for s in above})


def run(name: str, t: tr.Trace) -> pd.DataFrame:
    rp = sim.prepare(t)
    rows = []
    for s in slot_budgets(rp.top_k, rp.n_expert):
        for label, (policy, guard, timing) in LABELS.items():
            r = sim.simulate(rp, policy, slots_per_layer=s, phase="decode", guard=guard, timing=timing)
            acc, hits = int(r.summary["accesses"].sum()), int(r.summary["hits"].sum())
            hit = (r.predicted == 1) & r.counted
            per_layer = (np.bincount(rp.lay[r.counted], weights=hit[r.counted], minlength=rp.n_layer)
                         / np.maximum(np.bincount(rp.lay[r.counted], minlength=rp.n_layer), 1))
            rows.append({"trace": name, "n_layer": rp.n_layer, "n_expert": rp.n_expert, "top_k": rp.top_k,
                         "tokens": int(r.summary["tokens"].sum()), "label": label, "policy": policy,
                         "timing": timing or (sim.POOL_POLICIES[policy][0] if policy in sim.POOL_POLICIES
                                              else "sync" if policy == "layer-lru" else "instant"),
                         "guard": guard or (sim.POOL_POLICIES[policy][2] if policy in sim.POOL_POLICIES else ""),
                         "slots_per_layer": s, "budget_entries": r.budget_entries,
                         "fraction": r.budget_entries / (rp.n_layer * rp.n_expert),
                         "below_cycle": s < rp.top_k, "accesses": acc, "hits": hits, "misses": acc - hits,
                         "hit_rate": hits / acc, "min_layer_hit_rate": float(per_layer.min()),
                         "uploads": int(r.summary["uploads"].sum())})
    return pd.DataFrame(rows)


def acceptance(df: pd.DataFrame) -> pd.DataFrame:
    """Per trace: worst deficit (points) of each pool against the better of per-layer and global LRU at
    its timing, and against the issue's pair (layer-lru, global-lru); ClassLRU's miss reduction (%)."""
    w = df.pivot_table(index=["trace", "slots_per_layer", "below_cycle"], columns="label", values="hit_rate")
    m = df.pivot_table(index=["trace", "slots_per_layer", "below_cycle"], columns="label", values="misses")
    out = []
    for trace, g in w.groupby(level="trace", sort=False):
        mg = m.loc[trace]
        above = ~g.index.get_level_values("below_cycle")
        row = {"trace": trace}
        best_sync = g[["layer-lru", "pool-global"]].max(axis=1)
        best_inst = g[["layer-lru-instant", "global-lru"]].max(axis=1)
        best_issue = g[["layer-lru", "global-lru"]].max(axis=1)
        lw = df[df["trace"] == trace].pivot_table(index="slots_per_layer", columns="label", values="min_layer_hit_rate")
        for label, best in (("pool", best_sync), ("pool[floor-k]", best_sync), ("pool[floor-share]", best_sync),
                            ("pool-global", best_sync), ("pool-classlru", best_sync),
                            ("pool-instant", best_inst), ("pool-instant[floor-share]", best_inst)):
            row[f"{label} worst deficit (pts)"] = 100 * float((best - g[label]).max())
        for label in ("pool", "pool[floor-k]", "pool-global"):
            row[f"{label} worst layer / layer-lru's worst layer"] = float(
                (lw[label] / lw["layer-lru"].where(lw["layer-lru"] > 0.005)).min())
        row["pool vs max(layer-lru, global-lru) worst (pts)"] = 100 * float((best_issue - g["pool"]).max())
        row["pool-global min hit below cycle (%)"] = 100 * float(g.loc[~above, "pool-global"].min()) if (~above).any() else np.nan
        row["global-lru min hit below cycle (%)"] = 100 * float(g.loc[~above, "global-lru"].min()) if (~above).any() else np.nan
        row["pool min hit below cycle (%)"] = 100 * float(g.loc[~above, "pool"].min()) if (~above).any() else np.nan
        for cand, base in (("pool-classlru", "pool"), ("classlru", "global-lru")):
            red = 100 * (1 - mg.loc[above.tolist(), cand] / mg.loc[above.tolist(), base])
            row[f"{cand} vs {base} fewer misses min (%)"] = float(red.min())
            row[f"{cand} vs {base} fewer misses max (%)"] = float(red.max())
            row[f"{cand} vs {base} worst loss (pts)"] = 100 * float((g[base] - g[cand]).max())
        out.append(row)
    return pd.DataFrame(out)


def plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(df["trace"]))
    n = len(names)
    cols = 3 if n > 4 else n
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), dpi=110, squeeze=False)
    style = {"layer-lru": ("C0", "-", "o"), "pool-global": ("C1", "-", "s"), "pool": ("C3", "-", "D"),
             "pool-classlru": ("C2", "-", "^"), "global-lru": ("C1", ":", "s"), "classlru": ("C2", ":", "^"),
             "layer-lru-instant": ("C0", ":", "o"), "belady": ("k", "--", "")}
    for ax, name in zip(axes.ravel(), names):
        g = df[df["trace"] == name]
        for label, (c, ls, mk) in style.items():
            h = g[g["label"] == label].sort_values("slots_per_layer")
            ax.plot(h["slots_per_layer"], 100 * h["hit_rate"], color=c, linestyle=ls, marker=mk, markersize=3,
                    linewidth=1.3, label=label)
        k = int(g["top_k"].iloc[0])
        ax.axvline(k, color="0.5", linewidth=0.8)
        ax.set_title(f"{name} ({g['n_layer'].iloc[0]}x{g['n_expert'].iloc[0]}, top-{k}, "
                     f"{g['tokens'].iloc[0]} tokens)", fontsize=9)
        ax.set_xlabel("slots per layer (grey: the cycle, top-k)", fontsize=8)
        ax.set_ylabel("decode hit rate (%)", fontsize=8)
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    axes.ravel()[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("VRAM pool: solid = the engine's timing (sync), dotted = upstream's (instant)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_gain(df: pd.DataFrame, path: Path) -> None:
    """Points of hit rate over per-layer slots (``layer-lru``) at the engine's timing, per trace."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    w = df.pivot_table(index=["trace", "slots_per_layer"], columns="label", values="hit_rate", sort=False)
    names = list(dict.fromkeys(df["trace"]))
    cols = 4 if len(names) > 4 else len(names)
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.3 * rows), dpi=110, squeeze=False)
    style = {"pool": ("C3", "D"), "pool-global": ("C1", "s"), "pool[floor-k]": ("C4", "v"),
             "pool-classlru": ("C2", "^")}
    for ax, name in zip(axes.ravel(), names):
        g = w.loc[name].sort_index()
        for label, (c, mk) in style.items():
            ax.plot(g.index, 100 * (g[label] - g["layer-lru"]), color=c, marker=mk, markersize=3, linewidth=1.2,
                    label=label)
        ax.axhline(0, color="C0", linewidth=1)
        ax.axhline(-1, color="0.6", linewidth=0.8, linestyle="--")
        k = int(df[df["trace"] == name]["top_k"].iloc[0])
        ax.axvline(k, color="0.5", linewidth=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("slots per layer", fontsize=8)
        ax.set_ylabel("points over per-layer slots", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[len(names):]:
        ax.axis("off")
    axes.ravel()[0].legend(fontsize=7)
    fig.suptitle("The engine's timing: hit rate minus per-layer slots' (layer-lru); grey: the cycle", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real-traces", type=Path, default=REPO.parent / "shared" / "data" / "real-traces",
                    help="folder with mixtral-8x7b/ and deepseek-r1-671b/ (default %(default)s)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "vram-pool-sim")
    ap.add_argument("--synth-steps", type=int, default=1024, help="tokens of each synthetic trace (default %(default)s)")
    a = ap.parse_args(argv)
    try:
        sim.require_core()
    except sim.CoreError as e:
        print(f"bench-vram-pool: {e}", file=sys.stderr)
        return 2
    frames = []
    for name, t in traces(a.real_traces, a.synth_steps).items():
        print(f"{name}: {len(t.frame)} decode lookups", file=sys.stderr)
        frames.append(run(name, t))
    df = pd.concat(frames, ignore_index=True)
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "hit-rates.csv", index=False, float_format="%.6g")
    acc = acceptance(df)
    acc.to_csv(a.out / "acceptance.csv", index=False, float_format="%.3f")
    plot(df, a.out / "hit-rates.png")
    plot_gain(df, a.out / "vs-per-layer.png")
    with pd.option_context("display.width", 250, "display.max_columns", 40):
        print(acc.T.to_string(float_format=lambda x: f"{x:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
