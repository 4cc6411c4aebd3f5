"""``pybmoe size -m MODEL``: recommended cache slots per layer (:mod:`pybmoe.routing.sizing`, where the
rules live), from a routing trace when one is given; without one, no hit rate is predicted."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

from ..routing import sim, sizing
from ..routing import trace as tr
from . import paths

#: Each numeric option's lower bound, whether the bound itself is accepted, and its unit (``check_args``).
RANGES = {
    "free_mb": ("--free-mb", 0, True, "MiB"),
    "inserts": ("--inserts", 0, True, "uploads per layer per step"),
    "stream_mb": ("--stream-mb", 0, False, "MiB"),
    "disk_mib_s": ("--disk-mib-s", 0, False, "MiB/s"),
    "n_gen": ("--n-gen", 1, True, "tokens"),
    "step_overhead_ms": ("--step-overhead-ms", 0, True, "ms"),
    "resident_tok_s": ("--resident-tok-s", 0, False, "tok/s"),
    "ram_mib_s": ("--ram-mib-s", 0, False, "MiB/s"),
}


def check_args(a: argparse.Namespace) -> None:
    """Checks every option of ``pybmoe size`` before any work (:data:`RANGES`; a number must be finite),
    and that ``--stream-mb`` has what its prediction needs (``--trace``, the disk's bandwidth and the
    compute's). Raises :class:`ValueError` naming the option, its value and what is accepted."""
    for dest, (flag, lo, closed, unit) in RANGES.items():
        values = getattr(a, dest)
        for v in values if isinstance(values, list) else [values]:
            if v is None:
                continue
            if not math.isfinite(v) or (v < lo if closed else v <= lo):
                kind = "an integer" if isinstance(v, int) else "a number"
                raise ValueError(f"{flag} {v:g}: accepted: {kind} {'>=' if closed else '>'} {lo:g} ({unit})")
    if a.stream_mb:
        missing = [what for what, ok in (("--trace", a.trace is not None),
                                         ("--disk-mib-s or --probe-disk", a.disk_mib_s is not None or a.probe_disk),
                                         ("--resident-tok-s or --ram-mib-s",
                                          a.resident_tok_s is not None or a.ram_mib_s is not None)) if not ok]
        if missing:
            raise ValueError(f"--stream-mb {' '.join(f'{v:g}' for v in a.stream_mb)} needs {' and '.join(missing)} "
                             "(a prediction replays the trace and times its reads and compute)")


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe size -m MODEL.gguf [--trace T] [--free-mb N] [--inserts N]``; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="pybmoe size",
        description="Recommend --moe-expert-cache slots per layer for a model. Each cached layer costs "
                    "(slots + staging + 1) experts of device memory; the ceiling is every expert, or the most "
                    "slots that fit --free-mb. With --trace (a routing trace of this model) every slot count up to "
                    "the ceiling is replayed with the engine's own policy, and the recommendation is the smallest "
                    "one within 1 point of the best hit rate; without a trace it is the ceiling, and no hit rate "
                    "is predicted. Below top-k slots a layer cannot hold one token's experts (a warning).")
    ap.add_argument("-m", "--model", type=Path, required=True, help="GGUF model")
    ap.add_argument("--trace", type=Path, default=None,
                    help="routing trace of this model (any pybmoe trace format), or granite (the bundled "
                         "granite-3.0-1b-a400m trace)")
    ap.add_argument("--free-mb", type=float, default=None, help="device memory (MiB) the cache may use")
    ap.add_argument("--inserts", type=int, default=0, help="--moe-expert-cache-inserts to plan for (default 0 = unlimited)")
    st = ap.add_argument_group("the stream tier (--moe-stream-cache-mb): predicted decode tok/s, needs --trace")
    st.add_argument("--stream-mb", type=float, action="append", default=[],
                    help="a RAM budget (MiB) to predict; repeat for several")
    st.add_argument("--disk-mib-s", type=float, default=None, help="measured read bandwidth of the model's disk, MiB/s "
                                                                  "(at the tier's read size: --probe-disk measures it)")
    st.add_argument("--probe-disk", action="store_true",
                    help="measure the disk bandwidth here: O_DIRECT reads of the model's own expert projections on "
                         "the tier's 4 lanes into fresh memory (pybmoe.bench.disk; a few seconds)")
    st.add_argument("--n-gen", type=int, default=None,
                    help="predict a short run from an empty cache, as llama-bench -n N (its warm-up token untimed); "
                         "default: the whole trace")
    st.add_argument("--step-overhead-ms", type=float, default=sizing.STREAM_STEP_OVERHEAD_MS,
                    help="the tier's own time per layer step beside its reads (default %(default)s ms, measured: "
                         "docs/benchmarks/stream-defaults-2026-12-03/README.md)")
    st.add_argument("--resident-tok-s", type=float, default=None,
                    help="measured decode tok/s with every expert in RAM (the compute part of a token)")
    st.add_argument("--ram-mib-s", type=float, default=None,
                    help="instead of --resident-tok-s: RAM read bandwidth, MiB/s (a token reads its experts)")
    a = ap.parse_args(argv)
    try:
        check_args(a)
    except ValueError as e:
        print(f"pybmoe size: error: {e}", file=sys.stderr)
        return 2
    why = paths.model_error(a.model)
    if why:
        print(f"pybmoe size: error: {why}", file=sys.stderr)
        return 2
    try:
        shape = sizing.model_shape(a.model)
        t = tr.read_trace(a.trace) if a.trace else None
        rec = sizing.recommend(shape, free_mib=a.free_mb, trace=t, inserts=a.inserts)
    except (OSError, ValueError) as e:
        print(f"pybmoe size: error: {e}", file=sys.stderr)
        return 2
    print(f"{a.model.name}: {shape.n_layer} MoE layers x {shape.n_expert} experts, top-{shape.top_k}, "
          f"{shape.expert_bytes / sizing.MIB:.3g} MiB per expert")
    table = rec.table if t is not None else rec.table.drop(columns=["hit_rate", "pool_hit_rate"])
    if len(table):
        print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    pool_hit = float("nan")
    if t is not None and rec.slots_per_layer:
        pool_hit = float(rec.table.loc[rec.table["slots_per_layer"] == rec.slots_per_layer, "pool_hit_rate"].iloc[0])
    if t is not None:
        why = f", expected hit rate {100 * rec.hit_rate:.1f}% (decode, from {a.trace.name})"
    else:
        why = "; no trace given: the most slots that fit, hit rate not predicted (--trace FILE predicts it)"
    print(f"recommended: --moe-expert-cache {rec.slots_per_layer}"
          + (f" --moe-expert-cache-inserts {a.inserts}" if a.inserts else "")
          + f"  ({rec.device_mib:.3g} MiB on the device{why}); in MiB per device: --moe-expert-cache-mb "
          + f"{sizing.budget_mib(rec.slots_per_layer, shape, a.inserts)}"
          + (f" (one pool of {sizing.pool_slots(rec.slots_per_layer, shape, a.inserts)} slots"
             + (f", expected hit rate {100 * pool_hit:.1f}%)" if t is not None else ")")
             if rec.slots_per_layer else ""))
    for w in rec.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if a.stream_mb:
        if a.probe_disk:
            from ..bench import disk
            pr = disk.probe(a.model)
            a.disk_mib_s = pr.mib_s
            print(f"disk probe: {pr.mib_s:.0f} MiB/s ({pr.reads} reads of {pr.read_bytes / sizing.MIB:.2f} MiB on "
                  f"{pr.lanes} lanes, {'O_DIRECT' if pr.direct else 'buffered'}, {pr.seconds:.1f} s)")
        print(f"stream tier ({sim.STREAM_POLICY} over the trace's decode lookups; a token = compute + "
              f"{a.step_overhead_ms:g} ms per layer step + its misses read at {a.disk_mib_s:.0f} MiB/s):")
        for mb in a.stream_mb:
            try:
                p = sizing.predict_stream(shape, t, mb, disk_mib_s=a.disk_mib_s, resident_tok_s=a.resident_tok_s,
                                          ram_mib_s=a.ram_mib_s, step_overhead_ms=a.step_overhead_ms,
                                          tokens=None if a.n_gen is None else a.n_gen + 1,
                                          skip=0 if a.n_gen is None else 1)
            except (OSError, ValueError) as e:
                print(f"pybmoe size: error: {e}", file=sys.stderr)
                return 2
            print(f"  --moe-stream-cache-mb {mb:g}: {p.budget_entries} experts (+{p.window_experts} of the prefetch "
                  f"window in decode), {100 * p.hit_rate:.1f}% hit, "
                  f"{p.miss_mib_per_token:.1f} MiB read/token, predicted {p.tok_s:.2f} tok/s decode")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
