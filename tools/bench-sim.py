#!/usr/bin/env python3
"""Benchmark of the replay simulator: routing events (lookups) replayed per second, per policy.

A benchmark, not a test: it prints a table and writes a CSV (default out/bench-sim.csv), and
asserts nothing. The trace is synthetic (seeded): ``--layers`` x ``--experts``, top-``--top-k``,
``--tokens`` decode tokens in ``--workloads`` workloads, with Zipf-skewed experts per layer and
``--stick`` of a token's experts carried over from the previous token, like real routing.
The trace is prepared once, before any timing (sort orders, units, the static policy's counts:
what every budget shares, as in a sweep). Each policy is timed ``--repeat`` times at each
budget; the median is reported.

    python tools/bench-sim.py                      # ~8 M events per run
    python tools/bench-sim.py --tokens 2000 --policies layer-lru,pool

The replay runs in the compiled core (pybmoe/routing/_simcore.c), its only implementation.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybmoe.routing import sim, trace as tr  # noqa: E402


def synthetic_routing(tokens: int, layers: int, experts: int, top_k: int, stick: float, seed: int) -> np.ndarray:
    """Routing ``[tokens, layers, top_k]``: per layer a Zipf(1) popularity over a random permutation
    of the experts; each token keeps about ``stick`` of the previous token's experts."""
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((layers, experts)), axis=1)
    logp = -np.log1p(ranks).astype(np.float64)
    out = np.empty((tokens, layers, top_k), dtype=np.int32)
    prev = np.zeros((layers, experts), dtype=bool)
    bonus = np.log(stick / (1 - stick) * experts / top_k) if 0 < stick < 1 else 0.0
    for t in range(tokens):
        score = logp + rng.gumbel(size=(layers, experts)) + bonus * prev
        top = np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]
        order = np.argsort(-np.take_along_axis(score, top, axis=1), axis=1)
        out[t] = np.take_along_axis(top, order, axis=1)
        prev[:] = False
        np.put_along_axis(prev, out[t], True, axis=1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Replay throughput (routing events per second) per policy.")
    ap.add_argument("--tokens", type=int, default=20000, help="decode tokens in all (default %(default)s)")
    ap.add_argument("--workloads", type=int, default=4, help="workloads the tokens are split into (default %(default)s)")
    ap.add_argument("--layers", type=int, default=48, help="MoE layers (default %(default)s)")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token (default %(default)s)")
    ap.add_argument("--stick", type=float, default=0.45, help="share of experts kept from the previous token")
    ap.add_argument("--slots", default="8,32,96", help="budgets in slots per layer (default %(default)s)")
    ap.add_argument("--policies", default=",".join(sim.POLICIES), help="policies (default: all)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point; the median counts (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=Path("out/bench-sim.csv"), help="CSV output (default %(default)s)")
    a = ap.parse_args(argv)
    try:
        sim.require_core()
    except sim.CoreError as e:
        print(f"bench-sim: {e}", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    per = a.tokens // a.workloads
    traces = [tr.make_trace(synthetic_routing(per, a.layers, a.experts, a.top_k, a.stick, a.seed + w),
                            workload=f"w{w}", n_expert=a.experts) for w in range(a.workloads)]
    trace = tr.concat(traces)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    rp = sim.prepare(trace)
    rp.layer_units(1)
    rp.global_units("decode")
    rp.static_counts("decode")
    rp.overlap()
    t_prep = time.perf_counter() - t0
    n = rp.n_rows
    print(f"trace: {n:,} events ({a.workloads} workloads x {per} tokens x {a.layers} layers x top-{a.top_k} of "
          f"{a.experts}); generated in {t_gen:.1f} s, prepared in {t_prep:.2f} s ({n / t_prep / 1e6:.1f} M events/s); "
          f"core {sim.core_path()}")
    rows = []
    for p in a.policies.split(","):
        for s in (int(x) for x in a.slots.split(",")):
            times = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                r = sim.simulate(rp, p, slots_per_layer=s)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            rows.append({"policy": p, "slots_per_layer": s, "events": n, "seconds": med, "events_per_s": n / med,
                         "hit_rate": r.hit_rate, "layers": a.layers, "experts": a.experts,
                         "top_k": a.top_k, "tokens": a.tokens, "machine": platform.machine(),
                         "python": platform.python_version()})
            print(f"  {p:10s} slots {s:4d}: {n / med / 1e6:7.2f} M events/s  ({med * 1e3:7.1f} ms, hit {100 * r.hit_rate:5.1f}%)",
                  flush=True)
    df = pd.DataFrame(rows)
    a.csv.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.csv, index=False)
    summary = df.groupby("policy", sort=False)["events_per_s"].min() / 1e6
    print("\nslowest budget per policy (M events/s):")
    print(summary.to_string(float_format=lambda x: f"{x:.1f}"))
    print(f"CSV: {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
