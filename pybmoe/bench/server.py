"""The disk tier as ``llama-server`` runs it: request-level figures at the server's own defaults,
under a memory limit (``pybmoe bench-stream --server``;
``docs/benchmarks/server-sweep-2026-12-06/README.md``).

One point, ``server``: ``llama-server -m MODEL --moe-stream-cache-mb auto`` and nothing else of the
tier (its own context: the model's trained context, 4 slots sharing one KV cache, fitted beside the
experts' budget before it is allocated), plus ``--metrics`` (read-only counters) and, for routing that
is not the model's own, ``--moe-route-replay``. It starts from a cold page cache under the limit
(:class:`pybmoe.engine.memlimit.MemoryLimit`), and then:

- ``clients=1``: ``n_requests`` greedy ``/completion`` requests, streamed, one after the other, each a
  prompt of ``n_prompt`` token ids and ``n_gen`` generated tokens: ``decode_ts`` is the median of the
  server's own decode tok/s per request (``timings.predicted_per_second``: decode only, prefill
  apart), ``ttft_s`` the median time to the first streamed token;
- ``clients=N``: the same requests sent at once from N threads: ``decode_ts`` is the aggregate over
  the decode phase, as one client's is (all generated tokens over the longest request's own decode
  time, ``timings.predicted_ms``: the requests decode together, in steps of one token each, after
  their prompts), and ``wall_ts`` all generated tokens over the wall time from the first send to the
  last answer (prefill included; for one client, the same over its requests in turn); each answer is
  compared with its ``clients=1`` answer (:func:`pybmoe.bench.load.compare`: identical, or a
  divergence at a near tie); with ``--moe-route-replay`` the answers are not compared (NaN): each slot
  replays its own stream of the trace (the trace cut into the server's ``-np`` streams, so concurrent
  clients have independent routing, as real users do), from where that slot's last request left it, so
  a request gets other experts than it got alone. ``client_decode_min_ts`` is the worst request's own
  decode tok/s, ``ttft_s`` and ``ttft_max_s`` the median and the worst time to the first token.

Every run records the context the server ran with (``n_ctx_slot``, ``n_slots``: the fit's line
``fit_line``), the budget it served with and the cache cycle (``budget_mb`` as set at load,
``serving_budget_mb`` from ``/metrics`` while it served, ``cycle_mb``), the hit
rate (``/metrics``), its time to healthy (``startup_s``), the 1-minute load average as its requests
began (``load_1m``, :mod:`pybmoe.bench.noise`), the cgroup's peak and its OOM kills. A
server that does not start records ``status`` (``refused``: exited with its reason in the log;
``oom``: killed by the OOM killer) instead of figures.

Errors: :class:`ValueError` for bad arguments; :class:`pybmoe.engine.EngineError` when
``llama-server`` cannot be found.
"""
from __future__ import annotations

import math
import os
import random
import re
import signal
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .. import engine
from ..engine import memlimit
from . import load, noise

#: The tier's flags of the ``server`` point: the defaults, nothing else.
DEFAULTS = ("--moe-stream-cache-mb", "auto")


