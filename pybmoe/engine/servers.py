"""Lifecycle of the engine's processes: a loopback ``ggml-rpc-server`` (:class:`RpcServer`, the
stand-in device) and a ``llama-server`` (:class:`LlamaServer`) on free loopback ports.

Everything here raises :class:`~pybmoe.engine.binaries.EngineError` with a message that names the
binary, the command line or the log that explains the failure.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .binaries import EngineError, find_binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (as ``--rpc`` takes it) into ``(host, port)``.

    Raises:
        ValueError: not ``host:port`` with a numeric port.
    """
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"rpc server {endpoint!r} must be host:port")
    return host.strip("[]"), int(port)


def wait_for_endpoint(endpoint: str, timeout_s: float) -> bool:
    """Waits until something accepts TCP connections at ``host:port`` (a ``ggml-rpc-server``
    that is still starting); True when it does within ``timeout_s`` seconds.

    The probe connects and closes at once; a ``ggml-rpc-server`` logs it as one more
    ``Accepted client connection`` / ``Client connection closed`` pair and serves the next client.

    Raises:
        ValueError: a malformed endpoint.
    """
    host, port = split_endpoint(endpoint)
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return True
        if time.monotonic() - t0 >= timeout_s:
            return False
        time.sleep(0.1)


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float, what: str, log: Path) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise EngineError(f"{what} exited with code {proc.returncode} before listening; log:\n{_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise EngineError(f"{what} did not listen on port {port} within {timeout_s:.0f} s; log:\n{_tail(log)}")


def _tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # llama-server frees its contexts (and prints the cache summary)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RpcServer:
    """A loopback ``ggml-rpc-server``: the stand-in device on machines without a GPU.

    It computes with the same CPU kernels as the host, so cache-on output must be
    bit-identical to cache-off. Use as a context manager; ``.endpoint`` is ``host:port``.
    """

    def __init__(self, threads: int | None = None, port: int | None = None, log_dir: Path | None = None):
        self.port = port or free_port()
        self.threads = threads
        self._log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pybmoe-rpc-"))
        self.log = self._log_dir / f"rpc-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "RpcServer":
        cmd = [str(find_binary("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(self.port)]
        if self.threads:
            cmd += ["-t", str(self.threads)]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _wait_port(self.port, self.proc, 30, "ggml-rpc-server", self.log)
        return self

    def stop(self) -> None:
        if self.proc:
            _stop(self.proc, 10)

    def __enter__(self) -> "RpcServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class LlamaServer:
    """A ``llama-server`` child process on a free loopback port.

    ``args`` are passed through verbatim (every upstream flag works). The log
    (stdout + stderr) is kept in ``.log``; :meth:`stop` sends SIGINT so the
    server frees its contexts and prints the ``moe-cache:`` summary line.
    """

    args: list[str]
    port: int = field(default_factory=free_port)
    log_dir: Path | None = None
    startup_timeout_s: float = 120
    env: dict | None = None
    proc: subprocess.Popen | None = None

    def __post_init__(self):
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="pybmoe-server-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.log_dir / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LlamaServer":
        cmd = [str(find_binary("llama-server")), "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        env = dict(os.environ, **(self.env or {}))
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise EngineError(f"llama-server exited with code {self.proc.returncode}: {' '.join(cmd)}\n"
                                  f"{_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > self.startup_timeout_s:
                self.stop()
                raise EngineError(f"llama-server not healthy after {self.startup_timeout_s:.0f} s\n{_tail(self.log)}")
            time.sleep(0.1)

    def get(self, path: str, timeout_s: float = 30) -> str:
        """The body of ``GET path`` (``/metrics``, ``/props``, ...) as text.

        Raises:
            urllib.error.URLError: the server refused or did not answer in ``timeout_s`` seconds.
        """
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return r.read().decode()

    def post(self, path: str, body: dict, timeout_s: float = 300) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EngineError(f"POST {path} -> {e.code}: {e.read()[:2000]!r}") from e
        except (urllib.error.URLError, OSError) as e:  # the server died or hung
            raise EngineError(f"POST {path} failed: {e}\n{_tail(self.log)}") from e

    def completion(self, prompt: str, n_predict: int = 64, timeout_s: float = 300, **kw) -> dict:
        """Greedy ``/completion`` (temperature 0) unless ``kw`` (more body fields) says otherwise;
        ``timeout_s`` seconds for the answer."""
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1, "seed": 0,
                "cache_prompt": False, **kw}
        return self.post("/completion", body, timeout_s=timeout_s)

    def stop(self) -> str:
        """Stop the server; returns its whole log."""
        if self.proc:
            _stop(self.proc)
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
