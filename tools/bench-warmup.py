#!/usr/bin/env python3
"""The prefill warm-up's effect: the hit rate of the first decode tokens with and without
``--moe-expert-cache-warmup``, on the loopback RPC device.

A benchmark of counts, not of time: each run is one ``pybmoe-logits`` generation (a prompt of
``--prompt-tokens`` words as one prefill ubatch, then ``--n-decode`` decode steps) with
``--moe-trace``; the hit rate of the first ``--n-decode`` decode steps is read from the trace.
Writes ``OUT/warmup.csv`` (one row per run) and ``OUT/warmup.png``.

    python tools/bench-warmup.py -m granite-L24-E32.gguf --route-replay granite-trace.csv \\
        --slots 8,16 --warmup 0,8 --out out/warmup
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybmoe import engine  # noqa: E402
from pybmoe.routing import trace as tr  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="First-decode-tokens hit rate with and without the prefill warm-up.")
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--route-replay", type=Path, default=None, help="routing trace for --moe-route-replay")
    ap.add_argument("--slots", type=_ints, default=[8, 16])
    ap.add_argument("--warmup", type=_ints, default=[0, 8], help="experts per layer (0 = off)")
    ap.add_argument("--modes", default="default,sync", help="upload modes: default, sync or both")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="words in the prompt (about as many tokens)")
    ap.add_argument("--n-decode", type=int, default=16, help="decode steps counted")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    prompt = " ".join(["expert", "cache", "warm", "decode", "prefill", "layer", "router", "upload"] *
                      (a.prompt_tokens // 8 + 1))
    prompt = " ".join(prompt.split()[:a.prompt_tokens])
    replay = ["--moe-route-replay", str(a.route_replay)] if a.route_replay else []
    rows = []
    with engine.RpcServer() as rpc:
        for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
            for slots in a.slots:
                for w in a.warmup:
                    trace = a.out / f"trace-{mode}-{slots}-{w}.csv"
                    r = engine.run_logits(a.model, a.out / "logits.bin",
                                          ["-b", "512", "-ub", "512", *engine.host_experts_args(rpc.endpoint),
                                           *engine.cache_args(slots, sync=mode == "sync"),
                                           *(["--moe-expert-cache-warmup", str(w)] if w else []),
                                           *replay, "--moe-trace", str(trace)],
                                          prompt=prompt, n_predict=a.n_decode + 1, ctx=1024, timeout=1800)
                    f = tr.read_trace(trace).frame
                    d = f[(f["phase"] == "decode") & (f["hit"] >= 0)]
                    first = sorted(d["ubatch"].unique())[:a.n_decode]
                    d = d[d["ubatch"].isin(first)]
                    s = engine.parse_cache_summaries(r.log)[-1]
                    rows.append(dict(mode=mode, slots=slots, warmup=w, decode_steps=len(first),
                                     lookups=len(d), hit_pct=100.0 * (d["hit"] == 1).mean(),
                                     warmup_uploads=s.warmup_uploads, run_hit_pct=s.hit_pct))
                    print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(a.out / "warmup.csv", index=False)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r.mode}\n{r.slots} slots" for r in df.drop_duplicates(["mode", "slots"]).itertuples()]
    width = 0.8 / max(1, len(a.warmup))
    for i, w in enumerate(a.warmup):
        sub = df[df["warmup"] == w]
        ax.bar([x + i * width for x in range(len(sub))], sub["hit_pct"], width,
               label="warm-up off" if w == 0 else f"warm-up {w}/layer")
    ax.set_xticks([x + width * (len(a.warmup) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel(f"hit % of the first {a.n_decode} decode steps")
    ax.set_title(f"{a.model.name}: prefill warm-up")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out / "warmup.png", dpi=120)
    print(df.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
