"""``pybmoe`` command line: a thin layer over importable functions.

    pybmoe vendor            fetch, verify, unpack and patch the pinned upstream
    pybmoe patches ...       list | check | export | rebase the patch series
    pybmoe make-model OUT    write a tiny deterministic real-architecture MoE GGUF (--like NAME: a real shape)
    pybmoe serve ARGS...     exec the patched llama-server (every upstream flag passes through)
    pybmoe demo              cache off vs on on the embedded model, with a loopback RPC device
    pybmoe bin [NAME]        print where the patched binaries are
    pybmoe trace ...         routing traces: convert IN -o OUT | stats IN | synth --from IN
    pybmoe simulate TRACE    replay expert-cache policies over a routing trace
    pybmoe size -m MODEL     recommend cache slots per layer (from a trace if given)
    pybmoe sweep -m MODEL    benchmark sweep of the cache with llama-bench (CSV + PNG)
    pybmoe bench-stream -m MODEL --limit-mb L
                             the stream tier against stock mmap under a memory limit (CSV + PNG)
    pybmoe backend-ops       test-backend-ops' duplicate-expert-id MUL_MAT_ID cases, per backend
"""
from __future__ import annotations

import importlib
import sys

# The CLI layer (the top of the package; tests/test_layering.py): every argument parser and every
# main(argv) lives here, one module per verb, over the library layers below (bench, routing,
# engine, models, build). Each module runs as a script too: python -m pybmoe.cli.<module>.

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
    "backend-ops": "backend_ops",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("serve", "bin"):
        from . import serve
        return serve.serve_main(rest) if cmd == "serve" else serve.bin_main(rest)
    if cmd in _MODULES:
        return importlib.import_module(f".{_MODULES[cmd]}", __package__).main(rest)
    print(f"pybmoe: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2
