"""``pybmoe make-model OUT``: a tiny deterministic real-architecture MoE GGUF (:mod:`pybmoe.models`);
with ``--like NAME``, one of a published model's shape (:mod:`pybmoe.models.shapes`), each field of which
``--layers``, ``--experts``, ``--top-k``, ``--embd`` and ``--ff`` override; one parser, so ``--help``
shows every option."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from .. import models
from ..models import shapes

#: A model of more than this many MiB gets one line on stderr before it is written (:func:`large_note`).
LARGE_MIB = 256


def parser() -> argparse.ArgumentParser:
    """The parser of ``pybmoe make-model`` (every option, with and without ``--like``)."""
    d = models.ModelSpec()
    ap = argparse.ArgumentParser(
        prog="pybmoe make-model",
        description="Write a deterministic MoE GGUF with random weights and the pinned Qwen2 vocab: a tiny model "
                    "of --arch (default shape below), or, with --like NAME, a qwen3moe model with the MoE shape "
                    "of a published model (--list-presets), whose fields --layers, --experts, --top-k, --embd and "
                    "--ff override. The size is printed first; --dry-run stops there.",
        epilog="examples: pybmoe make-model tiny.gguf --experts 8 --top-k 2; "
               "pybmoe make-model g.gguf --like granite-3.0-1b-a400m --experts 64; "
               "pybmoe make-model q30.gguf --like qwen3-30b-a3b --dry-run")
    ap.add_argument("out", type=Path, nargs="?", help="output .gguf path (required unless --list-presets or --dry-run)")
    ap.add_argument("--like", choices=list(shapes.PRESETS), metavar="NAME",
                    help="a published model's MoE shape: " + ", ".join(shapes.PRESETS) + " (written as qwen3moe)")
    ap.add_argument("--list-presets", action="store_true", help="print the presets, their shapes and sources, and exit")
    ap.add_argument("--dry-run", action="store_true", help="print the size and write nothing")
    ap.add_argument("--arch", choices=sorted(models.ARCHES), default=None,
                    help=f"llama.cpp architecture (default {d.arch}; --like writes qwen3moe only): " +
                    "; ".join(f"{a.name}: {a.doc}" for a in models.ARCHES.values()))
    ap.add_argument("--ftype", choices=models.FTYPES, default=d.ftype,
                    help="expert/attention weight type (default %(default)s)")
    for flag, field, what in (("--layers", "n_layer", "blocks"), ("--experts", "n_expert", "experts per layer"),
                              ("--top-k", "n_expert_used", "experts routed per token"),
                              ("--embd", "n_embd", "embedding length, elements"),
                              ("--ff", "n_ff_exp", "expert feed-forward length, elements")):
        ap.add_argument(flag, type=int, default=None,
                        help=f"{what} (default {getattr(d, field)}; with --like: the preset's)")
    ap.add_argument("--seed", type=int, default=d.seed, help="RNG seed (default %(default)s)")
    ap.add_argument("--vocab", type=Path, default=None, help="GGUF vocab file (default: the pinned Qwen2 vocab)")
    return ap


def spec_of(a: argparse.Namespace) -> models.ModelSpec:
    """The :class:`pybmoe.models.ModelSpec` a parsed command line asks for. Raises :class:`ValueError`
    naming a field out of range, or ``--arch`` other than qwen3moe beside ``--like``."""
    if a.like is not None:
        if a.arch not in (None, "qwen3moe"):
            raise ValueError(f"--like writes a qwen3moe model; --arch {a.arch} does not apply (drop one of them)")
        return shapes.preset(a.like).spec(ftype=a.ftype, seed=a.seed, n_layer=a.layers, n_expert=a.experts,
                                          top_k=a.top_k, n_embd=a.embd, n_ff_exp=a.ff)
    given = {k: v for k, v in (("n_layer", a.layers), ("n_expert", a.experts), ("n_expert_used", a.top_k),
                               ("n_embd", a.embd), ("n_ff_exp", a.ff)) if v is not None}
    return models.ModelSpec(arch=a.arch or models.ModelSpec.arch, ftype=a.ftype, seed=a.seed, **given)


def make_synth_command(spec: models.ModelSpec, out: Path) -> str | None:
    """The ``pybmoe-make-synth`` command line that writes a model of ``spec``'s shape to ``out`` (other
    random weights), or None when ``spec`` is not a qwen3moe model (the only architecture it writes)."""
    if spec.arch != "qwen3moe":
        return None
    words = ["pybmoe-make-synth", str(out), "--n-layer", spec.n_layer, "--n-expert", spec.n_expert, "--top-k",
             spec.n_expert_used, "--n-embd", spec.n_embd, "--n-ff-exp", spec.n_ff_exp, "--n-head", spec.n_head,
             "--n-head-kv", spec.n_head_kv, "--head-dim", spec.head_dim, "--type", spec.ftype.lower(),
             "--seed", spec.seed]
    if spec.n_ctx_train != models.ModelSpec.n_ctx_train:
        words += ["--n-ctx-train", spec.n_ctx_train]
    return " ".join(map(str, words))


def large_note(spec: models.ModelSpec, out: Path, total_bytes: int) -> str | None:
    """The line printed before writing a model of ``total_bytes`` bytes to ``out``: None up to
    :data:`LARGE_MIB` MiB; above it, the size (GiB), the path, and that ``pybmoe-make-synth`` writes
    large synthetic models much faster (with its command for ``spec``'s shape, where it has one)."""
    if total_bytes <= LARGE_MIB * 2**20:
        return None
    cmd = make_synth_command(spec, out)
    how = f": {cmd}" if cmd else " (qwen3moe only)"
    return (f"pybmoe make-model: writing about {total_bytes / 2**30:.2f} GiB to {out}, one tensor at a time in Python "
            f"(a minute or more at this size); pybmoe-make-synth writes large synthetic models much faster, on every "
            f"core, streamed to the file (the same shape, other random weights){how}")


def out_path_error(out: Path) -> str | None:
    """Why ``out`` cannot be the GGUF to write, in one line: its folder does not exist (it is not
    created: a mistyped path would otherwise leave new folders behind) or is not a folder, or ``out``
    is a folder itself; None when it can be."""
    parent = out.parent
    if not parent.exists():
        return f"{out}: the folder {parent} does not exist; create it first (mkdir -p {parent})"
    if not parent.is_dir():
        return f"{out}: {parent} is not a folder"
    if out.is_dir():
        return f"{out} is a folder; accepted: the path of the .gguf file to write"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe make-model OUT [--like NAME] [--arch NAME] [--ftype F16|Q8_0|Q4_K] [--layers N] [--experts N]
    [--top-k N] [--embd N] [--ff N] [--seed N] [--vocab PATH] [--dry-run]``, or ``--list-presets``;
    returns the exit status (2, with one line on stderr, for a shape out of range, a missing vocab, or an OUT
    whose folder does not exist or that is a folder: :func:`out_path_error`). OUT
    may be left out with ``--dry-run``. Before writing more than :data:`LARGE_MIB` MiB it prints
    :func:`large_note` on stderr."""
    ap = parser()
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.list_presets:
        for s in shapes.PRESETS.values():
            print(f"{s.name:22s} L{s.n_layer} E{s.n_expert} top-{s.top_k} D{s.n_embd} F{s.n_ff_exp} "
                  f"H{s.n_head}/{s.n_head_kv}x{s.head_dim} vocab {s.n_vocab}  {s.source}")
        return 0
    if a.out is None and not a.dry_run:
        ap.error("OUT (the .gguf path to write) is required, unless --list-presets or --dry-run")
    why = None if a.dry_run else out_path_error(a.out)
    if why:
        print(f"pybmoe make-model: error: {why}", file=sys.stderr)
        return 2
    try:
        spec = spec_of(a)
        n_vocab = None if a.vocab is None else len(next(
            kv.value for kv in models.tokenizer_kvs(a.vocab) if kv.key == "tokenizer.ggml.tokens"))
        total, experts = shapes.estimate_bytes(spec, n_vocab)
    except (ValueError, FileNotFoundError) as e:
        print(f"pybmoe make-model: error: {e}", file=sys.stderr)
        return 2
    if a.like is not None or a.dry_run:
        like = f" like {a.like} ({shapes.preset(a.like).source})" if a.like else ""
        where = f"{a.out}: " if a.out is not None else ""
        print(f"{where}{spec.name}{like}: about {total / 2**30:.2f} GiB ({experts / 2**30:.2f} GiB of experts, "
              f"{models.expert_bytes(spec) / 2**20:.3f} MiB/expert)", flush=True)
    if a.dry_run:
        return 0
    note = large_note(spec, a.out, total)
    if note:
        print(note, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        out = models.write_model(spec, a.out, vocab_path=a.vocab)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"pybmoe make-model: error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {spec.name}, {out.stat().st_size / 2**20:.1f} MiB, {models.expert_bytes(spec) / 2**20:.3f} "
          f"MiB/expert, written in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
