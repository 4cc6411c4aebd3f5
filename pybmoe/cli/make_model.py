"""``pybmoe make-model OUT``: a tiny deterministic real-architecture MoE GGUF (:mod:`pybmoe.models`);
with ``--like NAME``, one of a published model's shape (:mod:`pybmoe.models.shapes`)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from .. import models
from ..models import shapes


def make_model_main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe make-model OUT [--arch NAME] [--ftype F16|Q8_0|Q4_K] [--layers N] [--experts N] [--top-k N]
    [--embd N] [--ff N] [--seed N] [--vocab PATH]``; returns the exit status."""
    d = models.ModelSpec()
    ap = argparse.ArgumentParser(prog="pybmoe make-model",
                                 description="Write a tiny deterministic MoE GGUF model.")
    ap.add_argument("out", type=Path, help="output .gguf path")
    ap.add_argument("--arch", choices=sorted(models.ARCHES), default=d.arch,
                    help="llama.cpp architecture (default %(default)s): " +
                    "; ".join(f"{a.name}: {a.doc}" for a in models.ARCHES.values()))
    ap.add_argument("--ftype", choices=models.FTYPES, default=d.ftype, help="expert/attention weight type (default %(default)s)")
    ap.add_argument("--layers", type=int, default=d.n_layer, help="blocks (default %(default)s)")
    ap.add_argument("--experts", type=int, default=d.n_expert, help="experts per layer (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=d.n_expert_used, help="experts routed per token (default %(default)s)")
    ap.add_argument("--embd", type=int, default=d.n_embd, help="embedding length (default %(default)s)")
    ap.add_argument("--ff", type=int, default=d.n_ff_exp, help="expert feed-forward length (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed, help="RNG seed (default %(default)s)")
    ap.add_argument("--vocab", type=Path, default=None, help="GGUF vocab file (default: the pinned Qwen2 vocab)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        spec = models.ModelSpec(arch=a.arch, ftype=a.ftype, seed=a.seed, n_layer=a.layers, n_expert=a.experts,
                                n_expert_used=a.top_k, n_embd=a.embd, n_ff_exp=a.ff)
        out = models.write_model(spec, a.out, vocab_path=a.vocab)
    except (ValueError, FileNotFoundError) as e:
        print(f"pybmoe make-model: error: {e}", file=sys.stderr)
        return 2
    mib = out.stat().st_size / 2**20
    print(f"{out}: {spec.name}, {mib:.1f} MiB, {models.expert_bytes(spec) / 2**20:.3f} MiB/expert, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe make-model OUT --like NAME [--layers N] [--embd N] [--ff N] [--ftype Q8_0|Q4_K|F16]
    [--seed S] [--dry-run]``; without ``--like`` it is :func:`make_model_main`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--like" or a.startswith("--like=") or a == "--list-presets" for a in argv):
        return make_model_main(argv)
    ap = argparse.ArgumentParser(prog="pybmoe make-model",
                                 description="Write a qwen3moe GGUF with random weights and the MoE shape of a "
                                             "published model.")
    ap.add_argument("out", type=Path, nargs="?", help="output .gguf path")
    ap.add_argument("--like", choices=list(shapes.PRESETS), help="shape preset")
    ap.add_argument("--list-presets", action="store_true", help="print the presets and their sources")
    ap.add_argument("--ftype", choices=models.FTYPES, default="Q8_0", help="expert/attention weight type "
                                                                           "(default %(default)s)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    ap.add_argument("--embd", type=int, default=None, help="hidden size (default: the preset's)")
    ap.add_argument("--ff", type=int, default=None, help="expert FFN width (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default %(default)s)")
    ap.add_argument("--vocab", type=Path, default=None, help="GGUF vocab file (default: the pinned Qwen2 vocab)")
    ap.add_argument("--dry-run", action="store_true", help="print the size and write nothing")
    a = ap.parse_args(argv)
    if a.list_presets:
        for s in shapes.PRESETS.values():
            print(f"{s.name:22s} L{s.n_layer} E{s.n_expert} top-{s.top_k} D{s.n_embd} F{s.n_ff_exp} "
                  f"H{s.n_head}/{s.n_head_kv}x{s.head_dim} vocab {s.n_vocab}  {s.source}")
        return 0
    if a.out is None or a.like is None:
        ap.error("OUT and --like are required (or --list-presets)")
    try:
        spec = shapes.preset(a.like).spec(ftype=a.ftype, seed=a.seed, n_layer=a.layers, n_embd=a.embd, n_ff_exp=a.ff)
        total, experts = shapes.estimate_bytes(spec)
    except (ValueError, FileNotFoundError) as e:
        print(f"pybmoe make-model: error: {e}", file=sys.stderr)
        return 2
    print(f"{a.out}: {spec.name} like {a.like} ({shapes.preset(a.like).source}): about {total / 2**30:.2f} GiB "
          f"({experts / 2**30:.2f} GiB of experts, {models.expert_bytes(spec) / 2**20:.3f} MiB/expert)", flush=True)
    if a.dry_run:
        return 0
    t0 = time.perf_counter()
    try:
        out = models.write_model(spec, a.out, vocab_path=a.vocab)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"pybmoe make-model: error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB written in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
