#!/usr/bin/env python3
"""The VRAM tier's pool in the engine against per-layer slots at the same MiB, on real routing.

A benchmark of counts (hit rates and uploads are a function of the routing in sync mode, so it can run
beside other work): the bundled granite-3.0-1b-a400m trace (24 layers, 32 experts, top-8) replayed
through a generated model of its shape (``--moe-route-replay``, pybmoe.routing.granite.granite_replay)
on the loopback RPC device, ``--moe-expert-cache-sync``, the prompt of the replay then ``--n-predict``
decode tokens. For each ``S`` in ``--slots``: ``--moe-expert-cache S`` (per-layer slots), then
``--moe-expert-cache-mb M`` with ``M`` the MiB those slots, their staging and zero slots take (rounded
up), which the engine runs as one pool (docs/expert-cache.md, "The pool"). Each pair runs twice: in
``pybmoe-logits`` (the prompt as one ubatch, then ``--n-predict`` single-token decodes) and through
``llama-server`` at its own defaults otherwise (its context, slots and batch; one completion request of
the same prompt and length). The tier is off at the defaults, so there is no point without a cache
flag: the two cache flags are the only tuning.

Writes ``OUT/pool-engine.csv`` (one row per S: ``mib``, the pool's ``pool_slots``, each run's hit % and
uploads from its summary line, ``logits_equal``: the two runs' logits, both bit-identical to the cache
off by the tests; ``server_layer_hit_pct`` / ``server_pool_hit_pct``: the same through llama-server)
and ``OUT/pool-engine.png`` (hit % against MiB). Usage:
``python tools/bench-pool-engine.py --out DIR [--slots 2,4,8,16] [--n-predict 64]``.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pybmoe import engine  # noqa: E402
from pybmoe.routing import granite  # noqa: E402

POOL = re.compile(r"one pool of (\d+) slots")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--slots", default="2,4,8,16", help="per-layer slot counts, comma-separated")
    ap.add_argument("--n-predict", type=int, default=64, help="decode tokens")
    a = ap.parse_args(argv)
    slots = [int(x) for x in a.slots.split(",")]
    if a.n_predict < 2 or any(s < 1 for s in slots):
        ap.error("--n-predict must be >= 2 and every slot count >= 1")
    a.out.mkdir(parents=True, exist_ok=True)
    model, csv, n_prompt = granite.granite_replay()
    prompt = " ".join(["hello"] * (n_prompt - 1))
    tmp = Path(tempfile.mkdtemp())
    rows = []
    with engine.RpcServer(threads=1) as rpc:
        base = [*engine.host_experts_args(rpc.endpoint), "--moe-route-replay", str(csv), "--moe-expert-cache-sync"]
        for s in slots:
            per = engine.run_logits(model, tmp / f"l{s}.bin", [*base, "--moe-expert-cache", str(s)], prompt=prompt,
                                    n_predict=a.n_predict, ctx=512, timeout=900)
            rec = engine.cache_record(per.log)
            k, n_expert = rec["top_k"], rec["n_expert"]
            mib = math.ceil(rec["layers"] * (s + min(k, n_expert - s) + 1) * rec["slot_mib"])
            pool = engine.run_logits(model, tmp / f"p{s}.bin", [*base, "--moe-expert-cache-mb", str(mib)], prompt=prompt,
                                     n_predict=a.n_predict, ctx=512, timeout=900)
            x, y = engine.parse_cache_summaries(per.log)[-1], engine.parse_cache_summaries(pool.log)[-1]
            server = []
            for flags in (["--moe-expert-cache", str(s)], ["--moe-expert-cache-mb", str(mib)]):
                srv = engine.LlamaServer(["-m", str(model), *base, *flags])
                with srv:
                    srv.completion(prompt, n_predict=a.n_predict)
                server.append(engine.parse_cache_summaries(srv.stop())[-1].hit_pct)
            rows.append({"slots_per_layer": s, "mib": mib, "layer_slots": s * rec["layers"],
                         "pool_slots": int(POOL.search(pool.log).group(1)), "layer_hit_pct": x.hit_pct,
                         "pool_hit_pct": y.hit_pct, "layer_uploads": x.uploads, "pool_uploads": y.uploads,
                         "logits_equal": per.logits == pool.logits, "server_layer_hit_pct": server[0],
                         "server_pool_hit_pct": server[1]})
            print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(a.out / "pool-engine.csv", index=False)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-pool-engine: matplotlib is not importable: no PNG", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(df["mib"], df["layer_hit_pct"], "o-", label="per-layer slots (--moe-expert-cache S)")
    ax.plot(df["mib"], df["pool_hit_pct"], "s-", label="pool (--moe-expert-cache-mb M)")
    ax.plot(df["mib"], df["server_layer_hit_pct"], "o--", color="C0", alpha=0.6, label="per-layer, llama-server")
    ax.plot(df["mib"], df["server_pool_hit_pct"], "s--", color="C1", alpha=0.6, label="pool, llama-server")
    ax.set_xlabel("MiB of expert slots on the device")
    ax.set_ylabel("hit % (decode steps, sync)")
    ax.set_title(f"granite routing, {a.n_predict} decode tokens, RPC device")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out / "pool-engine.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
