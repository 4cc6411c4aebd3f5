"""The console entry points of pybmoe's own tools (``pyproject.toml``): ``pybmoe-make-synth`` (the fast
writer of big synthetic qwen3moe models), ``pybmoe-bw`` (the bandwidth probe) and ``pybmoe-logits``
(the logits oracle). Each execs the installed binary (:func:`pybmoe.engine.find_binary`), as
``llama-server`` does (:mod:`.serve`).

``pybmoe-make-synth`` checks its command line first (:func:`make_synth_args`): a missing output path
or option value is named in one line before the binary runs, and ``--vocab`` defaults to the pinned
Qwen2 vocab (:func:`pybmoe.models.default_vocab_path`), the one ``pybmoe make-model`` embeds.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .serve import _exec

#: ``pybmoe-make-synth``'s options that take a value, with what the value is (its help).
MAKE_SYNTH_VALUES = {
    "--vocab": "VOCAB.gguf: the GGUF whose tokenizer.* pairs are copied (default: the pinned Qwen2 vocab)",
    "--n-layer": "N: blocks, every one MoE (default 48)",
    "--n-expert": "N: experts per layer, 2 .. 1024 (default 128)",
    "--top-k": "N: experts routed per token, 1 .. n-expert (default 8)",
    "--n-embd": "N: hidden size, elements (default 2048)",
    "--n-ff-exp": "N: one expert's FFN width, elements (default 768)",
    "--n-head": "N: attention heads (default 32)",
    "--n-head-kv": "N: key/value heads, a divisor of n-head (default 4)",
    "--head-dim": "N: elements per head, even (default 128)",
    "--type": "q8_0|q4_0|q4_k|f16: the matrices' storage type (default q8_0)",
    "--seed": "S: the random stream's seed (default 0); the bytes do not depend on --threads",
    "--threads": "N: writer threads (default: every core)",
    "--n-ctx-train": "N: the trained context recorded in the header, tokens (default 4096)",
}
#: Its options without a value.
MAKE_SYNTH_FLAGS = {
    "--dry-run": "print the summary line (sizes in bytes) and write nothing",
    "--no-mmap": "write with pwrite instead of through a shared mapping of the file",
}


class UsageError(ValueError):
    """A command line the tool would refuse: the message names the argument."""


def make_synth_help() -> str:
    """The text of ``pybmoe-make-synth --help``."""
    lines = ["usage: pybmoe-make-synth OUT [--vocab VOCAB.gguf] [--n-layer N] [--n-expert N] [--top-k N] [--n-embd N]",
             "       [--n-ff-exp N] [--n-head N] [--n-head-kv N] [--head-dim N] [--type q8_0|q4_0|q4_k|f16]",
             "       [--seed S] [--threads N] [--n-ctx-train N] [--dry-run] [--no-mmap]", "",
             "Write a big synthetic qwen3moe GGUF of the given shape to OUT (random weights, deterministic in",
             "--seed), fast: every core, streamed to the file. stdout gets one line:",
             "  pybmoe-make-synth: OUT bytes=B expert_bytes=E dense_bytes=D expert_tensors_bytes=X seconds=S",
             "(bytes of the file, of one expert of one layer, of the non-expert tensors, of all expert tensors).", "",
             "arguments:", "  OUT  the .gguf to write (written to OUT.tmp, then renamed)"]
    width = max(map(len, [*MAKE_SYNTH_VALUES, *MAKE_SYNTH_FLAGS])) + 2
    lines += [f"  {k:<{width}}{v}" for k, v in {**MAKE_SYNTH_VALUES, **MAKE_SYNTH_FLAGS}.items()]
    return "\n".join(lines)


def make_synth_args(argv: list[str], vocab: str | None = None) -> list[str]:
    """The arguments ``pybmoe-make-synth`` hands its binary: ``argv`` checked, with ``--vocab VOCAB``
    appended when absent (``vocab``, default :func:`pybmoe.models.default_vocab_path`).

    Raises:
        UsageError: an unknown option, an option without its value, a second output path, no
            output path (OUT), or (unless ``--dry-run``) an OUT whose folder does not exist or that is a
            folder (:func:`pybmoe.cli.make_model.out_path_error`); the message names it.
        FileNotFoundError: no ``--vocab`` given and the pinned vocab is not there.
    """
    out, has_vocab, i = None, False, 0
    while i < len(argv):
        a = argv[i]
        if a in MAKE_SYNTH_VALUES:
            if i + 1 >= len(argv):
                raise UsageError(f"{a} needs a value ({MAKE_SYNTH_VALUES[a].split(':')[0]})")
            has_vocab = has_vocab or a == "--vocab"
            i += 2
            continue
        if a in MAKE_SYNTH_FLAGS:
            pass
        elif a.startswith("-"):
            raise UsageError(f"unknown argument {a!r}; accepted: OUT, {', '.join([*MAKE_SYNTH_VALUES, *MAKE_SYNTH_FLAGS])}")
        elif out is not None:
            raise UsageError(f"a second output path {a!r} (OUT is already {out!r}); give one OUT")
        else:
            out = a
        i += 1
    if out is None:
        raise UsageError("missing OUT, the .gguf to write (its first argument that is not an option), e.g. "
                         "pybmoe-make-synth synth.gguf --n-layer 24 --n-expert 64")
    if "--dry-run" not in argv:
        from .make_model import out_path_error
        why = out_path_error(Path(out))
        if why:
            raise UsageError(why)
    if has_vocab:
        return list(argv)
    if vocab is None:
        from .. import models
        try:
            vocab = str(models.default_vocab_path())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"missing --vocab VOCAB.gguf, and the default is not there: {e}") from None
    return [*argv, "--vocab", vocab]


def make_synth_main(argv: list[str]) -> int:
    """``pybmoe-make-synth ARGS...``: :func:`make_synth_args`, then exec the binary. Returns 0 for
    ``--help``, 2 (one line on stderr naming the argument) for a command line it refuses; otherwise
    it does not return."""
    if {"-h", "--help"} & set(argv):
        print(make_synth_help())
        return 0
    try:
        args = make_synth_args(argv)
    except (UsageError, FileNotFoundError) as e:
        print(f"pybmoe-make-synth: error: {e}\n(pybmoe-make-synth --help: every option)", file=sys.stderr)
        return 2
    _exec("pybmoe-make-synth", args)
    return 0  # pragma: no cover


BW_HELP = """usage: pybmoe-bw [--host-mib N] [--dev-mib N] [--threads T] [--reps R]

