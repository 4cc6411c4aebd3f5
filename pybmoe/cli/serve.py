"""``pybmoe serve`` and ``pybmoe bin``, and the console entry points ``llama-server``, ``llama-cli``,
``llama-bench``, ``test-backend-ops`` and ``ggml-rpc-server`` (``pyproject.toml``): each execs the
patched binary (:func:`pybmoe.engine.find_binary`) with its arguments passed through."""
from __future__ import annotations

import os
import subprocess
import sys

from .. import engine


def serve_main(argv: list[str]) -> int:
    """``pybmoe serve ARGS...``: exec the patched llama-server (every upstream flag passes through)."""
    try:
        exe = engine.find_binary("llama-server")
    except engine.EngineError as e:
        print(f"pybmoe serve: error: {e}", file=sys.stderr)
        return 2
    os.execv(str(exe), [str(exe), *argv])
    return 0  # pragma: no cover


def bin_main(argv: list[str]) -> int:
    """``pybmoe bin [NAME...]``: where the patched binaries are."""
    names = argv or list(engine.BINARIES)
    rc = 0
    for n in names:
        try:
            print(f"{n}\t{engine.find_binary(n)}")
        except engine.EngineError as e:
            print(f"{n}\t(missing: {e})", file=sys.stderr)
            rc = 2
    return rc


def _exec(name: str) -> None:
    try:
        exe = engine.find_binary(name)
    except engine.EngineError as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(127)
    if os.name == "nt":  # pragma: no cover
        sys.exit(subprocess.call([str(exe), *sys.argv[1:]]))
    os.execv(str(exe), [name, *sys.argv[1:]])  # argv[0] is the upstream name, as in usage lines


def exec_llama_server() -> None:
    """Console entry point ``llama-server``: exec the patched binary with all arguments."""
    _exec("llama-server")


def exec_llama_cli() -> None:
    _exec("llama-cli")


def exec_llama_bench() -> None:
    _exec("llama-bench")


def exec_test_backend_ops() -> None:
    _exec("test-backend-ops")


def exec_ggml_rpc_server() -> None:
    _exec("ggml-rpc-server")
