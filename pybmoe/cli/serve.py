"""``pybmoe serve`` and ``pybmoe bin``, and the console entry points ``llama-server``, ``llama-cli``,
``llama-bench``, ``test-backend-ops`` and ``ggml-rpc-server`` (``pyproject.toml``): each execs the
patched binary (:func:`pybmoe.engine.find_binary`) with its arguments passed through (pybmoe's own
tools, ``pybmoe-make-synth``, ``pybmoe-bw`` and ``pybmoe-logits``: :mod:`.tools`). ``pybmoe
serve`` first waits for the ``--rpc`` devices to accept connections; the upstream names do not."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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


def model_arg(argv: list[str], env: dict | None = None) -> str | None:
    """The model file a llama-server command line names with ``-m X``, ``--model X`` or ``--model=X``
    (the last one wins, as in llama.cpp's parser), else ``$LLAMA_ARG_MODEL``; None when it names none
    (``-hf``, ``--model-url``)."""
    env = os.environ if env is None else env
    value = None
    for i, a in enumerate(argv):
        if a in ("-m", "--model") and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--model="):
            value = a.split("=", 1)[1]
    return value if value is not None else env.get("LLAMA_ARG_MODEL") or None


def drop_model_cache(model: str, err=None) -> None:
    """Drops the cached pages of ``model`` (every file of a split GGUF) before a server starts under a
    memory limit (:func:`pybmoe.engine.memlimit.drop_file_cache`): pages another process cached, such as
    ``pybmoe make-model`` right before, are charged to that process's cgroup, and would spare the server
    the reads the limit is there to count. Prints one line on ``err`` (stderr) saying what it dropped, or
    why it could not."""
    from .. import models
    from ..engine import memlimit
    err = err or sys.stderr
    try:
        files = models.split_files(model)
        mib = sum(memlimit.drop_file_cache(f) for f in files) / 2**20
    except (OSError, ValueError) as e:
        print(f"pybmoe serve: note: the model's cached pages were not dropped ({e}); pages cached before the "
              "server starts are not counted by the limit", file=err, flush=True)
        return
    print(f"pybmoe serve: dropped {mib:.0f} MiB of {model} from the page cache, so that the limit counts the "
          "server's reads of it", file=err, flush=True)


def memory_limit_arg(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--memory-limit-mb N`` (or ``--memory-limit-mb=N``) taken out of a llama-server command line:
    (N, the rest), or (None, argv) when absent.

    Raises :class:`ValueError` for a value that is not an integer >= 16 (MiB)."""
    rest, limit = [], None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--memory-limit-mb" or a.startswith("--memory-limit-mb="):
            if "=" in a:
                v = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                v = argv[i + 1]
                i += 1
            else:
                raise ValueError("--memory-limit-mb needs a value (MiB)")
            if not v.strip().isdigit() or int(v) < 16:
                raise ValueError(f"--memory-limit-mb expects an integer >= 16 (MiB), got {v!r}")
            limit = int(v)
        else:
            rest.append(a)
        i += 1
    return limit, rest


def serve_usage() -> str:
    """The head of ``pybmoe serve --help``: pybmoe serve's own option and behaviour, before
    ``llama-server``'s help (which follows it on stdout)."""
    return ("usage: pybmoe serve [--memory-limit-mb N] [LLAMA-SERVER OPTIONS...]\n\n"
            "Run the patched llama-server with every option passed through. pybmoe serve adds:\n"
            "  --memory-limit-mb N   run llama-server inside a cgroup memory limit of N MiB (N >= 16; page cache\n"
            "                        included, as on a machine of that size; needs root and the cgroup memory\n"
            "                        controller: exit 2 where one cannot be made; docs/stream-tier.md); the\n"
            "                        model's cached pages are dropped first, so that the limit counts its reads\n"
            "refuses a -m file that is missing, empty, not GGUF or truncated in one line (exit 2), and\n"
            f"waits up to {RPC_WAIT_S:.0f} s (PYBMOE_RPC_WAIT_S; 0: no wait) for every --rpc HOST:PORT device to\n"
            "accept connections, where stock llama-server aborts; exit 2 with one line when one does not.\n\n"
            "llama-server's options:\n")


def _serve_limited(exe: str, argv: list[str], limit_mib: int) -> int:
    """Runs llama-server as a child inside a memory cgroup of ``limit_mib`` MiB (page cache included),
    forwards SIGINT and SIGTERM to it, and removes the cgroup when it exits. Returns its exit status."""
    from ..engine import memlimit
    ok, why = memlimit.limit_available()
    if not ok:
        print(f"pybmoe serve: error: --memory-limit-mb {limit_mib}: {why}; run as root on a machine with the cgroup "
              "memory controller, or put the server under a limit yourself (docs/stream-tier.md, \"Under a memory "
              "limit\")", file=sys.stderr)
        return 2
    model = model_arg(argv)
    if model is not None:
        drop_model_cache(model)
    with memlimit.MemoryLimit(limit_mib) as lim:
        print(f"pybmoe serve: llama-server runs under a {limit_mib} MiB memory limit (cgroup {lim.path}, page cache "
              "included)", file=sys.stderr, flush=True)
        p = subprocess.Popen(lim.wrap([exe, *argv]))
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda n, _f: p.send_signal(n))
        rc = p.wait()
        line = oom_line(rc, lim.oom_kills(), limit_mib, lim.peak_mib()) or exit_line(rc)
        if line:
            print(line, file=sys.stderr, flush=True)
    return 128 - rc if rc < 0 else rc


