"""Synthetic routing traces: long traces with the reuse of a short real one.

``pybmoe trace synth --from TRACE --steps N --seed S --out FILE`` (and :func:`synthesize`)
resamples, per MoE layer of a real trace's decode rows and independently for each layer, the
**LRU stack distances** of the layer's lookups, and writes a trace of ``N`` decode tokens.

The stack distance of a lookup is the number of distinct experts of that layer selected more
recently than this one (0 = the most recent), against the layer's LRU stack as it stood before
the token (so the ``k`` experts of one token look up the same stack), or **cold** when the
expert had not yet been selected in its workload (every source workload starts from an empty
stack). Applying a token's vector of ``k`` distances to a stack gives back its experts, up to the
identity of the cold ones. The generator therefore does a **block bootstrap over tokens**: per
layer, it walks through the source's tokens, applying each token's distance vector (in rank
order) to the synthetic layer's own stack, and with probability ``1 / block`` per token (default
``block`` = 16 tokens), or at the end of a source workload, jumps to a random source token whose
stack was no longer than the synthetic one (so that every depth it names exists). A cold
distance, or a depth beyond the stack, selects an expert by **popularity** (the layer's decode
lookups per expert, plus 0.5) among those the token has not selected: an expert not yet on the
stack, else one below the 90th percentile of the layer's finite distances.

**What it preserves.** Per layer: the distribution of stack distances, jointly over the ``k``
lookups of a token and over runs of about ``block`` tokens, hence the hit-rate curve of a
per-layer LRU against its slots, including the engine's two-step upload lag (``layer-lru`` in
:mod:`pybmoe.routing.sim`); with workloads as long as the source's, the curve is within a few points per
layer (``tests/routing/test_synth.py`` checks 4, 8, 16 and 24 slots on the granite trace). Also the
consecutive-token overlap, the reuse-distance histogram, the share of cold lookups per workload
of the source's length, the skew of the fresh draws' popularity, and the shape: layer indices,
``n_expert``, top-``k`` (``k`` distinct experts per token and layer).

**What it does not preserve.** Correlation between layers (a global LRU sees independent
layers), the identity of the experts beyond their popularity, long-range structure beyond a
block (a change of topic), and the prefill: the output has decode rows only. A single long
workload has no cold starts after its first tokens, so its hit rate at large slot counts is
above that of the source's short workloads, which pay about 6% compulsory misses (granite).

**Another model's shape** (``n_layer`` / ``n_expert`` / ``top_k``, CLI ``--n-layer L
--n-expert E --top-k K``): route replay needs a trace of the replaying model's own shape, and the
real traces at hand come from small models (granite: 24 layers, 32 experts, top-8). The shape
map writes a trace for ``L`` MoE layers (indices ``0 .. L-1``) of ``E`` experts:

- target layer ``i`` is sampled from source layer ``i mod L_src`` (in the source's layer order),
  each target layer independently, with its own random **relabelling** of the experts;
- every finite stack distance ``d`` becomes ``floor((d + u) * s)``, ``u`` uniform in [0, 1),
  with ``s = distance_scale`` (default ``E / E_src``), bumped up where needed so that a token's
  ``k`` depths stay distinct; the stack depths that gate the block jumps scale likewise, and a
  cold lookup stays cold;
- the popularity of the fresh draws spreads each source expert's share evenly over ``s`` target
  experts (``E / E_src`` of them in general), in the layer's relabelled order;
- ``top_k`` (default the source's) may be smaller than the source's ``k``: the source is first
  cut to its ranks ``< top_k``, which, ranks being router order (rank 0 the strongest), is what a
  top-``top_k`` router would have picked; a larger ``top_k`` is refused (the source has no rows
  for the extra ranks), as is ``top_k > E``.

What the map **preserves**: each layer's LRU hit-rate curve as a function of the *fraction* of
the experts cached: an LRU of ``c·s`` slots hits a mapped lookup exactly when one of ``c`` slots
hit the source lookup, up to the upload lag and the fresh draws (``tests/routing/test_synth.py`` checks
that ``E_src/2 · s`` slots on the mapped trace track ``E_src/2`` on the source per layer); the
cold share, the shape of the popularity skew, and the top-``k`` structure. What it **invents**:
the absolute scale of reuse (the assumption that a model with ``s`` times the experts at the
same top-k has a working set ``s`` times larger: the real ratio is not known without a trace of
the real model; ``distance_scale=1`` keeps the source's absolute distances instead); the
consecutive-token overlap (a reuse from the previous token, distance ``< k``, is spread over the
previous ``s`` tokens or so, so the mapped trace leans less on the upload lag than the source);
every layer beyond ``L_src`` repeats a source layer's statistics (sampled independently: no
cross-layer correlation, as for the plain synthesis); expert identities.

The output is an ordinary trace (:class:`pybmoe.routing.trace.Trace`): ``workloads`` workloads of
``steps`` tokens each (default one, ``synth``), each token its own ubatch, ``hit`` = -1, each
workload from an empty stack. Written as the engine's ``--moe-trace`` CSV (or Parquet), so
``--moe-route-replay`` and ``pybmoe simulate`` read it.

Errors: :class:`ValueError` for bad arguments or a source with no decode rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from . import trace as tr

COLD = -1


@dataclass(frozen=True)
class LayerModel:
    """The fitted statistics of one layer.

    ``distances``: int64 [lookups] of stack depths (``COLD`` = -1 for a first use);
    ``step_distances``: int64 [tokens, k], the same per source token in rank order;
    ``step_depth``: int64 [tokens], the length of the stack before the token (distinct experts
    seen so far in its workload); ``step_next``: int64 [tokens], the index of the workload's next
    token (-1 at its end); ``popularity``: float64 [n_expert], selection probabilities (sum 1).
    """

    layer: int
    distances: np.ndarray
    step_distances: np.ndarray
    step_depth: np.ndarray
    step_next: np.ndarray
    popularity: np.ndarray


def _steps(frame: pd.DataFrame) -> list[tuple[int, list[np.ndarray]]]:
    """Per layer, the list over (workload, token) of the selected experts in rank order; a
    workload boundary is marked by an empty array."""
    f = frame.sort_values(["layer", "workload", "token", "rank"], kind="stable")
    out = []
    for layer, g in f.groupby("layer", sort=True, observed=True):
        seq: list[np.ndarray] = []
        for _, w in g.groupby("workload", sort=False, observed=True):
            seq.append(np.empty(0, dtype=np.int64))
            e = w["expert"].to_numpy().astype(np.int64)
            t = w["token"].to_numpy()
            cut = np.flatnonzero(np.diff(t)) + 1
            seq.extend(np.split(e, cut))
        out.append((int(layer), seq))
    return out


def stack_distances(steps: Sequence[np.ndarray], depth: list[int] | None = None) -> np.ndarray:
    """Stack distance of every lookup of one layer's steps (see the module docstring).

    ``steps``: expert ids per token in rank order; an empty array resets the stack (a new
    workload). Returns int64 [lookups], ``COLD`` (-1) for a first use. When ``depth`` is a list,
    the stack's length before each token is appended to it.
    """
    out: list[int] = []
    stack: list[int] = []          # most recent first
    for ids in steps:
        if len(ids) == 0:
            stack = []
            continue
        if depth is not None:
            depth.append(len(stack))
        pos = {e: i for i, e in enumerate(stack)}
        out.extend(pos.get(int(e), COLD) for e in ids)
        seen = list(dict.fromkeys(int(e) for e in ids))
        stack = seen + [e for e in stack if e not in set(seen)]
    return np.asarray(out, dtype=np.int64)


def fit(source: tr.Trace, *, phase: str = "decode") -> list[LayerModel]:
    """The per-layer statistics of ``source``'s ``phase`` rows (default decode).

    Raises :class:`ValueError` when the phase has no rows.
    """
    t = source.select(phase)
    if len(t.frame) == 0:
        raise ValueError(f"{source.source or 'trace'} has no {phase} rows; accepted: a trace with {phase} lookups")
    n_expert = source.meta.n_expert
    models = []
    for layer, seq in _steps(t.frame):
        depth: list[int] = []
        d = stack_distances(seq, depth)
        ids = np.concatenate([s for s in seq if len(s)])
        k = source.meta.n_expert_used
        if len(d) % k or any(len(s) not in (0, k) for s in seq):
            raise ValueError(f"layer {layer}: a token has other than top-k={k} lookups; accepted: k lookups per "
                             "token and layer")
        pop = np.bincount(ids, minlength=n_expert).astype(np.float64) + 0.5
        lens = [len(s) for s in seq]
        nxt = []                   # the next token of the same workload, -1 at a workload's end
        i = 0
        for j, n in enumerate(lens):
            if n == 0:
                continue
            nxt.append(i + 1 if j + 1 < len(lens) and lens[j + 1] else -1)
            i += 1
        models.append(LayerModel(layer, d, d.reshape(-1, k), np.asarray(depth, dtype=np.int64),
                                 np.asarray(nxt, dtype=np.int64), pop / pop.sum()))
    return models


def _sample_layer(m: LayerModel, steps: int, k: int, rng: np.random.Generator, block: float) -> np.ndarray:
    """``int [steps, k]`` of expert ids for one layer of one workload (empty stack at the start)."""
    n_expert = len(m.popularity)
    u = rng.random(steps)
    jump = rng.random(steps) < 1.0 / block
    by_depth = np.argsort(m.step_depth, kind="stable")
    depth_sorted = m.step_depth[by_depth]
    cur = -1
    finite = m.distances[m.distances != COLD]
    deep = max(k, int(np.percentile(finite, 90))) if len(finite) else k
    out = np.empty((steps, k), dtype=np.int64)
    stack: list[int] = []
    in_stack = np.zeros(n_expert, dtype=bool)
    for s in range(steps):
        # continue the source token run, or (probability 1/block, or at its end) jump to a source
        # token whose stack was no longer than ours, so that all its depths exist here
        cur = int(m.step_next[cur]) if cur >= 0 else -1
        if cur < 0 or jump[s] or m.step_depth[cur] > len(stack):
            n_ok = max(int(np.searchsorted(depth_sorted, len(stack), side="right")), 1)
            cur = int(by_depth[int(u[s] * n_ok)])
        v = m.step_distances[cur]
        chosen = [-1] * k
        used = np.zeros(n_expert, dtype=bool)
        for r, d in enumerate(v):            # reuses first: the depths of one source token are distinct
            if d != COLD and d < len(stack):
                chosen[r] = stack[d]
                used[stack[d]] = True
        for r, d in enumerate(v):            # then the fresh draws, by popularity
            if chosen[r] >= 0:
                continue
            cand = ~used & ~in_stack
            if not cand.any():
                cand = np.zeros(n_expert, dtype=bool)
                cand[stack[deep:]] = True
                cand &= ~used
                if not cand.any():
                    cand = ~used
            p = np.where(cand, m.popularity, 0.0)
            pick = int(rng.choice(n_expert, p=p / p.sum()))
            chosen[r] = pick
            used[pick] = True
        out[s] = chosen
        in_stack[chosen] = True
        stack = list(dict.fromkeys(chosen)) + [e for e in stack if not used[e]]
    return out


def map_layer(m: LayerModel, k: int, n_expert: int, scale: float, rng: np.random.Generator) -> LayerModel:
    """``m`` mapped onto a layer of ``n_expert`` experts with stack distances scaled by ``scale``
    (see the module docstring, "Another model's shape"). ``k`` is the top-k of ``m``'s tokens."""
    d = m.step_distances.astype(np.float64)
    warm = d != COLD
    u = rng.random(d.shape)
    nd = np.where(warm, np.floor((d + u) * scale), COLD).astype(np.int64)
    # keep a token's depths distinct: walk its warm depths in ascending order, each at least one
    # more than the previous
    order = np.argsort(np.where(warm, nd, np.iinfo(np.int64).max), axis=1, kind="stable")
    rows = np.arange(len(nd))[:, None]
    srt = nd[rows, order]
    wsrt = warm[rows, order]
    for j in range(1, k):
        bump = wsrt[:, j] & wsrt[:, j - 1] & (srt[:, j] <= srt[:, j - 1])
        srt[bump, j] = srt[bump, j - 1] + 1
    nd[rows, order] = srt
    n_src = len(m.popularity)
    src_of = (np.arange(n_expert) * n_src) // n_expert         # target expert -> source expert
    share = m.popularity[src_of] / np.bincount(src_of, minlength=n_src)[src_of]
    pop = share[rng.permutation(n_expert)]
    depth = np.floor(m.step_depth * scale).astype(np.int64)
    return LayerModel(m.layer, nd.ravel(), nd, depth, m.step_next, pop / pop.sum())


