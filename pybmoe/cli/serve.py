"""``pybmoe serve`` and ``pybmoe bin``, and the console entry points ``llama-server``, ``llama-cli``,
``llama-bench``, ``test-backend-ops`` and ``ggml-rpc-server`` (``pyproject.toml``): each execs the
patched binary (:func:`pybmoe.engine.find_binary`) with its arguments passed through. ``pybmoe
serve`` first waits for the ``--rpc`` devices to accept connections; the upstream names do not."""
from __future__ import annotations

import os
import subprocess
import sys

from .. import engine


#: Seconds ``pybmoe serve`` waits for each ``--rpc`` endpoint to accept (``PYBMOE_RPC_WAIT_S``; 0: no wait).
RPC_WAIT_S = 60.0


def rpc_endpoints(argv: list[str], env: dict | None = None) -> list[str]:
    """The ``host:port`` endpoints a llama-server command line names with ``--rpc A,B`` (or
    ``--rpc=A,B``; the last one wins, as in llama.cpp's parser), else ``$LLAMA_ARG_RPC``."""
    env = os.environ if env is None else env
    value = None
    for i, a in enumerate(argv):
        if a == "--rpc" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--rpc="):
            value = a.split("=", 1)[1]
    if value is None:
        value = env.get("LLAMA_ARG_RPC")
    return [e.strip() for e in (value or "").split(",") if e.strip()]


def wait_for_rpc(endpoints: list[str], timeout_s: float, err=None) -> str | None:
    """Waits until every endpoint accepts connections (a ``ggml-rpc-server`` started a moment
    ago with ``&``). Returns None, or the message of the first one that did not within
    ``timeout_s`` seconds (or is malformed). ``err``: where the waiting line goes (stderr)."""
    err = err or sys.stderr
    for ep in endpoints:
        try:
            if engine.wait_for_endpoint(ep, 0):
                continue
            print(f"pybmoe serve: waiting for the ggml-rpc-server at {ep} (up to {timeout_s:.0f} s)", file=err,
                  flush=True)
            if not engine.wait_for_endpoint(ep, timeout_s):
                _, port = engine.split_endpoint(ep)
                return (f"nothing accepts connections at {ep} after {timeout_s:.0f} s; start the device first "
                        f"(ggml-rpc-server -p {port} &) or fix --rpc")
        except ValueError as e:
            return str(e)
    return None


def serve_main(argv: list[str]) -> int:
    """``pybmoe serve ARGS...``: exec the patched llama-server (every upstream flag passes through),
    once every ``--rpc`` endpoint accepts connections (stock llama-server aborts with a backtrace when
    one does not yet: ``Failed to connect to host:port``)."""
    try:
        exe = engine.find_binary("llama-server")
    except engine.EngineError as e:
        print(f"pybmoe serve: error: {e}", file=sys.stderr)
        return 2
    if not ({"-h", "--help", "--usage"} & set(argv)):
        try:
            timeout_s = float(os.environ.get("PYBMOE_RPC_WAIT_S", RPC_WAIT_S))
        except ValueError:
            timeout_s = RPC_WAIT_S
        why = wait_for_rpc(rpc_endpoints(argv), timeout_s) if timeout_s > 0 else None
        if why:
            print(f"pybmoe serve: error: {why}", file=sys.stderr)
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