def oom_line(rc: int, oom_kills: int | None, limit_mib: int, peak_mib: float | None = None) -> str | None:
    """The one line ``pybmoe serve --memory-limit-mb`` prints when the kernel's OOM killer took the
    server: ``rc`` is its exit status as :meth:`subprocess.Popen.wait` gives it (-9: SIGKILL),
    ``oom_kills`` the cgroup's count (:meth:`pybmoe.engine.memlimit.MemoryLimit.oom_kills`),
    ``limit_mib`` the limit in MiB, ``peak_mib`` the cgroup's peak use in MiB. None when it was not
    an OOM kill (or nothing says so)."""
    if not oom_kills or rc not in (-9, 137):
        return None
    peak = f", peak use {peak_mib:.0f} MiB" if peak_mib is not None else ""
    return (f"pybmoe serve: error: llama-server was killed by the kernel's OOM killer under the {limit_mib} MiB "
            f"memory limit{peak}; try --moe-stream-cache-mb auto (it sizes the experts' budget and the context "
            f"together), a smaller -c or -np, a smaller fixed budget, or a larger --memory-limit-mb "
            f"(docs/stream-tier.md, \"Serving under a memory limit\")")


#: llama-server's status when an expert's bytes could not be read: the model file changed on disk under it
#: (``LLAMA_MOE_EXIT_READ``, ggml-ext/llama-moe-source.h; EX_IOERR)
EXIT_READ = 74


def exit_line(rc: int) -> str | None:
    """The line ``pybmoe serve --memory-limit-mb`` prints when llama-server stopped because a model file
    changed on disk under it: status 74 (:data:`EXIT_READ`, a short read of the tier) or SIGBUS (``rc``
    -7 or 135, a mapped page past the file's new end). None for any other status."""
    if rc == EXIT_READ:
        how = "status 74: an expert's bytes could not be read"
    elif rc in (-signal.SIGBUS, 128 + signal.SIGBUS):
        how = "SIGBUS: a mapped page past the file's end"
    else:
        return None
    return (f"pybmoe serve: error: llama-server stopped: a model file changed on disk under it ({how}; the engine's "
            "line above names the file and the offset); restore the file and start the server again "
            "(docs/stream-tier.md, \"A model file that changes under a running server\")")