Measure, on the spot, the bandwidths of the expert cache's bandwidth model (docs/benchmarks.md, "GPU
benchmark script"): the host's RAM read bandwidth (T threads summing an N MiB buffer), host-to-device
copies from pinned and from pageable memory, and device-to-device copies (bytes read + written). Each
figure is the best of R repetitions after one untimed pass; without a CUDA build the device figures
are nan. stdout gets one line, in GB/s (1e9 bytes per second):
  pybmoe-bw: host_read_gbs=X h2d_pinned_gbs=Y h2d_pageable_gbs=Z d2d_gbs=W threads=T device=NAME

options (each an integer >= 1):
  --host-mib N   the host buffer, MiB (default 2048)
  --dev-mib N    the device copies, MiB (default 2048)
  --threads T    host threads (default: every core)
  --reps R       repetitions per figure (default 3)"""


def bw_main(argv: list[str]) -> int:
    """``pybmoe-bw ARGS...``: exec the binary; ``--help`` prints :data:`BW_HELP` and returns 0."""
    if {"-h", "--help"} & set(argv):
        print(BW_HELP)
        return 0
    _exec("pybmoe-bw", argv)
    return 0  # pragma: no cover


def exec_pybmoe_make_synth() -> None:
    """Console entry point ``pybmoe-make-synth`` (:func:`make_synth_main`)."""
    sys.exit(make_synth_main(sys.argv[1:]))


def exec_pybmoe_bw() -> None:
    """Console entry point ``pybmoe-bw`` (:func:`bw_main`)."""
    sys.exit(bw_main(sys.argv[1:]))


def exec_pybmoe_logits() -> None:
    """Console entry point ``pybmoe-logits``: exec the logits oracle with all arguments."""
    _exec("pybmoe-logits")

