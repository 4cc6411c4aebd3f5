"""The expert tiers' own lines, parsed: the ``moe-cache-preamble:`` line at load, the
``moe-cache:`` summary when a context is freed, the cliff warning, and the ``moe_cache_*`` series
of a ``llama-server --metrics`` page; :func:`cache_record` joins them into one tidy record. The
stream tier's ``moe-stream-preamble:`` and ``moe-stream:`` lines: :func:`stream_record`.

Pure text parsing: no processes, no files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

_SUMMARY = re.compile(r"moe-cache: ([0-9.]+)% hit, resident ([0-9.]+) MiB, uploads (\d+) \(([0-9.]+) MiB\)"
                      r"(?:, layer_demand ([0-9.]+) MiB, token_demand ([0-9.]+) MiB, steps (\d+))?"
                      r"(?:, upload wait ([0-9.]+) ms, h2d (\d+) \((\d+) publishes\), waits (\d+), upload ([0-9.]+) GB/s, "
                      r"file ([0-9.]+) MiB, (sync|async)(?:, warmup (\d+))?)?")
_PREAMBLE = re.compile(r"moe-cache-preamble: (.*)$", re.M)
_POOL = re.compile(r", pool (\S+): (\d+) slots, (\d+) resident, ([0-9.]+)% hit")
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
    upload_wait_ms: float | None = None    # time steps waited for uploads
    h2d: int | None = None                 # host-to-device calls (merged upload runs + table publishes)
    publishes: int | None = None           # of h2d, table publishes (one per device per changed step)
    waits: int | None = None               # blocking waits for uploads
    upload_gbps: float | None = None       # the uploader's rate while copying, GB/s
    upload_file_mib: float | None = None   # MiB of the uploads read from the GGUF file
    sync: bool | None = None               # --moe-expert-cache-sync
    warmup_uploads: int | None = None      # uploads the prefill warm-up scheduled
    pools: tuple[tuple[str, int, int, float], ...] = ()  # the pool per device: (device, slots, resident, hit %)

    def without_timings(self) -> "CacheSummary":
        """The fields a deterministic run repeats exactly: the timings (upload wait, waits, which
        depend on whether an upload had finished when a step looked, and the uploader's rate) set
        to None."""
        return replace(self, upload_wait_ms=None, waits=None, upload_gbps=None)


def parse_cache_summaries(log: str) -> list[CacheSummary]:
    """Every summary line in a log, in order (one per freed context)."""
    out = []
    for m in _SUMMARY.finditer(log):
        a, b, c, d, e, f, g, w, h, pub, n, r, fm, mode, wu = m.groups()
        opt = lambda v, t: t(v) if v else None  # noqa: E731
        end = log.find("\n", m.end())
        pools = tuple((dev, int(p), int(res), float(hit))
                      for dev, p, res, hit in _POOL.findall(log[m.end():end if end >= 0 else len(log)]))
        out.append(CacheSummary(float(a), float(b), int(c), float(d), opt(e, float), opt(f, float), opt(g, int),
                                opt(w, float), opt(h, int), opt(pub, int), opt(n, int), opt(r, float),
                                opt(fm, float), None if mode is None else mode == "sync", opt(wu, int), pools))
    return out


def parse_cache_preamble(log: str) -> dict | None:
    """The ``moe-cache-preamble:`` line printed at load, as a dict (None when absent).

    Keys: layers, n_expert, top_k, slots, staging, zero (slots per layer: resident, staging, the zero
    slot), inserts (counts), max_batch (tokens: the largest
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
    are added as ``metrics_hits``, ``metrics_misses``, ``metrics_uploads``, ``metrics_h2d_ops``,
    ``metrics_waits``, ``metrics_upload_wait_seconds``,
    ``metrics_upload_mib``, ``metrics_resident_mib`` (MiB) and ``metrics_slots`` (summed over
    devices): the live values at the time of the scrape, where the summary is the value when the
    context was freed."""
    pre = parse_cache_preamble(log) or {}
    sums = parse_cache_summaries(log)
    last = sums[-1] if sums else None
    rec = {k: pre.get(k) for k in ("layers", "n_expert", "top_k", "slots", "staging", "zero", "inserts", "max_batch",
                                    "slot_mib", "cache_cycle_mb", "layer_cycle_slots")}
    rec["budget_mib"] = sum(pre["budget_mib"].values()) if pre.get("budget_mib") else None
    for f in ("hit_pct", "resident_mib", "uploads", "upload_mib", "layer_demand_mib", "token_demand_mib", "steps",
              "upload_wait_ms", "h2d", "publishes", "waits", "upload_gbps", "upload_file_mib", "sync", "warmup_uploads"):
        rec[f] = getattr(last, f) if last else None
    rec["below_cycle"] = bool(_CLIFF.search(log))
    if metrics is not None:
        m = parse_cache_metrics(metrics) or {}
        for k in ("hits", "misses", "uploads", "h2d_ops", "waits", "upload_wait_seconds"):
            rec[f"metrics_{k}"] = m.get(k)
        for k in ("upload", "resident"):
            b = m.get(f"{k}_bytes")
            rec[f"metrics_{k}_mib"] = b / 2**20 if b is not None else None
        rec["metrics_slots"] = sum(m["slots"].values()) if m.get("slots") else None
    rec.update(stream_record(log, metrics))
    return rec


# --------------------------------------------------------------------------- the stream tier

_STREAM_SUMMARY = re.compile(r"moe-stream: ([0-9.]+)% hit, resident ([0-9.]+) MiB, misses (\d+) \(read ([0-9.]+) MiB, "
                             r"([0-9.]+) MiB/token\), io wait ([0-9.]+) s, major faults (\d+)")
_STREAM_PREAMBLE = re.compile(r"moe-stream-preamble: (.*)$", re.M)
_STREAM_CONTEXT = re.compile(r"moe-stream: auto: a context takes ([0-9.]+) MiB of host memory .*?-> budget ([0-9.]+) MiB")
_STREAM_CLIFF = re.compile(r"moe-stream: WARNING the budget of [0-9.]+ MiB is below the cache cycle")


@dataclass(frozen=True)
class StreamSummary:
    """The ``moe-stream:`` line printed when a context is freed (counters since the tier started)."""

    hit_pct: float        # hits / lookups, percent
    resident_mib: float   # MiB of experts resident in the RAM cache
    misses: int           # lookups that read their expert from the file
    read_mib: float       # MiB read
    read_mib_per_token: float
    io_wait_s: float      # seconds the graph waited for reads
    major_faults: int     # the process's major page faults since the tier started (getrusage)


def parse_stream_summaries(log: str) -> list[StreamSummary]:
    """Every ``moe-stream:`` summary line in a log, in order (one per freed context)."""
    return [StreamSummary(float(a), float(b), int(c), float(d), float(e), float(f), int(g))
            for a, b, c, d, e, f, g in _STREAM_SUMMARY.findall(log)]


def parse_stream_preamble(log: str) -> dict | None:
    """The ``moe-stream-preamble:`` line printed at load, as a dict (None when absent).

    Keys: layers, n_expert, top_k, io_threads (counts), direct_io (1 O_DIRECT, 0 buffered),
    budget_mb, cache_cycle_mb (every streamed layer's top-k experts), layer_demand_mb (one layer's
    top-k experts), min_mb (the most one layer step needs at the ubatch), least_mb (the least budget
    the tier takes: under min_mb, steps that need more than the budget holds run in expert waves),
    entry_mb (one expert of one layer), all MiB; wave_experts (the waves' window: experts read ahead
    per projection, 0 without waves); prefetch_experts (the prefetch window, which decode holds beside the
    budget: experts); overlap (reads behind compute: 0 off, 1 on, ``"auto"`` on while the
    contexts' compute threads leave a CPU to the read lanes).
    """
    m = _STREAM_PREAMBLE.search(log)
    if not m:
        return None
    rec: dict = {}
    for kv in m.group(1).split():
        k, _, v = kv.partition("=")
        try:
            rec[k] = float(v) if "." in v else int(v)
        except ValueError:
            rec[k] = v  # a word: overlap=auto
    return rec


def stream_record(log: str, metrics: str | None = None) -> dict:
    """One tidy record of a run's stream-tier lines (preamble, last summary, cliff warning), keys
    prefixed ``stream_``; absent values are None. ``metrics``: a ``/metrics`` page whose
    ``llamacpp:moe_stream_*`` series are added as ``stream_metrics_*``."""
    pre = parse_stream_preamble(log) or {}
    sums = parse_stream_summaries(log)
    last = sums[-1] if sums else None
    rec = {f"stream_{k}": pre.get(k) for k in ("layers", "budget_mb", "cache_cycle_mb", "layer_demand_mb", "min_mb",
                                                "entry_mb", "direct_io", "io_threads", "prefetch_experts")}
    for f in ("hit_pct", "resident_mib", "misses", "read_mib", "read_mib_per_token", "io_wait_s", "major_faults"):
        rec[f"stream_{f}"] = getattr(last, f) if last else None
    rec["stream_below_cycle"] = bool(_STREAM_CLIFF.search(log))
    # auto: the budget once the last context's host memory was set aside (the preamble's is the load's)
    ctx = _STREAM_CONTEXT.findall(log)
    rec["stream_context_mib"] = float(ctx[-1][0]) if ctx else None
    rec["stream_budget_after_contexts_mb"] = float(ctx[-1][1]) if ctx else None
    if metrics is not None:
        for name, value in re.findall(r"^llamacpp:moe_stream_(\w+)\s+(\S+)$", metrics, re.M):
            v = float(value)
            rec[f"stream_metrics_{name.removesuffix('_total')}"] = int(v) if v.is_integer() else v
    return rec
