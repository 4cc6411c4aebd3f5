"""``pybmoe sweep``: benchmark sweeps of the expert cache with the patched ``llama-bench`` or
``llama-server``.

A sweep runs every point of a grid (slots per layer, insert cap, largest cached ubatch, ubatch,
speculation, threads, backend) once per repeat, with the cache off (``slots = 0``) interleaved with every cache-on point
of the same configuration, and the order of the slot counts reversed on every other repeat so that
slow drift of the machine falls on both sides. Two runners:

- ``bench`` (default): ``llama-bench``, prompt processing and token generation as **separate**
  runs (``-p N -n 0`` and ``-p 0 -n N``, so prefill never leaks into a decode figure). Each run is
  its own ``llama-bench`` process (``-r 1 -v``): a fresh model, so the cache's counters in its
  ``moe-cache:`` summary line (printed when the context is freed, covering llama-bench's warm-up
  and the measured run) belong to that run alone. ``llama-bench`` has no speculative decoding, so
  the speculation axis is ``off`` only.
- ``server``: request-level figures. Each run starts one ``llama-server`` (``-np 1``), sends the
  requests of a traffic file one after another (greedy ``/completion``, ``cache_prompt`` off so
  every request prefills its whole prompt; the bundled ``pybmoe/data/traffic.json``: a short
  question, a document to summarise, code to rewrite, a question over a context, a JSON
  extraction and a multi-turn chat), and stops it. The server's own per-request ``timings`` give
  the two rows of the run: ``pp`` = prompt tokens / prompt time and ``tg`` = generated tokens /
  generation time, each summed over the requests, so prefill and decode stay apart here too. The
  speculation axis (``--spec off,ngram-simple,...``, upstream's ``--spec-type`` names) applies,
  and the rows carry the drafted and accepted tokens. The cache counters cover the whole run
  (both phases), so both rows of a run carry the same ones. ``text_sha1`` hashes the generated
  texts: greedy output must not depend on the cache, so it is one value per speculation setting.

Backends:

- ``rpc``: a loopback ``ggml-rpc-server`` started by the sweep stands in for the device
  (``--rpc EP -ngl 99 -ncmoe 99 --repack 0``). It is the same CPU behind a socket, so the cache
  is **not** expected to be faster there; the sweep measures its overhead and checks its hit
  rate and uploads.
- ``gpu``: the local accelerator (``-ngl 99 -ncmoe 99 --repack 0``), experts in host memory.
- ``auto``: ``gpu`` when ``llama-bench --list-devices`` lists a device, else ``rpc``.

``--repack 0`` keeps the host experts in the GGUF layout: the cache's host chain needs the
plain CPU ``mul_mat_id`` (the one that honours the skip table).

Outputs, in the output folder:

- ``sweep.csv``: one row per run and mode. llama-bench's own CSV columns (``n_prompt``, ``n_gen``,
  ``n_threads``, ``n_ubatch``, ``avg_ts`` tok/s, ``avg_ns``, ...; the server runner fills the same
  names: ``n_prompt`` / ``n_gen`` are the run's prompt / generated tokens, ``avg_ns`` the phase's
  time, plus ``n_requests``, ``draft_n``, ``draft_accepted`` tokens and ``text_sha1``) plus
  ``mode`` (``pp`` | ``tg``), ``repeat`` (0-based), ``runner``, ``backend``, ``spec`` (``off`` or a
  ``--spec-type``), ``slots`` (requested slots per layer, 0 = off), ``max_batch`` (the
  ``--moe-expert-cache-max-batch`` asked for, tokens; 0 = the engine's default),
  ``inserts`` (uploads per layer per step, 0 = unlimited), the cache columns of
  :func:`pybmoe.engine.cache_record` (``hit_pct`` percent, ``resident_mib`` MiB, ``uploads``
  experts, ``upload_mib`` MiB, ``steps`` graphs served, ``budget_mib`` MiB, ``slot_mib`` MiB,
  ``below_cycle``), and ``overflow`` / ``overflow_reason`` (see below). ``hit_pct`` is NaN when
  the cache is off; ``pp`` rows have lookups only when the ubatch is within ``max_batch``
  (larger prompt batches use the stock graph; llama-bench's default is 1 token).
- ``sweep-summary.csv``: per point and mode, ``n`` runs, ``median_ts`` / ``min_ts`` /
  ``max_ts`` tok/s, ``baseline_ts`` (median of the cache-off runs of the same runner, backend,
  speculation, threads, ubatch and mode), ``ratio`` = ``median_ts / baseline_ts``, ``median_hit_pct``,
  ``median_resident_mib``, ``median_uploads`` and ``overflow`` (any run overflowed); ``spread``
  (``max_ts / min_ts``), ``max_load_1m`` (the highest 1-minute load average a run started under: each
  run's ``load_1m``) and ``noisy`` (``spread`` over 1.5: :mod:`pybmoe.bench.noise`).
- ``sweep-pp.png``, ``sweep-tg.png``: tok/s (median, min–max bars) and hit % against slots,
  with the cache-off median drawn as a horizontal line (:func:`pybmoe.bench.plot.sweep_plot`).
- ``logs/``: each run's stderr, named after the run.

**Overflow.** A run whose configuration spills device memory is marked (``overflow = True``,
``avg_ts`` kept, or NaN when it failed) rather than reported as a slow point:
allocation errors in its log (``cudaMalloc failed``, ``failed to allocate``, ``out of
memory``, a backend ``falling back to`` another allocator), the cache's own refusals
(``moe-cache: cannot allocate ...``, ``N slots/layer need X MiB on DEV ... free``,
``auto resolved to 0 slots``, ``auto sizing left no
device``), or device buffers (model + KV + compute + cache, parsed from the load log) above the
free memory the device reported at load minus ``floor_mib``.

Errors: :class:`ValueError` for bad arguments (raised before anything runs), and
:class:`pybmoe.engine.EngineError` when ``llama-bench`` or ``llama-server`` fails without an
overflow explaining it.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from .. import engine
from . import noise

BACKENDS = ("auto", "rpc", "gpu")
MODES = ("pp", "tg")
RUNNERS = ("bench", "server")
#: ``--spec-type`` names of the pinned llama.cpp (``common/speculative.cpp``); ``off`` = none.
#: The draft-* types need a draft model (``-md`` in ``--server-args``) or, for draft-mtp, a model
#: with an MTP block.
SPEC_TYPES = ("off", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple",
              "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")
#: The bundled request mix of the server runner (see the module docstring).
TRAFFIC = Path(__file__).resolve().parent.parent / "data" / "traffic.json"
#: Columns added to llama-bench's own, in this order.
CACHE_COLUMNS = ("mode", "repeat", "runner", "backend", "spec", "slots", "inserts", "max_batch", "sync", "hit_pct",
                 "resident_mib",
                 "uploads", "upload_mib", "steps", "upload_wait_ms", "h2d", "waits", "upload_gbps",
                 "upload_wait_ms_per_step", "h2d_per_step", "budget_mib", "slot_mib", "below_cycle", "overflow",
                 "overflow_reason")
#: Point keys: one cache-off baseline per (runner, backend, spec, n_threads, n_ubatch, mode).
BASE_KEYS = ("runner", "backend", "spec", "n_threads", "n_ubatch", "mode")
POINT_KEYS = BASE_KEYS + ("slots", "inserts", "max_batch", "sync")

# Log lines that mean the configuration did not fit on the device (see the module docstring).
_OVERFLOW = re.compile(
    r"(cudaMalloc failed[^\n]*|failed to allocate[^\n]*|out of memory[^\n]*|ErrorOutOfDeviceMemory[^\n]*"
    r"|falling back to [^\n]*|moe-cache: cannot allocate[^\n]*|moe-cache: \d+ slots/layer need [^\n]*"
    r"|moe-cache: WARNING auto resolved to 0 slots[^\n]*"
    r"|moe-cache: WARNING auto sizing left no device[^\n]*)", re.I)
_DEV_FREE = re.compile(r"using device (\S+) \(.*?\).*? - (\d+) MiB free")
_BUF = re.compile(r"(?:load_tensors|llama_kv_cache|sched_reserve):\s+(\S+)\s+(?:model|KV|compute) buffer size =\s+"
                  r"([0-9.]+) MiB")


@dataclass(frozen=True)
class Point:
    """One configuration of the grid (a run per mode and repeat).

    ``slots``: slots per layer (0 = cache off); ``inserts``: uploads per layer per step
    (0 = unlimited); ``ubatch`` tokens; ``threads`` host threads; ``backend`` ``rpc`` | ``gpu``;
    ``spec`` ``off`` or a ``--spec-type`` (server runner only); ``max_batch`` the largest ubatch the
    cache serves (tokens, ``--moe-expert-cache-max-batch``; 0 = the engine's default); ``sync``
    deterministic upload visibility (``--moe-expert-cache-sync``: each step waits for the uploads
    of the one before) instead of the default (no step waits).
    """

    slots: int
    inserts: int
    ubatch: int
    threads: int
    backend: str
    spec: str = "off"
    max_batch: int = 0
    sync: bool = False


@dataclass
class SweepResult:
    """What :func:`sweep` wrote: the tidy frame, the summary frame and the file paths."""

    runs: pd.DataFrame
    summary: pd.DataFrame
    csv: Path
    summary_csv: Path
    plots: list[Path]


def _ints(name: str, values: Sequence[int], lo: int) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name}: {v!r} is not an integer >= {lo}; accepted: integers >= {lo}")
        out.append(int(v))
    if not out:
        raise ValueError(f"{name}: no value given; accepted: one or more integers >= {lo}")
    return list(dict.fromkeys(out))


def _specs(specs: Sequence[str]) -> list[str]:
    specs = list(dict.fromkeys(specs))
    if not specs:
        raise ValueError(f"spec: no value given; accepted: {', '.join(SPEC_TYPES)}")
    for sp in specs:
        if sp not in SPEC_TYPES:
            raise ValueError(f"spec {sp!r} is not a speculative decoding type; accepted: {', '.join(SPEC_TYPES)}")
    return specs


def grid(slots: Sequence[int], inserts: Sequence[int], ubatch: Sequence[int], threads: Sequence[int],
         backends: Sequence[str], specs: Sequence[str] = ("off",), max_batch: Sequence[int] = (0,),
         sync: Sequence[bool] = (False,)) -> list[Point]:
    """The points of a sweep. The cache-off point (``slots = 0``) appears once per backend,
    speculation, threads and ubatch, whatever the insert caps, cached batch sizes and upload modes,
    with ``inserts = 0``, ``max_batch = 0`` and ``sync = False``.

    Raises :class:`ValueError` for a negative slot count, insert cap or ``max_batch``, a ubatch or
    thread count below 1, an unknown backend or an unknown speculation type.
    """
    slots = _ints("slots", slots, 0)
    inserts = _ints("inserts", inserts, 0)
    ubatch = _ints("ubatch", ubatch, 1)
    threads = _ints("threads", threads, 1)
    specs = _specs(specs)
    max_batch = _ints("max_batch", max_batch, 0)
    sync = list(dict.fromkeys(sync))
    if not sync or any(not isinstance(v, bool) for v in sync):
        raise ValueError(f"sync {sync!r}: expected False (the default mode) and/or True (--moe-expert-cache-sync)")
    for b in backends:
        if b not in ("rpc", "gpu"):
            raise ValueError(f"backend {b!r} is not supported; accepted: rpc, gpu (or auto)")
    pts: list[Point] = []
    for b, sp, t, u, s in itertools.product(dict.fromkeys(backends), specs, threads, ubatch, slots):
        for i, mb, sy in ([(0, 0, False)] if s == 0 else itertools.product(inserts, max_batch, sync)):
            pts.append(Point(s, i, u, t, b, sp, mb, sy))
    return list(dict.fromkeys(pts))


def detect_backend() -> str:
    """``gpu`` when the patched ``llama-bench --list-devices`` lists a device, else ``rpc``."""
    exe = engine.find_binary("llama-bench")
    r = subprocess.run([str(exe), "--list-devices"], capture_output=True, text=True, timeout=120)
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines()]
    try:
        devs = lines[lines.index("Available devices:") + 1:]
    except ValueError:
        return "rpc"
    return "gpu" if any(d and d != "(none)" and ":" in d for d in devs) else "rpc"


def overflow_reason(log: str, floor_mib: float = 0.0) -> str | None:
    """Why a run's log says its configuration spilled device memory, or None.

    Checks, in order: allocation errors and the cache's refusals (the line itself is returned),
    then the device buffers (model + KV + compute + cache MiB, per device, from the load log)
    against the free MiB the device reported at load minus ``floor_mib``.
    """
    m = _OVERFLOW.search(log)
    if m:
        return m.group(1).strip()
    free = {name: float(mib) for name, mib in _DEV_FREE.findall(log)}
    if not free:
        return None
    used: dict[str, float] = {}
    compute: dict[str, float] = {}
    for line in log.splitlines():
        b = _BUF.search(line)
        if not b:
            continue
        buf, mib = b.group(1), float(b.group(2))
        dev = next((d for d in free if buf.startswith(d)), None)
        if dev is None:
            continue
        if "compute buffer" in line:
            compute[dev] = max(compute.get(dev, 0.0), mib)
        else:
            used[dev] = used.get(dev, 0.0) + mib
    pre = engine.parse_cache_preamble(log) or {}
    for buf, mib in (pre.get("budget_mib") or {}).items():
        dev = next((d for d in free if buf.startswith(d)), None)
        if dev is not None:
            used[dev] = used.get(dev, 0.0) + mib
    for dev, f in free.items():
        total = used.get(dev, 0.0) + compute.get(dev, 0.0)
        if total > f - floor_mib:
            return f"{dev}: buffers {total:.1f} MiB > {f:.0f} MiB free - {floor_mib:.0f} MiB floor"
    return None


def _backend_args(backend: str, rpc_endpoint: str | None) -> list[str]:
    args = ["-ngl", "99", "-ncmoe", "99", "--repack", "0"]
    if backend == "rpc":
        assert rpc_endpoint
        args = ["--rpc", rpc_endpoint, *args]
    return args


def bench_command(model: Path, point: Point, mode: str, *, n_prompt: int, n_gen: int,
                  rpc_endpoint: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The ``llama-bench`` command line of one run (one mode, one repetition, CSV on stdout)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; accepted: {', '.join(MODES)}")
    pn = ["-p", str(n_prompt), "-n", "0"] if mode == "pp" else ["-p", "0", "-n", str(n_gen)]
    return [str(engine.find_binary("llama-bench")), "-m", str(model), *pn, "-r", "1", "-o", "csv", "-v",
            "-t", str(point.threads), "-ub", str(point.ubatch),
            *_backend_args(point.backend, rpc_endpoint),
            *engine.cache_args(point.slots, point.inserts, sync=point.sync), *_max_batch_args(point), *extra_args]


def _max_batch_args(point: Point) -> list[str]:
    return ["--moe-expert-cache-max-batch", str(point.max_batch)] if point.slots and point.max_batch else []


def run_point(model: Path, point: Point, mode: str, *, n_prompt: int, n_gen: int, rpc_endpoint: str | None = None,
              extra_args: Sequence[str] = (), log_path: Path | None = None, floor_mib: float = 0.0,
              timeout_s: float = 1800) -> dict:
    """Run ``llama-bench`` once and return its row (a dict of :data:`CACHE_COLUMNS` less
    ``repeat``, plus llama-bench's columns).

    Raises :class:`pybmoe.engine.EngineError` when it fails and its log shows no overflow.
    """
    cmd = bench_command(model, point, mode, n_prompt=n_prompt, n_gen=n_gen, rpc_endpoint=rpc_endpoint,
                        extra_args=extra_args)
    load_1m = noise.load_average()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        out, log, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        log = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        log += f"\n(timed out after {timeout_s:.0f} s)"
        rc = 124
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(log)
    reason = overflow_reason(log, floor_mib)
    rows = []
    if rc == 0:
        text = "\n".join(ln for ln in out.splitlines() if ln.strip())
        rows = pd.read_csv(io.StringIO(text)).to_dict("records") if text else []
    if rc != 0 or len(rows) != 1:
        if reason is None:
            raise engine.EngineError(f"llama-bench exited with code {rc} ({len(rows)} result rows): {' '.join(cmd)}\n"
                                     f"{log[-4000:]}")
        rows = [{}]
    rec = engine.cache_record(log)
    row = dict(rows[0])
    row.update(mode=mode, runner="bench", load_1m=load_1m, **_cache_columns(point, rec, reason))
    row.setdefault("n_threads", point.threads)
    row.setdefault("n_ubatch", point.ubatch)
    row.setdefault("avg_ts", np.nan)
    return row


def _cache_columns(point: Point, rec: dict, reason: str | None) -> dict:
    """The point's and the cache's columns of a row (``rec``: :func:`pybmoe.engine.cache_record`)."""
    on = point.slots > 0
    per_step = lambda v: v / rec["steps"] if on and v is not None and rec.get("steps") else np.nan  # noqa: E731
    return dict(backend=point.backend, spec=point.spec, slots=point.slots, inserts=point.inserts,
                max_batch=point.max_batch, sync=point.sync,
                hit_pct=rec["hit_pct"] if on else np.nan, resident_mib=rec["resident_mib"] if on else 0.0,
                uploads=rec["uploads"] if on else 0, upload_mib=rec["upload_mib"] if on else 0.0,
                upload_wait_ms=rec.get("upload_wait_ms") if on else np.nan, h2d=rec.get("h2d") if on else np.nan,
                waits=rec.get("waits") if on else np.nan, upload_gbps=rec.get("upload_gbps") if on else np.nan,
                upload_wait_ms_per_step=per_step(rec.get("upload_wait_ms")), h2d_per_step=per_step(rec.get("h2d")),
                steps=rec["steps"], budget_mib=rec["budget_mib"], slot_mib=rec["slot_mib"],
                below_cycle=rec["below_cycle"], overflow=reason is not None, overflow_reason=reason or "")


class TrafficFormatError(ValueError):
    """A traffic file does not follow the format; the message names the file, the request and field, and what is accepted."""


#: Keys of one request of a traffic file.
TRAFFIC_KEYS = ("prompt", "n_predict", "name")
#: The most tokens one request may ask for (the engine's n_predict is a 32-bit integer).
MAX_PREDICT = 2**31 - 1


def load_traffic(path: str | os.PathLike | None = None, n_requests: int | None = None,
                 max_predict: int | None = None) -> list[dict]:
    """The requests of a traffic file: ``{"requests": [{"prompt": str, "n_predict": int, "name": str}, ...]}``
    (or the bare list), the bundled :data:`TRAFFIC` by default. ``n_predict`` defaults to 64 and
    ``name`` to ``request-I``; other keys of a request are refused (a misspelt key would otherwise
    be ignored), other keys beside ``requests`` are kept out of it. ``n_requests`` keeps the first
    N; ``max_predict`` caps each request's ``n_predict`` (tokens).

    Raises :class:`FileNotFoundError` (no file), :class:`TrafficFormatError` (a :class:`ValueError`:
    not UTF-8 JSON of that shape, an empty prompt, ``n_predict`` not an integer in 1 .. 2^31 - 1,
    a name that is not a string, an unknown key; the message names the file, the request and the
    field) or :class:`ValueError` (``n_requests`` / ``max_predict`` < 1).
    """
    path = Path(path) if path is not None else TRAFFIC
    if not path.is_file():
        raise FileNotFoundError(f"traffic file {path} not found; accepted: a JSON file of requests")
    shape = '{"requests": [{"prompt": "...", "n_predict": N, "name": "..."}, ...]} or that list'
    data = path.read_bytes()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TrafficFormatError(f"traffic file {path}:{line}: byte "
                                 f"0x{data[e.start]:02x} is not UTF-8 text; accepted: UTF-8 JSON, {shape}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TrafficFormatError(f"traffic file {path}:{e.lineno}: not JSON ({e.msg} at column {e.colno}); "
                                 f"accepted: {shape}") from None
    except RecursionError:
        raise TrafficFormatError(f"traffic file {path}: not JSON (nested too deeply to read); accepted: {shape}") from None
    reqs = data.get("requests") if isinstance(data, dict) else data
    if not isinstance(reqs, list) or not reqs:
        raise TrafficFormatError(f"traffic file {path}: no requests; accepted: {{\"requests\": [{{\"prompt\": ..., "
                                 f"\"n_predict\": N}}, ...]}} or that list")
    for name, v in (("n_requests", n_requests), ("max_predict", max_predict)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
    out = []
    for i, r in enumerate(reqs[:n_requests] if n_requests else reqs):
        if not isinstance(r, dict):
            raise TrafficFormatError(f"traffic file {path}: request {i} is {type(r).__name__} {r!r:.60}; accepted: an "
                                     '{"prompt": "...", "n_predict": N, "name": "..."} object')
        unknown = [str(k) for k in r if k not in TRAFFIC_KEYS]
        if unknown:
            raise TrafficFormatError(f"traffic file {path}: request {i} has the key(s) {unknown[:5]}; accepted: "
                                     f"{', '.join(TRAFFIC_KEYS)}")
        prompt, n = r.get("prompt"), r.get("n_predict", 64)
        if not isinstance(prompt, str) or not prompt or isinstance(n, bool) or not isinstance(n, int) \
                or not 1 <= n <= MAX_PREDICT:
            raise TrafficFormatError(f"traffic file {path}: request {i} needs a non-empty \"prompt\" and an integer "
                                     f"\"n_predict\" 1 .. {MAX_PREDICT}, got {r!r:.200}")
        label = r.get("name", f"request-{i}")
        if not isinstance(label, str) or not label:
            raise TrafficFormatError(f"traffic file {path}: request {i} has the name {label!r:.60}; accepted: a "
                                     "non-empty string")
        out.append({"name": label, "prompt": prompt, "n_predict": min(n, max_predict) if max_predict else n})
    return out


def server_command_args(model: Path, point: Point, *, rpc_endpoint: str | None = None, n_ctx: int = 4096,
                        extra_args: Sequence[str] = ()) -> list[str]:
    """The ``llama-server`` arguments of one server run (experts on the host, one slot)."""
    args = ["-m", str(model), "-t", str(point.threads), "-ub", str(point.ubatch),
            "-b", str(max(point.ubatch, 2048)), "-c", str(n_ctx), "-np", "1", "-ngl", "99", "--cpu-moe",
            "--no-repack"]
    if point.backend == "rpc":
        assert rpc_endpoint
        args = ["--rpc", rpc_endpoint, *args]
    if point.spec != "off":
        args += ["--spec-type", point.spec]
    return [*args, *engine.cache_args(point.slots, point.inserts, sync=point.sync), *_max_batch_args(point), *extra_args]


def run_server_point(model: Path, point: Point, requests: Sequence[dict], *, rpc_endpoint: str | None = None,
                     extra_args: Sequence[str] = (), log_dir: Path | None = None, floor_mib: float = 0.0,
                     timeout_s: float = 1800) -> list[dict]:
    """Start ``llama-server`` with ``point``, send ``requests`` (see :func:`load_traffic`) one after
    another, stop it; returns the run's ``pp`` and ``tg`` rows (see the module docstring).

    Raises :class:`pybmoe.engine.EngineError` when the server fails and its log shows no overflow.
    """
    n_ctx = 256 + max(len(r["prompt"]) + r["n_predict"] for r in requests)  # a token is >= 1 character
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    srv = engine.LlamaServer(server_command_args(model, point, rpc_endpoint=rpc_endpoint, n_ctx=n_ctx,
                                                 extra_args=extra_args), log_dir=log_dir)
    results, err = [], None
    load_1m = noise.load_average()
    try:
        srv.start()
        for r in requests:
            results.append(srv.completion(r["prompt"], n_predict=r["n_predict"], timeout_s=timeout_s))
    except engine.EngineError as e:
        err = e
    finally:
        log = srv.stop()
    reason = overflow_reason(log, floor_mib)
    if err is not None and reason is None:
        raise err
    rec = engine.cache_record(log)
    t = [r.get("timings", {}) for r in results]
    tot = {k: sum(float(x.get(k, 0)) for x in t) for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                                                             "draft_n", "draft_n_accepted")}
    texts = "\x00".join(r.get("content", "") for r in results)
    common = dict(model_filename=str(model), n_threads=point.threads, n_ubatch=point.ubatch,
                  n_requests=len(results), draft_n=int(tot["draft_n"]), draft_accepted=int(tot["draft_n_accepted"]),
                  text_sha1=hashlib.sha1(texts.encode()).hexdigest() if results and err is None else "",
                  runner="server", load_1m=load_1m, **_cache_columns(point, rec, reason))
    rows = []
    for mode, n_key, ms_key in (("pp", "prompt_n", "prompt_ms"), ("tg", "predicted_n", "predicted_ms")):
        n, ms = tot[n_key], tot[ms_key]
        ok = err is None and n > 0 and ms > 0
        rows.append(dict(common, mode=mode, n_prompt=int(tot["prompt_n"]) if mode == "pp" else 0,
                         n_gen=int(tot["predicted_n"]) if mode == "tg" else 0,
                         avg_ns=ms * 1e6 if ok else np.nan, avg_ts=n / ms * 1e3 if ok else np.nan))
    return rows


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """Medians per point and mode, and the ratio to the cache-off median (see the module docstring)."""
    g = runs.groupby(list(POINT_KEYS), sort=True, dropna=False)
    s = g.agg(n=("avg_ts", "size"), median_ts=("avg_ts", "median"), min_ts=("avg_ts", "min"),
              max_ts=("avg_ts", "max"), median_hit_pct=("hit_pct", "median"),
              median_resident_mib=("resident_mib", "median"), median_uploads=("uploads", "median"),
              median_upload_wait_ms_per_step=("upload_wait_ms_per_step", "median"),
              median_h2d_per_step=("h2d_per_step", "median"), overflow=("overflow", "any")).reset_index()
    base = s[s["slots"] == 0].set_index(list(BASE_KEYS))["median_ts"].rename("baseline_ts")
    # the default upload mode against --moe-expert-cache-sync at the same point, when both ran
    keys = [k for k in POINT_KEYS if k != "sync"]
    sync_ts = s[s["sync"].astype(bool)].set_index(keys)["median_ts"].rename("sync_ts")
    s = s.join(base, on=list(BASE_KEYS))
    s["ratio"] = s["median_ts"] / s["baseline_ts"]
    s = s.join(sync_ts, on=keys)
    s["ratio_to_sync"] = (s["median_ts"] / s["sync_ts"]).where(~s["sync"].astype(bool))
    s = noise.flag_spread(s, runs, POINT_KEYS)
    cols = list(POINT_KEYS) + ["n", "median_ts", "min_ts", "max_ts", "baseline_ts", "ratio", "ratio_to_sync",
                               "median_hit_pct", "median_resident_mib", "median_uploads",
                               "median_upload_wait_ms_per_step", "median_h2d_per_step", "overflow",
                               "spread", "max_load_1m", "noisy"]
    if "draft_n" in runs:  # the server runner: the share of drafted tokens the target accepted, over all runs
        d = g.agg(draft_n=("draft_n", "sum"), draft_accepted=("draft_accepted", "sum")).reset_index()
        s["draft_accept_pct"] = (100 * d["draft_accepted"] / d["draft_n"].where(d["draft_n"] > 0)).to_numpy()
        cols.append("draft_accept_pct")
    return s[cols]


def sweep(model: str | os.PathLike, out_dir: str | os.PathLike, *, slots: Sequence[int] = (0, 8),
          inserts: Sequence[int] = (0,), ubatch: Sequence[int] = (512,), threads: Sequence[int] | None = None,
          backends: Sequence[str] = ("auto",), repeats: int = 3, n_prompt: int = 128, n_gen: int = 64,
          modes: Sequence[str] = MODES, rpc_threads: int | None = None, floor_mib: float = 0.0,
          extra_args: Sequence[str] = (), progress: bool = True, plots: bool = True, runner: str = "bench",
          specs: Sequence[str] = ("off",), traffic: str | os.PathLike | None = None,
          n_requests: int | None = None, max_batch: Sequence[int] = (0,),
          sync: Sequence[bool] = (False,)) -> SweepResult:
    """Run a sweep and write ``sweep.csv``, ``sweep-summary.csv`` and the plots into ``out_dir``.

    ``slots`` slots per layer (0 = cache off; it is added when missing, as the baseline);
    ``inserts`` uploads per layer per step; ``ubatch`` tokens; ``threads`` host threads
    (default: the CPU count); ``backends`` any of :data:`BACKENDS`; ``repeats`` runs per point
    and mode; ``n_prompt`` / ``n_gen`` tokens of the pp / tg runs (server runner: ``n_gen`` caps
    each request's ``n_predict``, ``n_prompt`` is unused); ``rpc_threads`` threads of the
    loopback ``ggml-rpc-server`` (default: its own default); ``floor_mib`` MiB a device must keep
    free (overflow check); ``extra_args`` go to every ``llama-bench`` (or ``llama-server``) run;
    ``runner`` one of :data:`RUNNERS`; ``specs`` speculation settings (:data:`SPEC_TYPES`; the
    bench runner takes ``off`` only); ``traffic`` the server runner's request file (default
    :data:`TRAFFIC`) and ``n_requests`` its first N requests; ``max_batch`` the largest ubatches the
    cache serves (tokens; 0 = the engine's default; e.g. the ubatch, to put prefill through the
    cache); ``sync`` the upload modes (``(False, True)`` runs the default against
    ``--moe-expert-cache-sync``, interleaved).

    Raises :class:`ValueError` (bad arguments, before anything runs), :class:`FileNotFoundError`
    (no model or traffic file) or :class:`pybmoe.engine.EngineError` (a failed run).
    """
    model = Path(model)
    if not model.is_file():
        raise FileNotFoundError(f"model {model} not found; accepted: a GGUF file")
    if runner not in RUNNERS:
        raise ValueError(f"runner {runner!r}; accepted: {', '.join(RUNNERS)}")
    specs = _specs(specs)
    if runner == "bench" and specs != ["off"]:
        raise ValueError(f"spec {','.join(specs)}: llama-bench has no speculative decoding; use runner='server' "
                         f"(--runner server) for a speculation axis")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    for name, v in (("n_prompt", n_prompt), ("n_gen", n_gen)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1 (tokens)")
    modes = list(dict.fromkeys(modes))
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode {m!r}; accepted: {', '.join(MODES)}")
    slots = _ints("slots", slots, 0)
    if 0 not in slots:
        slots = [0, *slots]
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"backend {b!r} is not supported; accepted: {', '.join(BACKENDS)}")
    threads = threads or [os.cpu_count() or 1]
    requests = load_traffic(traffic, n_requests, n_gen) if runner == "server" else []
    grid(slots, inserts, ubatch, threads, [b if b != "auto" else "rpc" for b in backends], specs,
         max_batch, sync)  # validate first
    resolved = list(dict.fromkeys(detect_backend() if b == "auto" else b for b in backends))
    points = grid(slots, inserts, ubatch, threads, resolved, specs, max_batch, sync)
    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)

    total = len(points) * (len(modes) if runner == "bench" else 1) * repeats
    rpc = engine.RpcServer(threads=rpc_threads, log_dir=out_dir / "logs") if "rpc" in resolved else None
    rows: list[dict] = []
    from tqdm import tqdm
    bar = tqdm(total=total, desc="sweep", unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    try:
        if rpc:
            rpc.start()
        for rep in range(repeats):
            # every other repeat runs the slot counts in reverse: drift falls on both sides
            order = points if rep % 2 == 0 else sorted(points, key=lambda p: -p.slots)
            order = sorted(order, key=lambda p: (p.backend, p.spec, p.threads, p.ubatch))  # stable: keeps slot order
            for p in order:
                tag = (f"s{p.slots}-i{p.inserts}-mb{p.max_batch}{'-sync' if p.sync else ''}-ub{p.ubatch}-t{p.threads}"
                       f"-{p.backend}-{p.spec}-r{rep}")
                if runner == "server":
                    bar.set_postfix_str(f"server slots={p.slots} ins={p.inserts} ub={p.ubatch} t={p.threads} "
                                        f"{p.backend} spec={p.spec} r{rep}")
                    got = run_server_point(model, p, requests, rpc_endpoint=rpc.endpoint if rpc else None,
                                           extra_args=extra_args, log_dir=out_dir / "logs" / f"server-{tag}",
                                           floor_mib=floor_mib)
                    for row in got:
                        if row["mode"] in modes:
                            rows.append(dict(row, repeat=rep))
                    bar.update(1)
                    continue
                for mode in modes:
                    bar.set_postfix_str(f"{mode} slots={p.slots} ins={p.inserts} ub={p.ubatch} t={p.threads} "
                                        f"{p.backend} r{rep}")
                    name = f"{mode}-{tag}.log"
                    row = run_point(model, p, mode, n_prompt=n_prompt, n_gen=n_gen,
                                    rpc_endpoint=rpc.endpoint if rpc else None, extra_args=extra_args,
                                    log_path=out_dir / "logs" / name, floor_mib=floor_mib)
                    row["repeat"] = rep
                    rows.append(row)
                    bar.update(1)
    finally:
        bar.close()
        if rpc:
            rpc.stop()

    runs = pd.DataFrame(rows)
    bench_cols = [c for c in runs.columns if c not in CACHE_COLUMNS]
    runs = runs[bench_cols + list(CACHE_COLUMNS)]
    runs["overflow"] = runs["overflow"].astype(bool)
    summary = summarize(runs)
    csv = out_dir / "sweep.csv"
    runs.to_csv(csv, index=False)
    summary_csv = out_dir / "sweep-summary.csv"
    summary.to_csv(summary_csv, index=False)
    pngs: list[Path] = []
    if plots:
        from .plot import sweep_plot
        for mode in modes:
            sub = runs[runs["mode"] == mode]
            if len(sub):
                n = n_prompt if mode == "pp" else n_gen
                what = f"{mode}{n}" if runner == "bench" else f"{mode} of {len(requests)} server requests"
                pngs.append(sweep_plot(sub, out_dir / f"sweep-{mode}.png",
                                       title=f"{model.name}: {what} ({'prefill' if mode == 'pp' else 'decode'}), "
                                             f"{repeats} repeats"))
    return SweepResult(runs, summary, csv, summary_csv, pngs)


def format_summary(summary: pd.DataFrame) -> str:
    """The summary as a Markdown table (tok/s medians, ratio to cache off, hit %, uploads; ``noisy``:
    the spread and load of a point whose repeats disagree, :mod:`pybmoe.bench.noise`), and under it one
    line per noisy point."""
    cols = ["mode", "runner", "backend", "spec", "n_threads", "n_ubatch", "slots", "inserts", "max_batch", "sync", "n",
            "median_ts",
            "baseline_ts", "ratio", "ratio_to_sync", "median_hit_pct", "median_resident_mib", "median_uploads",
            "median_upload_wait_ms_per_step", "median_h2d_per_step", "overflow"]
    if "noisy" in summary:
        cols.append("noisy")
    if "draft_accept_pct" in summary:
        cols.append("draft_accept_pct")
    s = summary[cols].copy()
    if "draft_accept_pct" in s:
        s["draft_accept_pct"] = s["draft_accept_pct"].map(lambda v: "–" if pd.isna(v) else f"{v:.1f}")
    for c in ("median_ts", "baseline_ts"):
        s[c] = s[c].map(lambda v: f"{v:.1f}")
    s["ratio"] = s["ratio"].map(lambda v: f"{v:.3f}")
    s["ratio_to_sync"] = s["ratio_to_sync"].map(lambda v: "–" if pd.isna(v) else f"{v:.3f}")
    s["median_upload_wait_ms_per_step"] = s["median_upload_wait_ms_per_step"].map(
        lambda v: "–" if pd.isna(v) else f"{v:.2f}")
    s["median_h2d_per_step"] = s["median_h2d_per_step"].map(lambda v: "–" if pd.isna(v) else f"{v:.1f}")
    s["median_hit_pct"] = s["median_hit_pct"].map(lambda v: "–" if pd.isna(v) else f"{v:.1f}")
    s["median_resident_mib"] = s["median_resident_mib"].map(lambda v: f"{v:.1f}")
    s["median_uploads"] = s["median_uploads"].map(lambda v: f"{v:.0f}")
    if "noisy" in s:
        s["noisy"] = [noise.noisy_note(r) for r in summary.itertuples(index=False)]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    table = head + "\n".join("| " + " | ".join(str(v) for v in r) + " |" for r in s.itertuples(index=False))
    lines = noise.noisy_lines(summary, ["mode", "backend", "slots", "inserts"]) if "noisy" in summary else []
    return "\n".join([table, *lines])
