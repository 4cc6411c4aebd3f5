"""``pybmoe trace convert | stats | synth``: routing trace formats and statistics
(:mod:`pybmoe.routing.trace`) and synthetic traces (:mod:`pybmoe.routing.synth`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from ..routing import synth
from ..routing import trace as tr

_USAGE = """pybmoe trace: routing trace formats.

    pybmoe trace convert IN -o OUT.{csv,parquet}   read any trace, write the canonical form
    pybmoe trace IN -o OUT                         the same (shorthand)
    pybmoe trace stats IN [--phase decode]         locality statistics
    pybmoe trace synth --from IN --steps N --out OUT   a long synthetic trace with IN's reuse
    pybmoe trace synth --uniform --steps N --n-layer L --n-expert E --top-k K --out OUT   no locality at all

IN is an engine CSV (--moe-trace), Parquet, the granite routing JSON or a JSONL route log; or
"granite", the bundled granite-3.0-1b-a400m routing trace, from any directory
(pybmoe trace stats granite).
Run a subcommand with --help for its options.
"""


def _convert(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="pybmoe trace convert",
                                 description="Read a routing trace and write the canonical columnar form.")
    ap.add_argument("input", type=Path, help="trace file: engine CSV, Parquet, granite JSON or JSONL route log; "
                                             "or granite (the bundled granite-3.0-1b-a400m trace)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="output .csv (engine format), .parquet or .pq (another suffix is refused)")
    ap.add_argument("--format", choices=tr.FORMATS, default="auto", help="input format (default: sniffed)")
    ap.add_argument("--workload", default=None, help="workload name for a JSONL log (default: the file name)")
    a = ap.parse_args(argv)
    try:
        tr.output_format(a.output)  # before reading: a refused -o is the only line
        t = tr.read_trace(a.input, fmt=a.format, workload=a.workload)
        out = tr.write_trace(t, a.output)
    except (OSError, ValueError) as e:
        print(f"pybmoe trace: error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {len(t.frame)} lookups, {len(t.workloads)} workload(s), {len(t.layers)} layers, "
          f"{t.meta.n_expert} experts, top-{t.meta.n_expert_used}")
    return 0


def _stats(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="pybmoe trace stats",
                                 description="Locality statistics of a routing trace: expert-frequency Gini per layer, "
                                             "consecutive-token overlap, reuse distances, static hot-set coverage "
                                             "in sample vs out of sample.")
    ap.add_argument("input", type=Path, help="trace file (any format pybmoe trace reads), or granite (the bundled "
                                             "granite-3.0-1b-a400m trace)")
    ap.add_argument("--phase", choices=tr.PHASE_CHOICES, default="decode", help="rows to analyse (default %(default)s)")
    ap.add_argument("--hot-sizes", default=None, help="comma-separated hot-set sizes in experts per layer "
                                                      "(default: top-k, n/8, n/4, n/2)")
    ap.add_argument("--out-dir", type=Path, default=None, help="also write each table as CSV into this folder")
    a = ap.parse_args(argv)
    try:
        t = tr.read_trace(a.input)
        sizes = [int(x) for x in a.hot_sizes.split(",")] if a.hot_sizes else None
        st = tr.trace_stats(t, phase=a.phase, hot_sizes=sizes)
    except (OSError, ValueError) as e:
        print(f"pybmoe trace stats: error: {e}", file=sys.stderr)
        return 2
    print(st.format())
    if a.out_dir:
        a.out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("summary", "gini", "overlap", "reuse", "static"):
            getattr(st, name).to_csv(a.out_dir / f"{name}.csv", index=False)
        print(f"\ntables written to {a.out_dir}/")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe trace {convert,stats,synth} ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "stats":
        return _stats(argv[1:])
    if argv[0] == "convert":
        return _convert(argv[1:])
    if argv[0] == "synth":
        return synth_main(argv[1:])
    return _convert(argv)


def synth_main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe trace synth --from TRACE --steps N [--seed S] [--workloads W] [--n-layer L --n-expert E
    --top-k K --distance-scale S] --out FILE``."""
    ap = argparse.ArgumentParser(prog="pybmoe trace synth",
                                 description="Generate a long decode routing trace that resamples a short real "
                                             "trace's per-layer LRU stack distances and expert popularity.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="source", type=Path, help="source trace (any format pybmoe reads), or granite "
                                                              "(the bundled granite-3.0-1b-a400m trace)")
    src.add_argument("--uniform", action="store_true",
                     help="no source: every token's top-k drawn uniformly at random (no locality, the worst case); "
                          "needs --n-layer, --n-expert and --top-k")
    ap.add_argument("--steps", type=int, required=True, help="decode tokens per workload")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default %(default)s)")
    ap.add_argument("--workloads", type=int, default=1, help="workloads, each from an empty stack (default 1)")
    ap.add_argument("--block", type=float, default=16.0, help="mean run of consecutive source tokens (default 16)")
    ap.add_argument("--n-layer", type=int, default=None,
                    help="map onto L MoE layers (0..L-1); layer i resamples source layer i mod L_src")
    ap.add_argument("--n-expert", type=int, default=None,
                    help="map onto E experts per layer (stack distances scaled by E/E_src, experts relabelled)")
    ap.add_argument("--top-k", type=int, default=None,
                    help="experts per token, at most the source's (its first ranks are kept; default the source's)")
    ap.add_argument("--distance-scale", type=float, default=None,
                    help="scale of the stack distances when mapping (default E/E_src; 1 keeps them)")
    ap.add_argument("--out", type=Path, required=True, help="output .csv (the --moe-trace format) or .parquet")
    a = ap.parse_args(argv)
    if a.uniform and None in (a.n_layer, a.n_expert, a.top_k):
        print("pybmoe trace synth: error: --uniform needs --n-layer, --n-expert and --top-k", file=sys.stderr)
        return 2
    try:
        tr.output_format(a.out)
        if a.uniform:
            out = synth.uniform(a.steps, n_layer=a.n_layer, n_expert=a.n_expert, top_k=a.top_k, seed=a.seed)
        else:
            out = synth.synthesize(tr.read_trace(a.source), a.steps, seed=a.seed, workloads=a.workloads,
                                   block=a.block, n_layer=a.n_layer, n_expert=a.n_expert, top_k=a.top_k,
                                   distance_scale=a.distance_scale)
        path = tr.write_trace(out, a.out)
    except (OSError, ValueError) as e:
        print(f"pybmoe trace synth: error: {e}", file=sys.stderr)
        return 2
    if a.uniform:
        print(f"{path}: {len(out.frame)} lookups, {a.steps} decode tokens, uniform top-{a.top_k} of {a.n_expert} "
              f"experts, {a.n_layer} layers (seed {a.seed})")
        return 0
    print(f"{path}: {len(out.frame)} lookups, {a.workloads} x {a.steps} decode tokens, {len(out.layers)} layers, "
          f"{out.meta.n_expert} experts, top-{out.meta.n_expert_used} (from {a.source}, seed {a.seed})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
