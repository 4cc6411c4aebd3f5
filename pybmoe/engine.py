"""Locate and run the patched llama.cpp binaries; lifecycle of rpc-server and server.

Binaries are looked up, in order, in:

1. ``$PYBMOE_BIN_DIR``;
2. ``pybmoe/bin/`` next to this module (what ``pip install .`` ships);
3. ``pybmoe/bin/`` in the environment's site-packages (when this module is imported from a
   source checkout but pybmoe is installed);
4. ``build/dev/bin/`` of a source checkout (a developer build made with cmake).

Everything here raises :class:`EngineError` (or a subclass) with a message that
names the binary, the command line or the log that explains the failure.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("llama-server", "llama-cli", "llama-bench", "test-backend-ops", "ggml-rpc-server", "pybmoe-logits",
            "pybmoe-test-skip")


class EngineError(RuntimeError):
    """A binary is missing, failed to start, or exited with an error."""


def bin_dirs() -> list[Path]:
    """Where binaries are searched, in order."""
    dirs = []
    if os.environ.get("PYBMOE_BIN_DIR"):
        dirs.append(Path(os.environ["PYBMOE_BIN_DIR"]))
    here = Path(__file__).resolve().parent
    dirs.append(here / "bin")
    site = Path(sysconfig.get_paths()["platlib"]) / "pybmoe" / "bin"
    if site not in dirs:
        dirs.append(site)
    dirs.append(here.parent / "build" / "dev" / "bin")
    return dirs


def find_binary(name: str) -> Path:
    """Path of the patched binary ``name`` (one of :data:`BINARIES`).

    Raises:
        EngineError: no such binary in any of :func:`bin_dirs`.
    """
    for d in bin_dirs():
        p = d / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise EngineError(f"{name} not found in {', '.join(map(str, bin_dirs()))}; "
                      "install pybmoe with `pip install .` (or build it with cmake into build/dev)")


def _exec(name: str) -> None:
    try:
        exe = find_binary(name)
    except EngineError as e:
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# --- log lines -------------------------------------------------------------------------------

_SUMMARY = re.compile(r"moe-cache: ([0-9.]+)% hit, resident ([0-9.]+) MiB, uploads (\d+) \(([0-9.]+) MiB\)"
                      r"(?:, layer_demand ([0-9.]+) MiB, token_demand ([0-9.]+) MiB, steps (\d+))?")
_PREAMBLE = re.compile(r"moe-cache-preamble: (.*)$", re.M)
_CLIFF = re.compile(r"moe-cache: WARNING (\d+) slots/layer is below the per-layer token cycle")


@dataclass(frozen=True)
class CacheSummary:
    """The ``moe-cache:`` line printed when a context is freed."""

    hit_pct: float        # hits / lookups, percent
    resident_mib: float   # MiB of experts resident in slots
    uploads: int          # experts uploaded
    upload_mib: float     # MiB uploaded
    layer_demand_mib: float | None = None  # expert MiB one served step asks of the widest layer
    token_demand_mib: float | None = None  # expert MiB one served step asks of all cached layers
    steps: int | None = None               # graphs the cache served


def parse_cache_summaries(log: str) -> list[CacheSummary]:
    """Every summary line in a log, in order (one per freed context)."""
    out = []
    for m in _SUMMARY.finditer(log):
        a, b, c, d, e, f, g = m.groups()
        out.append(CacheSummary(float(a), float(b), int(c), float(d), float(e) if e else None,
                                float(f) if f else None, int(g) if g else None))
    return out


def parse_cache_preamble(log: str) -> dict | None:
    """The ``moe-cache-preamble:`` line printed at load, as a dict (None when absent).

    Keys: layers, n_expert, top_k, slots, staging, inserts (counts), max_batch (tokens: the largest
    ubatch the cache serves), slot_mib (MiB per expert),
    budget_mib ({buffer type: MiB}), cache_cycle_mb (MiB one token needs in the worst case),
    layer_cycle_slots (slots one layer needs to keep one token's experts).
    """
    m = _PREAMBLE.search(log)
    if not m:
        return None
    rec: dict = {}
    for kv in m.group(1).split():
        k, _, v = kv.partition("=")
        if k == "budget_mib":
            rec[k] = {b.rpartition(":")[0]: float(b.rpartition(":")[2]) for b in v.split(",") if b}
        else:
            rec[k] = float(v) if "." in v else int(v)
    return rec


_METRIC = re.compile(r'^llamacpp:moe_cache_(\w+?)(?:\{device="([^"]*)"\})?\s+(\S+)$', re.M)


def parse_cache_metrics(text: str) -> dict | None:
    """The expert cache's series of a ``llama-server --metrics`` page (``/metrics``, Prometheus
    text) as a dict, or None when it has none (cache off, or another server).

    Keys: ``hits``, ``misses``, ``uploads`` (counts), ``upload_bytes``, ``resident_bytes`` (bytes),
    ``slots`` and ``allocated_bytes`` (``{device: value}``, slots summed over the device's layers).
    """
    out: dict = {}
    for name, dev, value in _METRIC.findall(text):
        name = name.removesuffix("_total")
        v = float(value)
        v = int(v) if v.is_integer() else v
        if dev:
            out.setdefault(name, {})[dev] = v
        else:
            out[name] = v
    return out or None


def cache_record(log: str, metrics: str | None = None) -> dict:
    """One tidy record of a run's cache lines (preamble, last summary, cliff warning), usable as a
    pandas row: ``pd.DataFrame([cache_record(log)])``. Budgets are summed over devices into
    ``budget_mib``; absent values are None.

    ``metrics``: a ``/metrics`` page of the same server (:func:`parse_cache_metrics`); its counters
    are added as ``metrics_hits``, ``metrics_misses``, ``metrics_uploads``,
    ``metrics_upload_mib``, ``metrics_resident_mib`` (MiB) and ``metrics_slots`` (summed over
    devices): the live values at the time of the scrape, where the summary is the value when the
    context was freed."""
    pre = parse_cache_preamble(log) or {}
    sums = parse_cache_summaries(log)
    last = sums[-1] if sums else None
    rec = {k: pre.get(k) for k in ("layers", "n_expert", "top_k", "slots", "staging", "inserts", "max_batch",
                                    "slot_mib", "cache_cycle_mb", "layer_cycle_slots")}
    rec["budget_mib"] = sum(pre["budget_mib"].values()) if pre.get("budget_mib") else None
    for f in ("hit_pct", "resident_mib", "uploads", "upload_mib", "layer_demand_mib", "token_demand_mib", "steps"):
        rec[f] = getattr(last, f) if last else None
    rec["below_cycle"] = bool(_CLIFF.search(log))
    if metrics is not None:
        m = parse_cache_metrics(metrics) or {}
        for k in ("hits", "misses", "uploads"):
            rec[f"metrics_{k}"] = m.get(k)
        for k in ("upload", "resident"):
            b = m.get(f"{k}_bytes")
            rec[f"metrics_{k}_mib"] = b / 2**20 if b is not None else None
        rec["metrics_slots"] = sum(m["slots"].values()) if m.get("slots") else None
    return rec


@dataclass
class LogitsRun:
    """One ``pybmoe-logits`` run: greedy ``tokens``, the raw ``logits`` (n_vocab float32 per decode
    step, native byte order), the cache's per-layer ``layers`` (il -> (hits, misses)) and the
    ``log`` (stdout + stderr)."""

    tokens: list[int]
    logits: bytes
    layers: dict[int, tuple[int, int]]
    log: str


def run_logits(model: str | os.PathLike, out: str | os.PathLike, args: list[str], *, prompt: str = "Hello there",
               n_predict: int = 8, ctx: int = 256, timeout: float = 300, bin_dir: str | os.PathLike | None = None,
               env: dict[str, str] | None = None) -> LogitsRun:
    """Run ``pybmoe-logits`` on ``model`` (2 threads, ``--fit off``) with the extra llama.cpp ``args``
    (layout, cache flags, ``-ub`` ...), writing the logits to ``out``; ``bin_dir`` picks another build
    (e.g. a Vulkan one). Raises :class:`EngineError` (with the command and the log's tail) on a
    non-zero exit."""
    exe = Path(bin_dir) / "pybmoe-logits" if bin_dir is not None else find_binary("pybmoe-logits")
    cmd = [str(exe), "--logits-out", str(out), "-m", str(model), "-p", prompt, "-n", str(n_predict),
           "-c", str(ctx), "-t", "2", "--fit", "off", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise EngineError(f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stderr[-3000:]}")
    tokens, layers = [], {}
    for line in r.stdout.splitlines():
        if line.startswith("token "):
            tokens.append(int(line.split()[1]))
        elif line.startswith("moe-cache-layer "):
            _, il, h, m = line.split()
            layers[int(il)] = (int(h), int(m))
    return LogitsRun(tokens, Path(out).read_bytes(), layers, r.stdout + r.stderr)


def cache_args(slots: int, inserts: int = 0) -> list[str]:
    """Engine flags for a cache of ``slots`` slots per layer and ``inserts`` uploads per layer per step.

    Raises:
        ValueError: a negative or non-integer value.
    """
    for name, v in (("slots", slots), ("inserts", inserts)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return ["--moe-expert-cache", str(slots), "--moe-expert-cache-inserts", str(inserts)]


def host_experts_args(rpc_endpoint: str) -> list[str]:
    """Flags that put every layer on the RPC device and keep the experts in host memory.

    ``--no-repack`` keeps host experts in the GGUF layout, so host and device run the same
    CPU kernels and the split is bit-exact.
    """
    return ["--rpc", rpc_endpoint, "-ngl", "99", "--cpu-moe", "--no-repack"]
