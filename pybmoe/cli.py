"""``pybmoe`` command line: a thin layer over importable functions.

    pybmoe vendor            fetch, verify, unpack and patch the pinned upstream
    pybmoe patches ...       list | check | export | rebase the patch series
    pybmoe make-model OUT    write a tiny deterministic real-architecture MoE GGUF (--like NAME: a real shape)
    pybmoe serve ARGS...     exec the patched llama-server (every upstream flag passes through)
    pybmoe demo              cache off vs on on the embedded model, with a loopback RPC device
    pybmoe bin [NAME]        print where the patched binaries are
    pybmoe trace ...         routing traces: convert IN -o OUT | stats IN
    pybmoe simulate TRACE    replay expert-cache policies over a routing trace
    pybmoe size -m MODEL     recommend cache slots per layer (from a trace if given)
    pybmoe sweep -m MODEL    benchmark sweep of the cache with llama-bench (CSV + PNG)
    pybmoe backend-ops       test-backend-ops' duplicate-expert-id MUL_MAT_ID cases, per backend
"""
from __future__ import annotations

import sys


def _serve(argv: list[str]) -> int:
    from . import engine
    try:
        exe = engine.find_binary("llama-server")
    except engine.EngineError as e:
        print(f"pybmoe serve: error: {e}", file=sys.stderr)
        return 2
    import os
    os.execv(str(exe), [str(exe), *argv])
    return 0  # pragma: no cover


def _bin(argv: list[str]) -> int:
    from . import engine
    names = argv or list(engine.BINARIES)
    rc = 0
    for n in names:
        try:
            print(f"{n}\t{engine.find_binary(n)}")
        except engine.EngineError as e:
            print(f"{n}\t(missing: {e})", file=sys.stderr)
            rc = 2
    return rc


# subcommand -> module whose main(argv) runs it (imported lazily, so `pybmoe serve` stays fast)
_MODULES = {
    "vendor": "vendor",
    "patches": "patches",
    "make-model": "shapes",  # --like NAME: shape presets; otherwise models.main
    "demo": "demo",
    "trace": "trace",
    "simulate": "sim",
    "size": "sizing",
    "sweep": "bench",
    "backend-ops": "backend_ops",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        return _serve(rest)
    if cmd == "bin":
        return _bin(rest)
    if cmd in _MODULES:
        import importlib
        return importlib.import_module(f".{_MODULES[cmd]}", __package__).main(rest)
    print(f"pybmoe: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
