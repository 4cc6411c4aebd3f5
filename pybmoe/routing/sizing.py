"""How many expert-cache slots to give each layer: **the one place the recommendation logic lives**.

``pybmoe size`` prints it, and the engine's ``--moe-expert-cache auto`` (when it comes) must
implement these same rules, citing this docstring; change them here first.

1. **Cost.** A cached layer holds ``slots + staging + 1`` expert copies on the device (the
   staging slots, :func:`pybmoe.routing.sim.staging_slots`, and the all-zero dummy slot) plus an I32
   ``[n_expert]`` table: ``device_bytes = n_layer * ((slots + staging + 1) * expert_bytes +
   4 * n_expert)``, with ``expert_bytes`` one expert's up + gate + down bytes from the GGUF.
2. **Ceiling.** ``s_max`` = ``n_expert``, or with a free-memory budget the largest slot count
   whose ``device_bytes`` fits in it (0 when not even one slot fits).
3. **Evidence.** With a routing trace of the model, every candidate ``1 .. s_max`` is replayed
   with the engine's exact policy (``layer-lru``, decode lookups, the given insert cap); the
   recommendation is the smallest slot count whose hit rate is within ``tolerance`` (1
   percentage point) of the hit rate at ``s_max``: past it, memory buys almost nothing. Without
   a trace, the recommendation is ``s_max``.
4. **The cycle.** Below ``top_k`` slots a layer cannot hold even one token's experts: the
   recommendation is flagged ``below_cycle`` and a warning is printed (a global cache has the
   same cliff at ``n_layer * top_k`` entries, see docs/traces.md).

Errors: :class:`SizingError` (a :class:`ValueError`) names the bad value and the accepted range.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pandas as pd

from . import sim
from . import trace as tr

MIB = 2**20


class SizingError(ValueError):
    """A budget or trace that cannot size this model."""


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs of a model: MoE layers (count), experts per layer, top-k, and the bytes
    of one expert (up + gate + down, the mean over layers)."""

    n_layer: int
    n_expert: int
    top_k: int
    expert_bytes: float


def model_shape(model: str | os.PathLike) -> ModelShape:
    """The :class:`ModelShape` of a GGUF (its header, and the file's size against its tensors). Raises
    :class:`SizingError` for a non-MoE file, :class:`ValueError` for a file that is not GGUF or is
    truncated (as llama.cpp refuses it at load)."""
    try:
        eb, n_layer, n_expert, k = sim.gguf_expert_bytes(model)
    except sim.BudgetError as e:
        raise SizingError(str(e)) from None
    return ModelShape(n_layer, n_expert, k or 1, eb)


def _slot_bytes(slots: int, shape: ModelShape, inserts: int, max_batch: int) -> float:
    """Bytes of ``slots`` per layer with their staging and the zero slot, over every cached layer."""
    stage = sim.staging_slots(slots, shape.n_expert, shape.top_k, inserts, max_batch)
    return shape.n_layer * (slots + stage + 1) * shape.expert_bytes


def device_bytes(slots: int, shape: ModelShape, inserts: int = 0, max_batch: int = 1) -> int:
    """Device bytes of the cache at ``slots`` per layer (rule 1); 0 when ``slots`` is 0 (cache off)."""
    if slots <= 0:
        return 0
    return int(_slot_bytes(slots, shape, inserts, max_batch) + shape.n_layer * 4 * shape.n_expert)


def budget_mib(slots: int, shape: ModelShape, inserts: int = 0, max_batch: int = 1) -> int:
    """The ``--moe-expert-cache-mb`` (MiB per device, whole) that holds ``slots`` per layer on a device
    with every cached layer: their slots, staging and zero slot, rounded up (the engine then takes the
    most slots that fit it, so at least ``slots``; the I32 tables are not part of it). 0 for 0 slots."""
    if slots <= 0:
        return 0
    return math.ceil(_slot_bytes(slots, shape, inserts, max_batch) / MIB)


def pool_slots(slots: int, shape: ModelShape, inserts: int = 0, max_batch: int = 1) -> int:
    """The pool's resident slots (entries) in the bytes of ``slots`` per layer: the most ``P`` whose
    ``P + S + 1`` (``S`` = :func:`pybmoe.routing.sim.pool_staging`, one zero slot) fit the ``n_layer x
    (slots + staging + 1)`` expert copies those slots take, as the engine sizes a bank for
    ``--moe-expert-cache-mb`` and ``auto`` (ggml-ext/llama-moe-vram-alloc.cpp, llama_moe_vram_bank_slots).
    0 for 0 slots."""
    if slots <= 0:
        return 0
    n, e, k = shape.n_layer, shape.n_expert, shape.top_k
    room = n * (slots + sim.staging_slots(slots, e, k, inserts, max_batch) + 1)
    for p in range(n * e, 0, -1):
        if p + sim.pool_staging(p, n, e, k) + 1 <= room:
            return p
    return 0