def serve_main(argv: list[str]) -> int:
    """``pybmoe serve [--memory-limit-mb N] ARGS...``: exec the patched llama-server (every upstream flag
    passes through), once every ``--rpc`` endpoint accepts connections (stock llama-server aborts with a
    backtrace when one does not yet: ``Failed to connect to host:port``). ``--memory-limit-mb N`` runs it
    inside a cgroup memory limit of N MiB instead (page cache included, as on a machine of that size;
    needs root; an error, exit 2, where one cannot be made), after dropping the model's cached pages
    (:func:`drop_model_cache`). A model file that is missing, empty, not GGUF or truncated is refused
    first, in one line (exit 2), before llama-server starts."""
    try:
        exe = engine.find_binary("llama-server")
        limit_mib, argv = memory_limit_arg(argv)
    except (engine.EngineError, ValueError) as e:
        print(f"pybmoe serve: error: {e}", file=sys.stderr)
        return 2
    if {"-h", "--help", "--usage"} & set(argv):
        print(serve_usage(), flush=True)  # then llama-server's own help, below it
    else:
        from . import paths  # here: the upstream names (llama-server, ...) import this module, and stay fast
        model = model_arg(argv)
        why = paths.model_error(Path(model)) if model is not None else None
        if why:  # one line here, instead of llama-server's 13-15 lines of log before its own
            print(f"pybmoe serve: error: {why}", file=sys.stderr)
            return 2
        try:
            timeout_s = float(os.environ.get("PYBMOE_RPC_WAIT_S", RPC_WAIT_S))
        except ValueError:
            timeout_s = RPC_WAIT_S
        why = wait_for_rpc(rpc_endpoints(argv), timeout_s) if timeout_s > 0 else None
        if why:
            print(f"pybmoe serve: error: {why}", file=sys.stderr)
            return 2
    if limit_mib is not None:
        return _serve_limited(str(exe), argv, limit_mib)
    os.execv(str(exe), [str(exe), *argv])
    return 0  # pragma: no cover


def bin_usage() -> str:
    """The text of ``pybmoe bin --help``: what it prints, and what each binary is."""
    from ..engine import binaries
    width = max(map(len, engine.BINARIES)) + 2
    names = "\n".join(f"  {n:<{width}}{binaries.BINARY_DOCS[n]}" for n in engine.BINARIES)
    return ("usage: pybmoe bin [NAME...]\n\n"
            "Print where the patched binaries are: one line per NAME (default: every one), the name, a tab and its\n"
            "path; exit 2 when one is not there (its line, on stderr, says where it was looked for).\n\n"
            f"NAME, one of:\n{names}\n\n"
            f"{' and '.join(binaries.TEST_BINARIES)} are test programs: pip install . ships them for the test suite,\n"
            "which finds them here; they are not tools to run by hand.\n"
            "searched, in order: $PYBMOE_BIN_DIR, the installed package's pybmoe/bin, the checkout's build/dev/bin")


def bin_main(argv: list[str]) -> int:
    """``pybmoe bin [NAME...]``: where the patched binaries are. Returns 0, or 2 when one is missing
    or a NAME is not one of :data:`pybmoe.engine.BINARIES` (one line on stderr each); ``--help``
    prints :func:`bin_usage` and returns 0."""
    if {"-h", "--help"} & set(argv):
        print(bin_usage())
        return 0
    names = argv or list(engine.BINARIES)
    rc = 0
    for n in names:
        if n not in engine.BINARIES:
            print(f"pybmoe bin: error: {n!r} is not one of pybmoe's binaries; accepted: {', '.join(engine.BINARIES)}",
                  file=sys.stderr)
            rc = 2
            continue
        try:
            print(f"{n}\t{engine.find_binary(n)}")
        except engine.EngineError as e:
            print(f"{n}\t(missing: {e})", file=sys.stderr)
            rc = 2
    return rc


def _exec(name: str, args: list[str] | None = None) -> None:
    """Exec the patched binary ``name`` with ``args`` (default: this process's arguments); exits 127
    with one line when it is not installed."""
    args = sys.argv[1:] if args is None else args
    try:
        exe = engine.find_binary(name)
    except engine.EngineError as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(127)
    if os.name == "nt":  # pragma: no cover
        sys.exit(subprocess.call([str(exe), *args]))
    os.execv(str(exe), [name, *args])  # argv[0] is the upstream name, as in usage lines


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