def synthesize(source: tr.Trace, steps: int, *, seed: int = 0, workloads: int = 1, name: str = "synth",
               phase: str = "decode", block: float = 16.0, n_layer: int | None = None,
               n_expert: int | None = None, top_k: int | None = None,
               distance_scale: float | None = None) -> tr.Trace:
    """A synthetic decode trace of ``workloads`` × ``steps`` tokens with ``source``'s per-layer
    reuse (see the module docstring for what is and is not preserved).

    ``steps`` tokens per workload (each its own ubatch), ``seed`` for ``numpy.random.default_rng``
    (same arguments, same trace), workloads named ``name`` (one) or ``name-0``, ``name-1``, ...;
    ``block``: mean tokens per run of consecutive source tokens (>= 1; 1 = every token drawn
    independently).
    ``n_layer``, ``n_expert``, ``top_k``, ``distance_scale``: write the trace for another model's
    shape (module docstring, "Another model's shape"); each defaults to the source's (the scale
    to ``n_expert / n_expert_src``). Without any of them the output is the plain synthesis.
    Raises :class:`ValueError` for ``steps`` or ``workloads`` < 1, a source without rows of
    ``phase``, ``top_k`` above the source's or above ``n_expert``, ``n_layer`` or ``n_expert``
    out of range, or ``distance_scale`` <= 0.
    """
    for label, v in (("steps", steps), ("workloads", workloads)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{label}={v!r} must be an integer >= 1")
    if not block >= 1:
        raise ValueError(f"block={block!r} must be >= 1 (mean tokens per run of source tokens)")
    mapped = any(v is not None for v in (n_layer, n_expert, top_k, distance_scale))
    k = source.meta.n_expert_used
    src_experts = source.meta.n_expert
    if mapped:
        n_expert = src_experts if n_expert is None else n_expert
        top_k = k if top_k is None else top_k
        for label, v, lo, hi in (("n_layer", n_layer, 1, 512), ("n_expert", n_expert, 2, 1024),
                                 ("top_k", top_k, 1, min(k, n_expert))):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                why = (f" (the source's top-k is {k}: it has no rows for more ranks)" if label == "top_k" and v > k
                       else "")
                raise ValueError(f"{label}={v!r} is out of range{why}; accepted: {lo} .. {hi}")
        if distance_scale is None:
            distance_scale = n_expert / src_experts
        if not distance_scale > 0:
            raise ValueError(f"distance_scale={distance_scale!r} must be > 0")
        if top_k < k:
            f = source.frame
            source = tr.from_frame(f[f["rank"] < top_k].reset_index(drop=True),
                                   tr.TraceMeta(source.meta.n_layer, src_experts, top_k), source.source)
            k = top_k
    fitted = fit(source, phase=phase)
    rng = np.random.default_rng(seed)
    if mapped:
        n_out = len(fitted) if n_layer is None else n_layer
        fitted = [map_layer(fitted[i % len(fitted)], k, n_expert, distance_scale, rng) for i in range(n_out)]
        layer_ids = np.arange(n_out)
    else:
        layer_ids = np.array([m.layer for m in fitted])
    frames = []
    for w in range(workloads):
        wname = name if workloads == 1 else f"{name}-{w}"
        per_layer = [_sample_layer(m, steps, k, rng, block) for m in fitted]
        e = np.stack(per_layer, axis=1)                              # [steps, layers, k]
        tok, li, rnk = np.meshgrid(np.arange(steps), np.arange(len(fitted)), np.arange(k), indexing="ij")
        layers = layer_ids
        frames.append(pd.DataFrame({"workload": wname, "phase": "decode", "ubatch": tok.ravel(),
                                    "token": tok.ravel(), "layer": layers[li.ravel()], "rank": rnk.ravel(),
                                    "expert": e.ravel(), "hit": -1}))
    extra = {"synth_from": Path(source.source).name or "trace", "synth_seed": str(seed)}
    if mapped:
        extra.update(synth_map_from=f"L{source.meta.n_layer}xE{src_experts}xK{source.meta.n_expert_used}",
                     synth_distance_scale=f"{distance_scale:g}")
        meta = tr.TraceMeta(int(layer_ids.max()) + 1, n_expert, k, extra=extra)
    else:
        meta = tr.TraceMeta(source.meta.n_layer, source.meta.n_expert, k, extra=extra)
    return tr.from_frame(pd.concat(frames, ignore_index=True), meta, f"synth({source.source})")


def uniform(steps: int, *, n_layer: int, n_expert: int, top_k: int, seed: int = 0, name: str = "uniform") -> tr.Trace:
    """A decode trace of ``steps`` tokens whose every (token, layer) picks ``top_k`` distinct experts
    uniformly at random out of ``n_expert``: no locality at all, the worst case for any cache (an
    LRU of B of the n_layer * n_expert entries hits B / (n_layer * n_expert) of its lookups).

    Raises :class:`ValueError` for ``steps`` < 1 or ``n_layer``, ``n_expert``, ``top_k`` out of range
    (1 .. 512 layers, 2 .. 1024 experts, 1 .. n_expert).
    """
    for label, v, lo, hi in (("steps", steps, 1, 1 << 30), ("n_layer", n_layer, 1, 512),
                             ("n_expert", n_expert, 2, 1024), ("top_k", top_k, 1, n_expert)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
            raise ValueError(f"{label}={v!r} is out of range; accepted: {lo} .. {hi}")
    rng = np.random.default_rng(seed)
    # argsort of uniform keys: top_k distinct experts per (token, layer), in random rank order
    e = np.argsort(rng.random((steps, n_layer, n_expert)), axis=2)[:, :, :top_k]
    tok, li, rnk = np.meshgrid(np.arange(steps), np.arange(n_layer), np.arange(top_k), indexing="ij")
    frame = pd.DataFrame({"workload": name, "phase": "decode", "ubatch": tok.ravel(), "token": tok.ravel(),
                          "layer": li.ravel(), "rank": rnk.ravel(), "expert": e.ravel(), "hit": -1})
    meta = tr.TraceMeta(n_layer, n_expert, top_k, extra={"synth_uniform": "1", "synth_seed": str(seed)})
    return tr.from_frame(frame, meta, f"uniform(L{n_layer}xE{n_expert}xK{top_k})")
