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
    """The :class:`ModelShape` of a GGUF (header only). Raises :class:`SizingError` for a non-MoE file."""
    try:
        eb, n_layer, n_expert, k = sim.gguf_expert_bytes(model)
    except sim.BudgetError as e:
        raise SizingError(str(e)) from None
    return ModelShape(n_layer, n_expert, k or 1, eb)


def device_bytes(slots: int, shape: ModelShape, inserts: int = 0, max_batch: int = 1) -> int:
    """Device bytes of the cache at ``slots`` per layer (rule 1); 0 when ``slots`` is 0 (cache off)."""
    if slots <= 0:
        return 0
    stage = sim.staging_slots(slots, shape.n_expert, shape.top_k, inserts, max_batch)
    return int(shape.n_layer * ((slots + stage + 1) * shape.expert_bytes + 4 * shape.n_expert))


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
    whether it is below the cycle, the table of candidates and any warnings (text)."""

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
            rows.append((s, r.hit_rate))
    else:
        rows = [(s, math.nan) for s in sorted({1, shape.top_k, shape.n_expert // 4, shape.n_expert // 2, s_max})
                if 1 <= s <= s_max]
    table = pd.DataFrame([{"slots_per_layer": s,
                           "staging": sim.staging_slots(s, shape.n_expert, shape.top_k, inserts),
                           "device_mib": device_bytes(s, shape, inserts) / MIB, "hit_rate": h} for s, h in rows],
                         columns=["slots_per_layer", "staging", "device_mib", "hit_rate"])
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