def prompts(n: int, n_prompt: int, seed: int = 0) -> list[tuple[int, ...]]:
    """``n`` prompts of ``n_prompt`` token ids each, drawn from ids 1000 .. 30000 (plain words of the
    pinned Qwen2 vocab) with ``seed``: the same prompts for every point and repeat."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(1000, 30000) for _ in range(n_prompt)) for _ in range(n)]


def parse_log(log: str) -> dict:
    """From a server's log: ``n_ctx_slot``, ``n_slots``, ``kv_unified`` (its slots line), ``fit_line``
    (the disk tier's fit), ``cycle_mb`` (the preamble) and ``budget_mb`` (the last budget it set);
    NaN or "" for what is not there."""
    out: dict = dict(n_ctx_slot=math.nan, n_slots=math.nan, kv_unified="", fit_line="", cycle_mb=math.nan,
                     budget_mb=math.nan)
    m = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'", log)
    if m:
        out.update(n_slots=int(m.group(1)), n_ctx_slot=int(m.group(2)), kv_unified=m.group(3))
    fit = [ln for ln in log.splitlines() if "-> fit:" in ln]
    if fit:
        out["fit_line"] = fit[-1].split("-> fit:", 1)[1].strip()
    m = re.search(r"cache_cycle_mb=([\d.]+)", log)
    if m:
        out["cycle_mb"] = float(m.group(1))
    # the budget the server serves with: the last one set before it listens (at shutdown the contexts go
    # and an auto budget grows back); /metrics gives it while it runs (run_server_point)
    log = re.split(r"llama_server: listening on|server is listening", log, maxsplit=1)[0]
    m = re.search(r"budget_mb=([\d.]+)", log)
    if m:
        out["budget_mb"] = float(m.group(1))
    for m in re.finditer(r"budget (\d+) MiB now|-> budget ([\d.]+) MiB \(\d+ experts\)", log):
        out["budget_mb"] = float(m.group(1) or m.group(2))
    return out


def metrics(url: str) -> dict[str, float]:
    """The server's ``/metrics`` samples (name -> value), ``{}`` when it does not answer."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name.split("{")[0]] = float(value)
            except ValueError:
                pass
    return out


def _hit_pct(before: dict, after: dict) -> float:
    h = after.get("llamacpp:moe_stream_hits_total", 0) - before.get("llamacpp:moe_stream_hits_total", 0)
    m = after.get("llamacpp:moe_stream_misses_total", 0) - before.get("llamacpp:moe_stream_misses_total", 0)
    return 100.0 * h / (h + m) if h + m > 0 else math.nan


def server_command(model: Path, port: int, *, threads: int, route_replay: Path | None,
                   extra: Sequence[str] = (), tier: Sequence[str] = DEFAULTS) -> list[str]:
    """The ``server`` point's command line (module doc); ``tier``: the tier's flags (the defaults)."""
    cmd = [str(engine.find_binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "--metrics", *tier]
    if route_replay is not None:
        cmd += ["--moe-route-replay", str(route_replay)]
    return cmd + list(extra)


class ServerExited(RuntimeError):
    """The server exited before it was healthy: ``status`` is ``oom`` (the cgroup's OOM killer) or
    ``refused``; ``log_tail`` its log's last lines, ``exit_code`` its status, ``oom_kills`` the cgroup's
    count since the start."""

    def __init__(self, status: str, log_tail: str, exit_code: int | None = None, oom_kills: int = 0):
        super().__init__(f"llama-server {status}: {log_tail}")
        self.status, self.log_tail, self.exit_code, self.oom_kills = status, log_tail, exit_code, oom_kills


@dataclass
class Running:
    url: str
    proc: subprocess.Popen
    log_path: Path
    startup_s: float


@contextmanager
def running_server(model: Path, *, limit: memlimit.MemoryLimit | None, log_path: Path, extra: Sequence[str] = (),
                   tier: Sequence[str] = DEFAULTS, route_replay: Path | None = None, threads: int = 2,
                   cold: bool = True, startup_timeout_s: float = 900) -> Iterator[Running]:
    """``llama-server`` (:func:`server_command`) started under ``limit`` (from a cold page cache with
    ``cold``), healthy; stopped with SIGINT on exit (its summary line is in the log). Raises
    :class:`ServerExited` when it exits first, :class:`pybmoe.engine.EngineError` when it is not healthy
    after ``startup_timeout_s``."""
    if cold:
        memlimit.drop_caches()
    if limit is not None:
        limit.reset_peak()
    kills0 = (limit.oom_kills() or 0) if limit is not None else 0
    port = engine.free_port()
    cmd = server_command(model, port, threads=threads, route_replay=route_replay, extra=extra, tier=tier)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(limit.wrap(cmd) if limit is not None else cmd, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                kills = ((limit.oom_kills() or 0) - kills0) if limit is not None else 0
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
                raise ServerExited("oom" if kills else "refused", tail, proc.returncode, kills)
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > startup_timeout_s:
                raise engine.EngineError(f"llama-server not healthy after {startup_timeout_s:.0f} s: {log_path}")
            time.sleep(0.2)
        yield Running(url, proc, log_path, time.monotonic() - t0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_server_point(model: str | os.PathLike, *, limit: memlimit.MemoryLimit | None, cold: bool, log_path: Path,
                     n_prompt: int = 64, n_gen: int = 32, n_requests: int = 4, clients: Sequence[int] = (1, 4),
                     threads: int = 2, route_replay: str | os.PathLike | None = None, extra: Sequence[str] = (),
                     tier: Sequence[str] = DEFAULTS, startup_timeout_s: float = 600,
                     request_timeout_s: float = 900) -> list[dict]:
    """One server's life (module doc): one row per entry of ``clients`` (the first must be 1), or one
    row with ``status`` ``refused``/``oom`` when it did not start. ``extra``: more llama-server flags
    (``-np 8``, ``-c N``); ``tier``: the tier's flags instead of the defaults. Raises
    :class:`ValueError` for bad arguments."""
    if not clients or clients[0] != 1 or any(c < 1 for c in clients):
        raise ValueError(f"clients {list(clients)}; accepted: 1 first, then any counts >= 1")
    for name, v in (("n_prompt", n_prompt), ("n_gen", n_gen), ("n_requests", n_requests), ("threads", threads)):
        if v < 1:
            raise ValueError(f"{name} {v}; accepted: >= 1")
    model = Path(model)
    rp = Path(route_replay) if route_replay is not None else None
    base = dict(point="server", limit_mib=limit.limit_mib if limit is not None else None)
    kills0 = limit.oom_kills() if limit is not None else None
    rows: list[dict] = []
    try:
        with running_server(model, limit=limit, log_path=log_path, extra=extra, tier=tier, route_replay=rp,
                            threads=threads, cold=cold, startup_timeout_s=startup_timeout_s) as srv:
            rows = _serve_clients(srv.url, rp, base, srv.startup_s, clients, n_prompt=n_prompt, n_gen=n_gen,
                                  n_requests=n_requests, request_timeout_s=request_timeout_s)
    except ServerExited as e:
        info = parse_log(log_path.read_text(errors="replace"))
        return [dict(base, **info, status=e.status, exit_code=e.exit_code, oom_kills=e.oom_kills, startup_s=math.nan)]
    info = parse_log(log_path.read_text(errors="replace"))
    kills = (limit.oom_kills() or 0) - (kills0 or 0) if limit is not None else 0
    peak = limit.peak_mib() if limit is not None else math.nan
    for r in rows:
        r.update(info, oom_kills=kills, peak_mib=peak, exit_code=srv.proc.returncode)
    return rows


def _serve_clients(url: str, rp: Path | None, base: dict, startup_s: float, clients: Sequence[int], *, n_prompt: int,
                   n_gen: int, n_requests: int, request_timeout_s: float) -> list[dict]:
    """The requests of :func:`run_server_point` on a healthy server: one row per entry of ``clients``."""
    rows: list[dict] = []
    reqs = [load.Request(f"p{i}", "completion", True, p, n_gen) for i, p in enumerate(prompts(n_requests, n_prompt))]
    ref: list[load.Answer] = []
    for n_clients in clients:
        before = metrics(url)
        load_1m = noise.load_average()
        t1 = time.monotonic()
        if n_clients == 1:
            answers = [load.send(url, r, timeout_s=request_timeout_s) for r in reqs]
            ref = answers
        else:
            answers = [None] * len(reqs)
            errors: list[str] = []

            def client(k: int) -> None:
                for i in range(k, len(reqs), n_clients):
                    try:
                        answers[i] = load.send(url, reqs[i], timeout_s=request_timeout_s)
                    except load.LoadError as e:
                        errors.append(str(e))
            threads_ = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
            for t in threads_:
                t.start()
            for t in threads_:
                t.join()
            if errors:
                raise load.LoadError("; ".join(errors))
        wall = time.monotonic() - t1
        after = metrics(url)
        # under route replay a request's experts come from its slot's stream, wherever that slot's earlier
        # requests left it: its answers are not comparable, only its timings are
        comparable = n_clients > 1 and rp is None
        verdicts = [load.compare(a, b)[0] for a, b in zip(ref, answers)] if comparable else []
        n_tok = sum(a.predicted_n for a in answers)
        budget = after.get("llamacpp:moe_stream_budget_bytes", math.nan) / 2**20
        rows.append(dict(base, clients=n_clients, status="ok", startup_s=startup_s, wall_s=wall, load_1m=load_1m,
                         serving_budget_mb=budget,
                         n_requests=len(reqs), n_prompt=n_prompt, n_gen=n_gen, tokens=n_tok,
                         decode_ts=float(np.median([a.decode_ts for a in answers])) if n_clients == 1
                         else n_tok / max(a.predicted_n / a.decode_ts for a in answers),
                         wall_ts=n_tok / wall,
                         client_decode_min_ts=float(min(a.decode_ts for a in answers)),
                         ttft_s=float(np.median([a.first_s for a in answers])),
                         ttft_max_s=float(max(a.first_s for a in answers)),
                         hit_pct=_hit_pct(before, after),
                         identical=sum(v == "identical" for v in verdicts) if comparable else math.nan,
                         near_tie=sum(v == "near_tie" for v in verdicts) if comparable else math.nan,
                         wrong=sum(v == "wrong" for v in verdicts) if comparable else math.nan))
    return rows
