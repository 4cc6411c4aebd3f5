#!/usr/bin/env python3
"""The VRAM tier's admission rule, measured with the replay simulator: ``layer-lru`` (the engine's
policy) admitting every miss (``always``, the engine today) against ``second-miss`` (admit an
expert only when it also missed within the last W steps of its layer), on the bundled granite
trace (3 prompts x 64 decode tokens, each prompt from a cold cache) and on a synthetic trace
with the same per-layer reuse (``pybmoe trace synth``, one workload of ``--synth-steps`` tokens).

A benchmark of counts, not of time (no engine, no device): per trace, slot count and rule, the
decode hit rate and the uploads (experts copied into the tier, summed over the layers) per
token, the wasted uploads (dropped, or evicted before any hit) per token, the host reads per
token (misses + uploads: a miss is computed from the expert's bytes in host memory, an upload
copies them from there, so both read one expert from host RAM), and the upload MiB per token
at ``--expert-mib`` MiB per expert (default 1.59: the granite-shaped q8_0 model of
docs/benchmarks/vram-async-2026-12-02/README.md). Writes ``OUT/admission.csv`` (one row per trace, slots and rule) and
``OUT/admission.png``.

    python tools/bench-admission.py --out docs/benchmarks/admission-2026-12-02
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybmoe.routing import sim, synth  # noqa: E402
from pybmoe.routing import trace as tr  # noqa: E402
from pybmoe.routing.granite import GRANITE_TRACE  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def measure(rp: sim.Replay, name: str, slots: list[int], windows: list[int], inserts: int,
            expert_mib: float) -> pd.DataFrame:
    """One row per slot count and rule: pooled decode counts and the per-token figures."""
    rules = [("always", None)] + [("second-miss", w) for w in windows]
    rows = []
    for s in slots:
        for admit, w in rules:
            r = sim.simulate(rp, "layer-lru", slots_per_layer=s, inserts=inserts, admit=admit, admit_window=w,
                             phase="decode")
            p = r.summary
            tokens = int(p["tokens"].sum())
            up, wasted = int(p["uploads"].sum()), int(p["wasted"].sum())
            rows.append(dict(trace=name, slots=s, rule=admit if w is None else f"second-miss W={w}", admit=admit,
                             window=w, inserts=inserts, tokens=tokens, accesses=int(p["accesses"].sum()),
                             hits=int(p["hits"].sum()), hit_pct=100.0 * r.hit_rate, uploads=up, wasted=wasted,
                             uploads_per_token=up / tokens, wasted_per_token=wasted / tokens,
                             misses_per_token=int(p["misses"].sum()) / tokens,
                             host_reads_per_token=(int(p["misses"].sum()) + up) / tokens,
                             mib_per_token=up / tokens * expert_mib))
    df = pd.DataFrame(rows)
    base = df[df["admit"] == "always"].set_index("slots")
    df["hit_pts_vs_always"] = df["hit_pct"] - df["slots"].map(base["hit_pct"])
    df["uploads_vs_always_pct"] = 100.0 * (df["uploads"] / df["slots"].map(base["uploads"]) - 1.0)
    return df


def plot(df: pd.DataFrame, path: Path, n_expert: int, top_k: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    traces = list(dict.fromkeys(df["trace"]))
    fig, axes = plt.subplots(2, len(traces), figsize=(5.2 * len(traces), 7.2), dpi=120, squeeze=False)
    for j, name in enumerate(traces):
        d = df[df["trace"] == name]
        for i, rule in enumerate(dict.fromkeys(d["rule"])):
            g = d[d["rule"] == rule]
            style = dict(color="k", linewidth=2.0, marker="o") if rule == "always" else \
                dict(color=f"C{i - 1}", linewidth=1.3, marker="s", linestyle="--")
            axes[0][j].plot(g["slots"], g["hit_pct"], label=rule, **style)
            axes[1][j].plot(g["slots"], g["uploads_per_token"], label=rule, **style)
        axes[0][j].set_title(f"{name}: decode hit rate")
        axes[0][j].set_ylabel("hit rate (%)")
        axes[0][j].set_ylim(0, 100)
        axes[1][j].set_title(f"{name}: uploads (all {d['tokens'].iloc[0]} tokens)")
        axes[1][j].set_ylabel("experts uploaded per token (all layers)")
        axes[1][j].set_ylim(bottom=0)
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticks(sorted(set(d["slots"])))
            ax.set_xlabel(f"slots per layer (of {n_expert}; top-{top_k})")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("layer-lru admission: always vs second-miss (window W steps)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="layer-lru admission rules on the granite trace (replay simulator).")
    ap.add_argument("--trace", type=Path, default=GRANITE_TRACE, help="source trace (default: the bundled granite)")
    ap.add_argument("--slots", type=_ints, default=[4, 8, 12, 16, 24], help="slots per layer (default 4,8,12,16,24)")
    ap.add_argument("--windows", type=_ints, default=[1, 2, 4, 8, 16], help="second-miss windows, steps")
    ap.add_argument("--inserts", type=int, default=0, help="insert cap per layer per step, 0 = unlimited")
    ap.add_argument("--synth-steps", type=int, default=1024, help="tokens of the synthetic trace (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    ap.add_argument("--expert-mib", type=float, default=1.59, help="MiB of one expert (up + gate + down)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if any(w < 1 for w in a.windows):
        ap.error("--windows: every window must be an integer >= 1 (steps)")
    a.out.mkdir(parents=True, exist_ok=True)
    src = tr.read_trace(a.trace)
    runs = [("granite (3 x 64 tokens)", sim.prepare(src))]
    if a.synth_steps:
        syn = synth.synthesize(src, a.synth_steps, seed=a.seed)
        runs.append((f"synthetic ({a.synth_steps} tokens)", sim.prepare(syn)))
    df = pd.concat([measure(rp, name, a.slots, a.windows, a.inserts, a.expert_mib) for name, rp in runs],
                   ignore_index=True)
    df.to_csv(a.out / "admission.csv", index=False, float_format="%.4f")
    plot(df, a.out / "admission.png", src.meta.n_expert, src.meta.n_expert_used)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df[["trace", "slots", "rule", "hit_pct", "hit_pts_vs_always", "uploads_per_token",
                  "uploads_vs_always_pct", "wasted_per_token", "host_reads_per_token", "mib_per_token"]].to_string(
                      index=False, float_format=lambda x: f"{x:.2f}"))
    print(f"written: {a.out / 'admission.csv'}, {a.out / 'admission.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
