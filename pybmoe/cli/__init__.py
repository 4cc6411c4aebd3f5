"""The ``pybmoe`` command line: a thin layer over importable functions; ``pybmoe --help`` lists the
verbs (:data:`VERBS`)."""
from __future__ import annotations

import importlib
import sys

# The CLI layer (the top of the package; tests/test_layering.py): every argument parser and every
# main(argv) lives here, one module per verb, over the library layers below (bench, routing,
# engine, models, build). Each module runs as a script too: python -m pybmoe.cli.<module>.

# verb -> one-line summary, in the order `pybmoe --help` lists them (tests/test_cli.py: every verb is here)
VERBS = {
    "demo": "cache off vs on with a loopback RPC device, then the disk tier vs mmap (no GPU needed)",
    "serve": "run the patched llama-server (every upstream flag; waits for the --rpc devices first)",
    "bin": "print where the patched binaries are",
    "make-model": "write a tiny deterministic MoE GGUF (--like NAME: a published model's shape)",
    "trace": "routing traces: convert IN -o OUT | stats IN | synth --from IN --steps N --out OUT",
    "simulate": "replay expert-cache policies over a routing trace (hit rates, CSV, plot)",
    "size": "recommend --moe-expert-cache slots for a model and a device budget (hit rate from --trace)",
    "sweep": "benchmark the cache with llama-bench or llama-server requests (CSV + PNG)",
    "bench-stream": "benchmark the disk tier against stock mmap under a memory limit (CSV + PNG)",
    "load": "8 clients against one llama-server -np 8 with churning tiers: every answer checked (CSV)",
    "backend-ops": "run test-backend-ops' duplicate-expert-id MUL_MAT_ID cases on each backend",
    "vendor": "fetch, verify, unpack and patch the pinned upstream llama.cpp",
    "patches": "the patch series: list | check | export | rebase --onto VERSION|SDIST|TARBALL|DIR [--ref REF]",
}

# verb -> module of this package whose main(argv) runs it (imported lazily, so `pybmoe serve` stays fast)
_MODULES = {
    "vendor": "vendor",
    "patches": "patches",
    "make-model": "make_model",
    "demo": "demo",
    "trace": "trace",
    "simulate": "simulate",
    "size": "size",
    "sweep": "sweep",
    "bench-stream": "bench_stream",
    "load": "load",
    "backend-ops": "backend_ops",
}


def usage() -> str:
    """The text of ``pybmoe --help``: every verb with its one-line summary."""
    width = max(map(len, VERBS)) + 2
    lines = ["usage: pybmoe VERB [ARGS...]      (pybmoe VERB --help: that verb's options)", "",
             "llama.cpp with a device-resident cache of MoE experts and a disk tier; see README.md.", "",
             "verbs:"]
    lines += [f"  {verb:<{width}}{text}" for verb, text in VERBS.items()]
    lines += ["", "The patched binaries also run under their upstream names: llama-server, llama-cli, llama-bench,",
              "test-backend-ops, ggml-rpc-server; and pybmoe's own tools under theirs: pybmoe-make-synth,",
              "pybmoe-bw, pybmoe-logits (pybmoe bin: where each one is)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("serve", "bin"):
        from . import serve
        return serve.serve_main(rest) if cmd == "serve" else serve.bin_main(rest)
    if cmd in _MODULES:
        return importlib.import_module(f".{_MODULES[cmd]}", __package__).main(rest)
    print(f"pybmoe: unknown verb {cmd!r}\n\n{usage()}", file=sys.stderr)
    return 2