def max_slots(shape: ModelShape, free_mib: float | None, inserts: int = 0) -> int:
    """Rule 2: the most slots per layer that fit in ``free_mib`` MiB (``n_expert`` when None)."""
    if free_mib is None:
        return shape.n_expert
    if free_mib < 0:
        raise SizingError(f"free memory {free_mib} MiB; accepted: >= 0")
    best = 0
    for s in range(1, shape.n_expert + 1):
        if device_bytes(s, shape, inserts) <= free_mib * MIB:
            best = s
    return best


@dataclass(frozen=True)
class Recommendation:
    """The recommended slots per layer, its device MiB and expected hit rate (NaN without a trace),
    whether it is below the cycle, the table of candidates (per candidate also ``pool_slots``, the
    pool the same MiB buy, and its ``pool_hit_rate``) and any warnings (text)."""

    shape: ModelShape
    slots_per_layer: int
    device_mib: float
    hit_rate: float
    below_cycle: bool
    table: pd.DataFrame
    warnings: list[str] = field(default_factory=list)


def recommend(shape: ModelShape, *, free_mib: float | None = None, trace: tr.Trace | None = None,
              inserts: int = 0, tolerance: float = 0.01, backend: str = "auto") -> Recommendation:
    """Apply rules 1-4 (module doc). ``trace`` must come from this model (same experts and top-k).

    Raises :class:`SizingError` for a trace of another shape, a negative budget or tolerance.
    """
    if tolerance < 0:
        raise SizingError(f"tolerance {tolerance}; accepted: >= 0")
    s_max = max_slots(shape, free_mib, inserts)
    warnings: list[str] = []
    rows = []
    if trace is not None:
        m = trace.meta
        if m.n_expert != shape.n_expert or m.n_expert_used != shape.top_k:
            raise SizingError(f"the trace has {m.n_expert} experts, top-{m.n_expert_used}; the model has "
                              f"{shape.n_expert}, top-{shape.top_k}; accepted: a trace of this model")
        rp = sim.prepare(trace)
        for s in range(1, s_max + 1):
            r = sim.simulate(rp, "layer-lru", slots_per_layer=s, inserts=inserts, phase="decode", backend=backend)
            pool = sim.simulate(rp, "pool", budget_entries=pool_slots(s, shape, inserts), phase="decode",
                                backend=backend)
            rows.append((s, r.hit_rate, pool.hit_rate))
    else:
        rows = [(s, math.nan, math.nan) for s in sorted({1, shape.top_k, shape.n_expert // 4, shape.n_expert // 2, s_max})
                if 1 <= s <= s_max]
    table = pd.DataFrame([{"slots_per_layer": s,
                           "staging": sim.staging_slots(s, shape.n_expert, shape.top_k, inserts),
                           "device_mib": device_bytes(s, shape, inserts) / MIB, "hit_rate": h,
                           "pool_slots": pool_slots(s, shape, inserts), "pool_hit_rate": ph} for s, h, ph in rows],
                         columns=["slots_per_layer", "staging", "device_mib", "hit_rate", "pool_slots", "pool_hit_rate"])
    if s_max == 0:
        warnings.append(f"not even one slot per layer fits in {free_mib} MiB "
                        f"(one slot per layer costs {device_bytes(1, shape, inserts) / MIB:.3g} MiB): leave the cache off")
        return Recommendation(shape, 0, 0.0, math.nan, True, table, warnings)
    best = s_max
    if trace is not None:
        top = table["hit_rate"].iloc[-1]
        best = int(table.loc[table["hit_rate"] >= top - tolerance, "slots_per_layer"].min())
    hit = float(table.loc[table["slots_per_layer"] == best, "hit_rate"].iloc[0]) if trace is not None else math.nan
    below = best < shape.top_k
    if below:
        warnings.append(f"{best} slots per layer is below the cycle: a token selects {shape.top_k} experts per layer, "
                        "so a step evicts what the next one needs; expect a low hit rate")
    return Recommendation(shape, best, device_bytes(best, shape, inserts) / MIB, hit, below, table, warnings)


# --------------------------------------------------------------------------- the stream tier

@dataclass(frozen=True)
class StreamPrediction:
    """Decode through the stream tier at one budget, predicted from a trace (see :func:`predict_stream`)."""

    budget_mib: float
    budget_entries: int
    hit_rate: float             # the tier's policy (sim.STREAM_POLICY) over the trace's decode lookups, 0..1
    miss_mib_per_token: float   # MiB read from the file per decode token
    compute_s_per_token: float
    io_s_per_token: float
    window_experts: int = 0     # the prefetch window decode holds beside budget_entries (experts)

    @property
    def tok_s(self) -> float:
        return 1.0 / (self.compute_s_per_token + self.io_s_per_token)


#: The stream tier's own time per streamed layer step, beside its reads (ms): the op's bookkeeping, waking
#: the read lanes, giving evicted pages back and the first touch of the pages a read filled. Measured on
#: this project's 2-core machine (docs/benchmarks/stream-defaults-2026-12-03/README.md: a token's time
#: less its io wait and its all-resident compute, over the 24 layers of a 4 GiB qwen3moe model).
STREAM_STEP_OVERHEAD_MS = 1.0


def default_window_experts(shape: ModelShape, n_ubatch: int = 512) -> int:
    """The stream tier's prefetch window beside a fixed budget, in experts: a quarter of a layer's
    experts (rounded up) when a step at ``n_ubatch`` tokens can want half of its layer, else 0
    (``ggml-ext/llama-moe-stream-init.cpp``). Decode holds the budget plus these entries."""
    demand = min(shape.n_expert, shape.top_k * n_ubatch)
    return (shape.n_expert + 3) // 4 if 2 * demand >= shape.n_expert else 0


def predict_stream(shape: ModelShape, trace: tr.Trace, budget_mib: float, *, disk_mib_s: float,
                   resident_tok_s: float | None = None, ram_mib_s: float | None = None,
                   dense_mib: float = 0.0, step_overhead_ms: float = STREAM_STEP_OVERHEAD_MS,
                   tokens: int | None = None, skip: int = 0, window_experts: int | None = None) -> StreamPrediction:
    """Decode tok/s of the stream tier (``--moe-stream-cache-mb budget_mib``) on this model.

    The tier's policy (``global-lru-scan``, :data:`pybmoe.routing.sim.STREAM_POLICY`) is replayed
    exactly, so the hit rate is the simulator's on the trace's decode lookups at ``budget_entries =
    floor(budget_mib / expert MiB)`` plus the prefetch window the tier lends to decode
    (``window_experts``, experts; default :func:`default_window_experts`, the window beside a fixed
    budget; auto's is the preamble's ``prefetch_experts``). A token costs the compute
    of an all-resident token (``1 / resident_tok_s``, measured; or, without it, the bytes a token
    touches, ``n_layer * top_k`` experts plus ``dense_mib``, at ``ram_mib_s``), plus the tier's own
    ``step_overhead_ms`` per layer step (:data:`STREAM_STEP_OVERHEAD_MS`), plus its misses read at
    ``disk_mib_s`` (serially: decode does not overlap reads with compute). ``disk_mib_s`` is best
    measured at the tier's own read size and lanes: :func:`pybmoe.bench.disk.probe`.

    ``tokens``: predict a short run, the trace's first ``tokens`` decode tokens of each workload from an
    empty cache (llama-bench's ``-n N`` with its warm-up token is ``tokens=N + 1, skip=1``), of which the
    first ``skip`` are not timed; default the whole trace. Units: MiB, MiB/s, ms, tokens/s.
    Raises :class:`SizingError` for a bandwidth <= 0, neither compute figure, a negative overhead or
    window, or ``tokens`` <= ``skip``.
    """
    if disk_mib_s <= 0 or (resident_tok_s is None and (ram_mib_s is None or ram_mib_s <= 0)):
        raise SizingError(f"disk_mib_s={disk_mib_s}, resident_tok_s={resident_tok_s}, ram_mib_s={ram_mib_s}; accepted: "
                          "disk_mib_s > 0 and resident_tok_s > 0 or ram_mib_s > 0")
    if step_overhead_ms < 0 or skip < 0 or (tokens is not None and tokens <= skip):
        raise SizingError(f"step_overhead_ms={step_overhead_ms}, tokens={tokens}, skip={skip}; accepted: "
                          "step_overhead_ms >= 0, 0 <= skip < tokens")
    window = default_window_experts(shape) if window_experts is None else window_experts
    if window < 0:
        raise SizingError(f"window_experts={window_experts}; accepted: >= 0 (experts)")

    def run(t: tr.Trace, n: int | None):
        if n is not None:  # each workload's first n decode tokens, and nothing before them
            f = t.frame[t.frame["phase"] == "decode"]
            order = f.groupby("workload", sort=False)["token"].rank(method="dense")
            t = tr.from_frame(f[order <= n].reset_index(drop=True), t.meta, t.source)
        r = sim.simulate(t, sim.STREAM_POLICY, mib=budget_mib, expert_bytes=shape.expert_bytes, phase="decode",
                         lend_entries=window)
        return r, int(r.summary["tokens"].sum()), int(r.summary["misses"].sum())

    r, n_tok, misses = run(trace, tokens)
    hit_rate = r.hit_rate
    if skip:
        _, skip_tok, skip_miss = run(trace, skip)
        n_tok, misses = n_tok - skip_tok, misses - skip_miss
        lookups = n_tok * shape.n_layer * shape.top_k
        hit_rate = 1.0 - misses / lookups if lookups else math.nan
    expert_mib = shape.expert_bytes / MIB
    miss_mib = misses * expert_mib / n_tok if n_tok else 0.0
    if resident_tok_s is not None:
        if resident_tok_s <= 0:
            raise SizingError(f"resident_tok_s={resident_tok_s}; accepted: > 0")
        compute = 1.0 / resident_tok_s
    else:
        compute = (shape.n_layer * shape.top_k * expert_mib + dense_mib) / ram_mib_s
    compute += shape.n_layer * step_overhead_ms / 1000.0
    return StreamPrediction(budget_mib, r.budget_entries, hit_rate, miss_mib, compute, miss_mib / disk_mib_s, window)
