"""Replay of expert-cache policies over a routing trace (:mod:`pybmoe.routing.trace`).

Policies (:data:`POLICIES`; the rules are spelled out in ``docs/traces.md``):

``layer-lru``
    The engine's own policy, exactly (``docs/expert-cache.md``, "The policy, exactly"): per
    layer, ``slots`` residents, misses uploaded into staging slots and resident two steps later,
    admission evicting argmin ``(used, expert id)`` among residents not used at the last step,
    the insert cap. A step is a ubatch the engine's cache serves: one of at most ``max_batch``
    tokens (1 today), whatever its phase label. Other ubatches (prefill) are not served: their
    lookups are ``-1`` per lookup, count as misses when their phase is counted, and leave the
    cache as it is, except that pending uploads become resident after them as after any ubatch,
    as in the engine. :func:`engine_replay` and :func:`compare_with_engine` check a captured
    trace event for event against the engine's ``hit`` column. An admission rule (``admit``,
    :data:`ADMISSIONS`) decides which misses are uploaded: ``always`` (the engine today) or
    ``second-miss`` (only an expert that also missed within the last ``admit_window`` steps of
    its layer; a what-if, not in the engine yet).
``global-lru``, ``global-lru-scan``, ``fifo``, ``lfu``, ``belady``
    One cache of ``budget_entries`` (layer, expert) entries shared by all layers. The admission
    unit is a layer step (one layer's lookups in one ubatch): its lookups see the cache as it was
    before the step, then its missed entries are admitted at once (no upload lag) in order of
    first appearance, evicting the policy's victim among the entries the step does not need. With
    no such entry the miss is not admitted. Victims: least recently needed / first admitted /
    fewest steps needed since admission / needed furthest in the future (the incoming entry is
    itself a candidate: it is bypassed when it is needed no sooner than every victim). Ties go to
    the lowest (layer, expert). ``global-lru`` is the engine's stream tier with its scan guard off,
    exactly (``--moe-stream-cache-mb``): its recency is per lookup, in router rank order (token-major,
    rank-minor), so a step's hits and admissions become the most recent entries in the order the
    router ranked them, and there are no ties; the tier runs it with
    ``PYBMOE_MOE_STREAM_POLICY=global-lru``. ``global-lru-scan`` is the tier at its defaults: the
    same, but a step that wants at least half of its layer's experts and whose distinct entries
    times the trace's layers exceed ``budget_entries`` (a scan, such as a prefill's: a pass of such
    steps would flush the cache) admits its misses at the least recent end, each below the last,
    and its repeated lookups do not move them; its hits of entries resident before it become the
    most recent as in ``global-lru``. The tier's prefetch window is lent to decode
    (``lend_entries``, :func:`simulate`): a step that wants less than half of its layer holds up to
    ``budget_entries`` plus the window; one that wants half or more first evicts down to
    ``budget_entries``.
``pool``, ``pool-global``, ``pool-classlru``, ``classlru``
    One bank of ``budget_entries`` slots over the (layer, expert) entries of all layers (the VRAM
    tier's pool per device, docs/expert-cache.md, "The pool"). ``pool`` is its default structure,
    exactly as the engine is to run it: the engine's timing (a served ubatch's lookups see the
    residents as published before it; right after each ubatch the uploads scheduled after the
    previous one settle, a full bank evicting argmin ``(used step, layer, expert)`` among the
    residents not selected at the last served step, then the ubatch's distinct misses are
    scheduled, so a miss at step s is resident from s + 2), with the ``floor-half-k`` guard (a miss
    may evict only its own layer's entries or those of a layer holding more than ``min(top_k,
    budget // n_layer) // 2``; a layer under that floor takes one from a layer over it even if it
    was selected at the last step). ``pool-global``: the same with no guard; ``pool-classlru``: the
    pool with ClassLRU's victim (upstream llama.cpp b12170: the largest age / 2**class, see
    :data:`CRF_HALF_LIFE`); ``classlru``: upstream's cache as published (one bank, no guard,
    ClassLRU, misses uploaded before the layer runs: the ``instant`` timing, admitted per layer step
    as the global policies). ``guard=`` and ``timing=`` (:data:`POOL_GUARDS`,
    :data:`POOL_TIMINGS`) replay the other variants; unguarded and instant, the pool is
    ``global-lru``; partitioned (one-token steps), it is ``layer-lru``.
``static``
    The ``budget_entries`` most looked-up entries of each workload (in the replayed phase,
    learned in sample: an upper bound for static pinning) are pinned from the start; nothing else
    is ever resident.

Each workload replays from a cold cache. ``phase`` selects which lookups are counted (and, for
the global and static policies, which lookups are replayed at all).

Budgets (exactly one): ``slots_per_layer`` N, ``budget_entries`` N, ``fraction`` F of all
(layer, expert) entries, or ``mib`` M with the bytes of one expert (``expert_bytes``, or read
from a GGUF ``model``). ``layer-lru`` gets ``budget_entries // n_layer`` slots per layer;
results report the effective budget.

The replay runs in one implementation, the compiled core (``_simcore.c``, built and installed
next to this module by ``pip install .``, loaded with ctypes; :func:`core_path` says where it is
looked for), at tens of millions of lookups per second. The tests hold it, event for event, to
an oracle that states each policy plainly in Python (``tests/routing/lru_oracle.py``), and the
engine's own cache to the replay.

Errors: :class:`PolicyError`, :class:`BudgetError` (both :class:`ValueError`) name the bad value
and the accepted range; :class:`CoreError` (an :class:`OSError`) says why the compiled core is not
there and how to build it.
"""
from __future__ import annotations

import ctypes
import math
import os
import sysconfig
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from . import trace as tr

POLICIES = ("layer-lru", "pool", "pool-global", "pool-classlru", "classlru", "global-lru", "global-lru-scan",
            "fifo", "lfu", "belady", "static")
#: The guards of the pool (``guard=``): which entries a miss may evict (docs/expert-cache.md, "The pool").
#: ``none``: any; ``floor-half-k`` (the default): an entry of its own layer, or of a layer holding more
#: than ``min(top_k, budget // n_layer) // 2`` entries (the floor), and a layer under its floor takes
#: one from a layer over it even if that entry was selected at the last step; ``floor-k`` and
#: ``floor-share``: likewise with a floor of ``min(top_k, budget // n_layer)`` and ``budget // n_layer``;
#: ``partition``: only its own layer's, each layer holding ``budget // n_layer`` (per-layer slots).
POOL_GUARDS = ("none", "floor-half-k", "floor-k", "floor-share", "partition")
#: When a miss becomes resident (``timing=``): ``sync``, the engine's (a miss at step s is resident
#: from s + 2; uploads settle after each ubatch); ``instant``, upstream's (uploaded before the layer runs).
POOL_TIMINGS = ("sync", "instant")
#: The pool's eviction orders: ``lru`` (least recently used step, then the lowest entry) and
#: ``classlru`` (upstream b12170's: the largest age / 2**class, see :data:`CRF_HALF_LIFE`).
POOL_KEYS = ("lru", "classlru")
#: The pool policies: (timing, eviction order, guard). ``pool`` is the default structure of the VRAM
#: tier's pool (see docs/benchmarks/vram-pool-sim/ for why), ``pool-global`` the same bank with no
#: guard (one LRU over all (layer, expert) entries), ``pool-classlru`` the pool with ClassLRU's order,
#: ``classlru`` upstream llama.cpp's cache since b12170 as far as its rule is published (one bank,
#: instant uploads, no guard).
POOL_POLICIES = {"pool": ("sync", "lru", "floor-half-k"), "pool-global": ("sync", "lru", "none"),
                 "pool-classlru": ("sync", "classlru", "floor-half-k"), "classlru": ("instant", "classlru", "none")}
#: The stream tier's policy at its defaults (``--moe-stream-cache-mb``; ``PYBMOE_MOE_STREAM_POLICY``
#: selects ``global-lru`` instead).
STREAM_POLICY = "global-lru-scan"
BUDGET_KINDS = ("slots_per_layer", "budget_entries", "fraction", "mib")
#: Accepted values of ``backend=`` (``--backend``): both name the compiled core, the one replay
#: implementation; ``"c"`` is kept for the callers that name it.
BACKENDS = ("auto", "c")
#: Admission rules of ``layer-lru`` (``admit=``): ``always`` uploads every miss (the engine today);
#: ``second-miss`` uploads a miss only when the same expert also missed within the last
#: ``admit_window`` steps of its layer.
ADMISSIONS = ("always", "second-miss")
#: The default ``admit_window`` of ``second-miss``, in steps (served ubatches) of the layer: the engine's
#: (llama-moe.h's LLAMA_MOE_CACHE_ADMIT_WINDOW_DEFAULT, which tests/build/test_abi.py holds this copy to).
DEFAULT_ADMIT_WINDOW = LLAMA_MOE_CACHE_ADMIT_WINDOW_DEFAULT = 4
_GLOBAL_CODE = {"global-lru": 0, "fifo": 1, "lfu": 2, "belady": 3, "global-lru-scan": 4}
_SERVED, _RESET, _STEP = 1, 2, 4
#: Columns of the per-workload summary (and of ``--csv``), in order.
SUMMARY_COLUMNS = ("workload", "policy", "phase", "budget_entries", "slots_per_layer", "inserts", "admit",
                   "admit_window", "accesses", "hits", "misses", "hit_rate", "tokens", "uploads", "wasted",
                   "overlap", "reach_tokens")


class PolicyError(ValueError):
    """An unknown policy or backend name."""


class BudgetError(ValueError):
    """A budget that is missing, given twice, negative or out of range."""


# --------------------------------------------------------------------------- the compiled core

#: The version of ``_simcore.c`` this module calls (``pybmoe_simcore_version``).
CORE_VERSION = 6
_BUILD_HINT = ("it is built by `pip install .`; in a source checkout, build it with "
               "`gcc -O2 -shared -fPIC -o pybmoe/routing/_simcore.so pybmoe/routing/_simcore.c` "
               "or set PYBMOE_SIMCORE to a built one")
_core: ctypes.CDLL | None | bool = None     # None: not tried yet; False: tried, see _core_error
_core_error = ""


class CoreError(OSError):
    """The compiled replay core is missing, does not load, or is of another version; the message
    says which, and how to build it."""


def core_path() -> Path | None:
    """Where the compiled core is: ``$PYBMOE_SIMCORE`` if set, else ``_simcore.so`` (or the
    platform's name) next to this module, else in the installed pybmoe (when this module is
    imported from a source checkout); None when there is none."""
    env = os.environ.get("PYBMOE_SIMCORE")
    if env:
        return Path(env) if Path(env).is_file() else None
    for d in _core_dirs():
        for name in ("_simcore.so", "lib_simcore.so", "_simcore.dylib", "_simcore.dll"):
            if (d / name).is_file():
                return d / name
    return None


def _core_dirs() -> tuple[Path, Path]:
    return Path(__file__).resolve().parent, Path(sysconfig.get_paths()["platlib"]) / "pybmoe" / "routing"


def load_core(path: str | os.PathLike | None = None) -> bool:
    """(Re)load the compiled core from ``path`` (default :func:`core_path`); True when it loaded.

    A library that is missing, does not load, or is not of :data:`CORE_VERSION` is not used: the
    replay then raises :class:`CoreError` with the reason.
    """
    global _core, _core_error
    _core = False
    p = Path(path) if path is not None else core_path()
    if p is None or not p.is_file():
        env = os.environ.get("PYBMOE_SIMCORE")
        where = (f"$PYBMOE_SIMCORE={env} is not a file" if path is None and env
                 else f"{p} is not a file" if p is not None
                 else "no _simcore.so in " + " or ".join(str(d) for d in dict.fromkeys(_core_dirs())))
        _core_error = f"the compiled replay core is missing ({where}); {_BUILD_HINT}"
        return False
    try:
        lib = ctypes.CDLL(str(p))
        lib.pybmoe_simcore_version.restype = ctypes.c_int32
        version = lib.pybmoe_simcore_version()
    except (OSError, AttributeError) as e:
        _core_error = f"the compiled replay core {p} does not load ({e}); {_BUILD_HINT}"
        return False
    if version != CORE_VERSION:
        _core_error = (f"the compiled replay core {p} is version {version}, this module needs {CORE_VERSION}; "
                       f"rebuild it: {_BUILD_HINT}")
        return False
    i64p = np.ctypeslib.ndpointer(np.int64, flags="C")
    u8p = np.ctypeslib.ndpointer(np.uint8, flags="C")
    i32p = np.ctypeslib.ndpointer(np.int32, flags="C")
    i8p = np.ctypeslib.ndpointer(np.int8, flags="C")
    lib.pybmoe_sim_layer_lru_admit.argtypes = [ctypes.c_int64, i64p, u8p, i32p, ctypes.c_int32, ctypes.c_int32,
                                               ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, i8p, i64p]
    lib.pybmoe_sim_layer_lru_admit.restype = ctypes.c_int32
    lib.pybmoe_sim_global.argtypes = [ctypes.c_int32, ctypes.c_int64, i64p, u8p, i32p, ctypes.c_int32,
                                      ctypes.c_int64, ctypes.c_int32, ctypes.c_int64, i8p, i64p]
    lib.pybmoe_sim_global.restype = ctypes.c_int32
    lib.pybmoe_sim_pool.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, i64p, u8p, i32p, i32p,
                                    ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                                    ctypes.c_int64, i8p, i64p]
    lib.pybmoe_sim_pool.restype = ctypes.c_int32
    lib.pybmoe_sim_crf_decay.argtypes = [ctypes.c_int32]
    lib.pybmoe_sim_crf_decay.restype = ctypes.c_uint32
    _core = lib
    _core_error = ""
    return True


def _load_core() -> ctypes.CDLL | None:
    if _core is None:
        load_core()
    return _core or None


def have_core() -> bool:
    """Whether the compiled replay core was found and loads."""
    return _load_core() is not None


def require_core() -> ctypes.CDLL:
    """The loaded core (loading it on the first call); raises :class:`CoreError`, saying why and how
    to build it, when there is none."""
    lib = _load_core()
    if lib is None:
        raise CoreError(_core_error)
    return lib


def _check_backend(backend: str) -> None:
    if backend == "python":
        raise PolicyError("backend 'python': the pure-Python replay was removed, the compiled core is the only "
                          f"one; accepted: {', '.join(BACKENDS)}")
    if backend not in BACKENDS:
        raise PolicyError(f"backend {backend!r}; accepted: {', '.join(BACKENDS)}")


# --------------------------------------------------------------------------- the pool

#: ClassLRU's CRF (combined recency and frequency), as upstream llama.cpp b12170 (PR #31233) states
#: it: each use of an entry adds 1, the sum decays with a half-life of :data:`CRF_HALF_LIFE` tokens and
#: is kept across evictions; its class is ``floor(log2(CRF))``, at most ``CRF_CLASSES - 1``. The core
#: keeps the CRF in fixed point with :data:`CRF_FRAC_BITS` fraction bits (its ``SIM_CRF_*`` constants),
#: so that the core and the tests' oracle compute the same classes.
CRF_HALF_LIFE = 128
CRF_CLASSES = 8
CRF_FRAC_BITS = 24


# --------------------------------------------------------------------------- prepared streams

@dataclass(frozen=True)
class _Units:
    """Events in replay order, cut into units (one layer's lookups in one ubatch)."""

    rows: np.ndarray     # int64 [events] frame row of each event
    ids: np.ndarray      # int32 [events] expert (layer-lru) or (layer, expert) entry (global)
    start: np.ndarray    # int64 [units + 1]
    flags: np.ndarray    # uint8 [units] _SERVED | _RESET (| _STEP: the pool's, a unit that begins a ubatch)
    wl_units: np.ndarray  # int64 [workloads + 1] first unit of each workload
    tokens: np.ndarray | None = None  # int32 [units] tokens of the unit's ubatch (the pool's)
    parts: list = field(default_factory=list, compare=False, repr=False)  # _parts(), filled once


def _argsort_keys(keys: tuple[np.ndarray, ...]) -> np.ndarray:
    """``np.lexsort(keys)`` (last key most significant), through one int64 composite key when it fits."""
    if not len(keys[0]):
        return np.zeros(0, dtype=np.int64)
    span = [int(k.max()) + 1 for k in keys]
    if all(int(k.min()) >= 0 for k in keys) and math.prod(span) < 2**62:
        comp = np.zeros(len(keys[0]), dtype=np.int64)
        for k, n in zip(reversed(keys), reversed(span)):
            comp *= n
            comp += k
        return np.argsort(comp, kind="stable")
    return np.lexsort(keys)


class Replay:
    """A trace prepared for replay: codes, sort orders and unit boundaries, computed once.

    ``n_layer`` is the number of distinct layers in the trace (the cached layers), ``n_expert``
    and ``top_k`` come from the trace meta.
    """

    def __init__(self, trace: tr.Trace):
        self.trace = trace
        f = trace.frame
        self.n_rows = len(f)
        wl = f["workload"]
        if not isinstance(wl.dtype, pd.CategoricalDtype):
            wl = pd.Series(tr._categorical(wl))
        cats = wl.cat.remove_unused_categories()
        self.wl = np.asarray(cats.cat.codes, dtype=np.int64)
        self.workloads = [str(c) for c in cats.cat.categories]
        layers = f["layer"].to_numpy()
        present = np.zeros(int(layers.max()) + 1 if len(layers) else 1, dtype=bool)
        present[layers] = True
        self.layer_ids = np.flatnonzero(present)
        lut = np.cumsum(present) - 1
        self.lay = lut[layers].astype(np.int64)
        self.n_layer = len(self.layer_ids)
        self.n_expert = trace.meta.n_expert
        self.top_k = trace.meta.n_expert_used
        self.expert = f["expert"].to_numpy().astype(np.int64)
        self.ubatch = f["ubatch"].to_numpy().astype(np.int64)
        self.token = f["token"].to_numpy().astype(np.int64)
        self.rank = f["rank"].to_numpy().astype(np.int64)
        ph = f["phase"]
        if isinstance(ph.dtype, pd.CategoricalDtype) and list(ph.cat.categories) == list(tr.PHASES):
            self.phase_code = np.asarray(ph.cat.codes, dtype=np.int8)
        else:
            self.phase_code = np.select([ph.to_numpy() == p for p in tr.PHASES], [0, 1], -1).astype(np.int8)
        self._cache: dict = {}

    @property
    def n_entries(self) -> int:
        """(layer, expert) entries of the trace: ``n_layer * n_expert``."""
        return self.n_layer * self.n_expert

    def mask(self, phase: str) -> np.ndarray:
        """Rows counted for ``phase`` (bool ``[rows]``)."""
        if phase not in tr.PHASE_CHOICES:
            raise PolicyError(f"phase {phase!r}; accepted: {', '.join(tr.PHASE_CHOICES)}")
        key = ("mask", phase)
        if key not in self._cache:
            self._cache[key] = (np.ones(self.n_rows, dtype=bool) if phase == "all"
                                else self.phase_code == tr.PHASES.index(phase))
        return self._cache[key]

    def accesses(self, phase: str) -> np.ndarray:
        """Per workload: the rows counted for ``phase`` (int64 ``[workloads]``)."""
        key = ("acc", phase)
        if key not in self._cache:
            self._cache[key] = np.bincount(self.wl[self.mask(phase)], minlength=len(self.workloads)).astype(np.int64)
        return self._cache[key]

    def counted_events(self, max_batch: int, phase: str) -> np.ndarray | None:
        """:meth:`mask` in the event order of :meth:`layer_units` (None for ``all``: every event)."""
        if phase == "all":
            return None
        key = ("cev", max_batch, phase)
        if key not in self._cache:
            self._cache[key] = self.mask(phase)[self.layer_units(max_batch).rows]
        return self._cache[key]

    def static_counts(self, phase: str) -> list[tuple[np.ndarray, np.ndarray, slice | np.ndarray, np.ndarray]]:
        """Per workload, for the static policy: ``(counts, order, rows, entries)``: the lookups of
        each (layer, expert) entry among the rows of ``phase``, the entries by count (most first;
        ties: the lower entry), those rows (a slice when they are contiguous) and their entries."""
        key = ("static", phase)
        if key not in self._cache:
            rows = np.flatnonzero(self.mask(phase))
            wl = self.wl[rows]
            if len(wl) > 1 and not bool((wl[1:] >= wl[:-1]).all()):
                rows = rows[np.argsort(wl, kind="stable")]
                wl = self.wl[rows]
            bounds = np.searchsorted(wl, np.arange(len(self.workloads) + 1))
            res = []
            for w in range(len(self.workloads)):
                r = rows[bounds[w]:bounds[w + 1]]
                ent = (self.lay[r] * self.n_expert + self.expert[r]).astype(np.int32)
                c = np.bincount(ent, minlength=self.n_entries)
                if len(r) and int(r[-1]) - int(r[0]) == len(r) - 1:   # increasing and unique: a run
                    r = slice(int(r[0]), int(r[0]) + len(r))
                res.append((c, np.argsort(-c, kind="stable"), r, ent))
            self._cache[key] = res
        return self._cache[key]

    def ubatches(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (workload, ubatch) pairs: ``(workload [U], index per row [rows], tokens [U])``,
        sorted by workload then ubatch; ``tokens`` counts the distinct tokens of each."""
        if "ub" not in self._cache:
            UB = int(self.ubatch.max()) + 1
            T = int(self.token.max()) + 1
            ub_key = self.wl * UB + self.ubatch
            keys, idx = np.unique(ub_key, return_inverse=True)
            pairs = np.unique(ub_key * T + self.token)                 # distinct (ubatch, token)
            tokens = np.bincount(np.searchsorted(keys, pairs // T), minlength=len(keys))
            self._cache["ub"] = (keys // UB, idx.astype(np.int64), tokens)
        return self._cache["ub"]

    def restrict(self, rows: np.ndarray) -> "Replay":
        """A :class:`Replay` of the rows ``rows`` (bool ``[rows]``) of this trace, say one bank's layers,
        whose ubatches keep the token counts they have here: a ubatch is served by its tokens over every
        layer (a prompt ubatch's last layer routes only its output row, and the engine served none of it)."""
        sub = Replay(tr.Trace(self.trace.frame.loc[rows].reset_index(drop=True), self.trace.meta, self.trace.source))
        _, ub_idx, ub_tokens = self.ubatches()
        uniq, inv = np.unique(ub_idx[rows], return_inverse=True)
        first = np.empty(len(uniq), dtype=np.int64)
        first[inv[::-1]] = np.arange(len(inv))[::-1]                   # a row of each ubatch
        sub._cache["ub"] = (sub.wl[first], inv.astype(np.int64), ub_tokens[uniq])
        return sub

    def tokens(self, phase: str) -> np.ndarray:
        """Per workload: the distinct tokens with lookups in ``phase`` (int64 ``[workloads]``)."""
        key = ("tokens", phase)
        if key not in self._cache:
            m = self.mask(phase)
            T = int(self.token.max()) + 1
            uniq = np.unique(self.wl[m] * T + self.token[m])
            self._cache[key] = np.bincount(uniq // T, minlength=len(self.workloads))
        return self._cache[key]

    def _units(self, rows: np.ndarray, order_keys: tuple, unit_keys: tuple, stream_keys: tuple,
               ids: np.ndarray) -> _Units:
        order = rows[_argsort_keys(tuple(k[rows] for k in order_keys))]
        n = len(order)
        if n == 0:
            return _Units(order, ids[order].astype(np.int32), np.zeros(1, np.int64), np.zeros(0, np.uint8),
                          np.zeros(len(self.workloads) + 1, np.int64))

        def changed(keys: tuple) -> np.ndarray:
            ch = np.zeros(n, dtype=bool)
            ch[0] = True
            for k in keys:
                v = k[order]
                ch[1:] |= v[1:] != v[:-1]
            return ch

        unit_first = np.flatnonzero(changed(unit_keys))
        stream_new = changed(stream_keys)[unit_first]
        flags = np.where(stream_new, _RESET | _SERVED, _SERVED).astype(np.uint8)
        start = np.append(unit_first, n).astype(np.int64)
        wl_of_unit = self.wl[order[unit_first]]
        wl_units = np.searchsorted(wl_of_unit, np.arange(len(self.workloads) + 1), side="left").astype(np.int64)
        return _Units(order, np.ascontiguousarray(ids[order], dtype=np.int32), start, flags, wl_units)

    def layer_units(self, max_batch: int) -> _Units:
        """All rows in (workload, layer, ubatch, token, rank) order, with a unit for every layer
        and every ubatch of its workload (empty where the layer has no rows: the engine's
        per-ubatch bookkeeping still runs). A unit is served when it has lookups and its ubatch
        has at most ``max_batch`` tokens."""
        key = ("layer", max_batch)
        if key not in self._cache:
            ub_wl, ub_idx, ub_tokens = self.ubatches()
            W, L = len(self.workloads), self.n_layer
            n_ub = np.bincount(ub_wl, minlength=W)                     # ubatches per workload
            first_ub = np.concatenate([[0], np.cumsum(n_ub)])
            base = np.concatenate([[0], np.cumsum(n_ub * L)])          # first unit of each workload
            j = ub_idx - first_ub[self.wl]                              # ubatch position in its workload
            unit = base[self.wl] + self.lay * n_ub[self.wl] + j
            n_units = int(base[-1])
            order = _argsort_keys((self.rank, self.token, unit))
            counts = np.bincount(unit, minlength=n_units)
            start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            u_wl = np.repeat(np.arange(W), n_ub * L)
            within = np.arange(n_units) - base[u_wl]
            u_j = within % n_ub[u_wl]
            flags = np.where(u_j == 0, _RESET, 0).astype(np.uint8)
            served = (counts > 0) & (ub_tokens[first_ub[u_wl] + u_j] <= max_batch)
            flags |= np.where(served, _SERVED, 0).astype(np.uint8)
            self._cache[key] = _Units(order.astype(np.int64), np.ascontiguousarray(self.expert[order], dtype=np.int32),
                                      start, flags, base.astype(np.int64))
        return self._cache[key]

    def global_units(self, phase: str) -> _Units:
        """The rows of ``phase`` in (workload, ubatch, layer, token, rank) order, with entry ids."""
        key = ("global", phase)
        if key not in self._cache:
            rows = np.flatnonzero(self.mask(phase)).astype(np.int64)
            entry = self.lay * self.n_expert + self.expert
            self._cache[key] = self._units(rows, (self.rank, self.token, self.lay, self.ubatch, self.wl),
                                           (self.wl, self.ubatch, self.lay), (self.wl,),
                                           entry)
        return self._cache[key]

    def pool_units(self, max_batch: int, phase: str | None) -> _Units:
        """The pool's units: rows in (workload, ubatch, layer, token, rank) order with entry ids, a
        unit per layer step, ``_STEP`` on the first unit of each ubatch, ``tokens`` its token count.
        ``phase`` None: every row, a ubatch served when it has at most ``max_batch`` tokens (the sync
        timing, as layer-lru); else only the rows of ``phase``, all served (the instant timing, as the
        global policies)."""
        key = ("pool", max_batch, phase)
        if key not in self._cache:
            rows = (np.arange(self.n_rows, dtype=np.int64) if phase is None
                    else np.flatnonzero(self.mask(phase)).astype(np.int64))
            entry = self.lay * self.n_expert + self.expert
            u = self._units(rows, (self.rank, self.token, self.lay, self.ubatch, self.wl),
                            (self.wl, self.ubatch, self.lay), (self.wl,), entry)
            first = u.rows[u.start[:-1]]                               # a row of each unit
            _, ub_idx, ub_tokens = self.ubatches()
            ub = ub_idx[first]
            step = np.ones(len(first), dtype=bool)
            step[1:] = ub[1:] != ub[:-1]
            tokens = ub_tokens[ub].astype(np.int32)
            flags = (u.flags & _RESET) | np.where(step, _STEP, 0).astype(np.uint8)
            served = np.ones(len(first), dtype=bool) if phase is not None else tokens <= max_batch
            flags |= np.where(served, _SERVED, 0).astype(np.uint8)
            self._cache[key] = _Units(u.rows, u.ids, u.start, flags.astype(np.uint8), u.wl_units, tokens)
        return self._cache[key]

    def overlap(self) -> dict[str, float]:
        """Per workload: mean consecutive-token overlap of the decode rows (all rows if none)."""
        if "overlap" not in self._cache:
            m = self.mask("decode")
            if not m.any():
                m = self.mask("all")
            pairs, ov, n_lay = tr._overlap_sums(self.wl[m], self.token[m], self.lay[m], self.expert[m], self.n_expert)
            res = {}
            for w, name in enumerate(self.workloads):
                p = pairs[w * n_lay:(w + 1) * n_lay].sum()
                res[name] = float(ov[w * n_lay:(w + 1) * n_lay].sum() / p) if p else float("nan")
            self._cache["overlap"] = res
        return self._cache["overlap"]


def prepare(trace: tr.Trace | Replay) -> Replay:
    """A :class:`Replay` of ``trace`` (returned as is if it already is one)."""
    return trace if isinstance(trace, Replay) else Replay(trace)


# --------------------------------------------------------------------------- budgets

def staging_slots(slots: int, n_expert: int, top_k: int, inserts: int = 0, max_batch: int = 1) -> int:
    """The engine's staging slots per layer: ``min(inserts or k, k*T, n_expert - slots)``, T = max_batch
    (a step of T tokens uploads at most k experts unless the insert cap asks for more)."""
    kt = top_k * max_batch
    return max(0, min(inserts if inserts > 0 else top_k, kt, n_expert - slots))


def token_cycle(n_layer: int, top_k: int, n_expert: int | None = None) -> int:
    """Entries one token touches in a global cache: ``n_layer * min(top_k, n_expert)``."""
    return n_layer * (top_k if n_expert is None else min(top_k, n_expert))


def zero_hit_entries(n_layer: int, top_k: int, n_expert: int | None = None) -> int:
    """The largest global budget at which LRU (also FIFO, LFU) never hits on decode routing:
    ``(n_layer - 1) * k`` entries, where the other layers' entries of one token fill the cache."""
    return token_cycle(n_layer - 1, top_k, n_expert)


def reach_tokens(slots_per_layer: float, top_k: int, overlap: float) -> float:
    """How many tokens back a per-layer LRU of ``slots_per_layer`` still remembers:
    ``slots / (k * (1 - overlap))`` (inf when every expert repeats)."""
    new = top_k * (1.0 - overlap)
    return math.inf if new <= 0 else slots_per_layer / new


def gguf_expert_bytes(model: str | os.PathLike) -> tuple[float, int, int, int]:
    """One expert's bytes in a GGUF: ``(bytes, n_moe_layers, n_expert, top_k)``.

    Bytes are the ``*_exps.weight`` tensors of all MoE layers (up + gate + down, or the fused
    gate_up), divided by ``n_moe_layers * n_expert`` (the mean when layers differ in type). A split
    GGUF is given by its first file; every shard is read.
    Raises :class:`BudgetError` for a model without expert tensors, :class:`ValueError` for a file
    that is not GGUF or is truncated (tensor data past its end, which llama.cpp refuses to load).
    """
    from .. import models
    meta = models.read_metadata(model)
    tensors = []
    for f in models.split_files(model):
        m = meta if f == Path(model) else models.read_metadata(f)
        models.check_complete(f, m)
        tensors += m.tensors
    total, layers, n_expert = 0, set(), None
    for t in tensors:
        if not (t.name.startswith("blk.") and t.name.endswith("_exps.weight")) or len(t.shape) != 3:
            continue
        total += models.tensor_nbytes(t)
        layers.add(t.name.split(".")[1])
        n_expert = int(t.shape[2])
    if not layers:
        raise BudgetError(f"{model} has no expert tensors (blk.N.*_exps.weight); accepted: a MoE GGUF")
    kvs = meta.kvs
    arch = kvs["general.architecture"].value
    arch = arch.decode() if isinstance(arch, bytes) else str(arch)
    k = int(kvs[f"{arch}.expert_used_count"].value) if f"{arch}.expert_used_count" in kvs else 0
    return total / (len(layers) * n_expert), len(layers), int(n_expert), k


def pool_rule(policy: str, *, timing: str | None = None, guard: str | None = None) -> tuple[str, str, str]:
    """``(timing, eviction order, guard)`` of a pool policy, with ``timing`` / ``guard`` overriding
    the policy's own. Raises :class:`PolicyError` for a policy that is not a pool policy, or an
    unknown timing or guard."""
    if policy not in POOL_POLICIES:
        raise PolicyError(f"policy {policy!r} is not a pool; accepted: {', '.join(POOL_POLICIES)}")
    t, k, g = POOL_POLICIES[policy]
    t = t if timing is None else timing
    g = g if guard is None else guard
    if t not in POOL_TIMINGS:
        raise PolicyError(f"timing {t!r}; accepted: {', '.join(POOL_TIMINGS)}")
    if g not in POOL_GUARDS:
        raise PolicyError(f"guard {g!r}; accepted: {', '.join(POOL_GUARDS)}")
    return t, k, g


def guard_params(guard: str, budget_entries: int, n_layer: int, top_k: int, n_expert: int) -> tuple[int, int]:
    """The guard as ``(floor, cap)`` in entries per layer (0: none) for a pool of ``budget_entries``.

    A miss of layer l may evict an entry of layer l, or of a layer holding more than ``floor``
    entries (and, when layer l holds fewer than ``floor``, an over-floor layer's entry selected at the
    last step); a layer holding ``cap`` entries evicts its own. With ``share = budget_entries //
    n_layer``: ``floor-half-k``: ``floor = min(top_k, share) // 2``; ``floor-k``: ``floor =
    min(top_k, share)``, so under the cache cycle every layer keeps its share and above it its
    top-k; ``floor-share``: ``floor = share``; ``partition``: ``cap = min(share, n_expert)``
    (per-layer slots); ``none``: ``(0, 0)``. Raises :class:`PolicyError` for an unknown guard."""
    share = budget_entries // n_layer if n_layer else 0
    if guard == "none":
        return 0, 0
    if guard == "floor-half-k":
        return min(top_k, share) // 2, 0
    if guard == "floor-k":
        return min(top_k, share), 0
    if guard == "floor-share":
        return share, 0
    if guard == "partition":
        return 0, min(share, n_expert)
    raise PolicyError(f"guard {guard!r}; accepted: {', '.join(POOL_GUARDS)}")


def pool_staging(budget_entries: int, n_layer: int, n_expert: int, top_k: int) -> int:
    """The pool's staging slots (sync timing): uploads in flight beyond its free slots, the sum of
    the per-layer staging of today's slots without an insert cap, ``min(n_layer * min(top_k,
    n_expert), n_layer * n_expert - budget_entries)``. A one-token step's misses always fit (at most
    top-k per layer); a larger step's are scheduled in order of first appearance until they do not."""
    return max(0, min(n_layer * min(top_k, n_expert), n_layer * n_expert - budget_entries))


def resolve_budget(*, n_layer: int, n_expert: int, slots_per_layer: int | None = None,
                   budget_entries: int | None = None, fraction: float | None = None, mib: float | None = None,
                   expert_bytes: float | None = None) -> int:
    """Resolve exactly one budget to a number of (layer, expert) entries, clamped to ``n_layer * n_expert``.

    ``slots_per_layer`` N -> N * n_layer; ``budget_entries`` N -> N; ``fraction`` F in [0, 1] ->
    round(F * n_layer * n_expert); ``mib`` M (MiB, needs ``expert_bytes`` > 0) -> floor(M * 2**20 /
    expert_bytes). Raises :class:`BudgetError` when none or several are given, or a value is
    negative or out of range.
    """
    given = {k: v for k, v in (("slots_per_layer", slots_per_layer), ("budget_entries", budget_entries),
                               ("fraction", fraction), ("mib", mib)) if v is not None}
    if len(given) != 1:
        raise BudgetError(f"give exactly one budget, got {sorted(given) or 'none'}; accepted: one of "
                          f"{', '.join(BUDGET_KINDS)}")
    (kind, v), = given.items()
    total = n_layer * n_expert
    if kind == "fraction":
        if not 0.0 <= v <= 1.0:
            raise BudgetError(f"fraction {v}; accepted: 0 .. 1")
        return int(round(v * total))
    if v < 0:
        raise BudgetError(f"{kind} {v}; accepted: >= 0")
    if kind == "slots_per_layer":
        if int(v) != v:
            raise BudgetError(f"slots_per_layer {v}; accepted: an integer 0 .. {n_expert}")
        return min(int(v), n_expert) * n_layer
    if kind == "budget_entries":
        if int(v) != v:
            raise BudgetError(f"budget_entries {v}; accepted: an integer 0 .. {total}")
        return min(int(v), total)
    if not expert_bytes or expert_bytes <= 0:
        raise BudgetError(f"mib {v} needs the bytes of one expert (expert_bytes= or a GGUF model); got {expert_bytes}")
    return min(int(v * 2**20 // expert_bytes), total)


# --------------------------------------------------------------------------- replay

@dataclass(frozen=True)
class SimResult:
    """One replay of one policy at one budget.

    ``predicted`` is ``int8 [rows of trace.frame]`` in the frame's row order: 1 hit, 0 miss,
    -1 not served (layer-lru, the pool: a ubatch the engine's cache does not serve) or not replayed (a row
    outside ``phase`` for the other policies). ``counted`` (bool, same shape) marks the rows of
    ``phase``; they are the ``accesses`` (a counted -1 is a miss). ``summary`` has one row per
    workload, columns :data:`SUMMARY_COLUMNS`: ``uploads`` and ``wasted`` are in experts (one
    (layer, expert) slice each; ``wasted``: uploads dropped or evicted before any hit, layer-lru
    and the pool policies with the engine's timing only), ``tokens`` in tokens. ``admit`` is the admission rule, ``admit_window`` its window in
    steps (``second-miss`` only).
    """

    policy: str
    phase: str
    budget_entries: int
    slots_per_layer: float
    inserts: int | None
    max_batch: int
    predicted: np.ndarray
    counted: np.ndarray
    summary: pd.DataFrame
    admit: str = "always"
    admit_window: int | None = None

    @property
    def hit_rate(self) -> float:
        """Hits / accesses over all workloads (0.0 when nothing is counted)."""
        a = int(self.summary["accesses"].sum())
        return float(self.summary["hits"].sum() / a) if a else 0.0


@dataclass(frozen=True)
class _Part:
    """One workload's slice of a :class:`_Units`, ready for the core (computed once per units)."""

    e0: int              # its events: e0 .. e1 of the units
    e1: int
    start: np.ndarray | None  # int64 [units + 1] from 0 (None: no units)
    flags: np.ndarray | None  # uint8 [units], the first flagged _RESET
    ids: np.ndarray      # int32 [events]
    row0: int            # when its events are the frame rows row0 .. row0 + events in order, else -1
    tokens: np.ndarray | None = None  # int32 [units] (the pool's units)


def _parts(units: _Units, n_workloads: int) -> list[_Part]:
    """The per-workload slices of ``units`` (cached on it)."""
    if units.parts:
        return units.parts
    for w in range(n_workloads):
        u0, u1 = int(units.wl_units[w]), int(units.wl_units[w + 1])
        e0, e1 = int(units.start[u0]), int(units.start[u1])
        rows = units.rows[e0:e1]
        row0 = int(rows[0]) if len(rows) else 0
        if len(rows) > 1 and not (int(rows[-1]) - row0 == len(rows) - 1 and bool((np.diff(rows) == 1).all())):
            row0 = -1
        start = flags = None
        if u1 > u0:
            start = np.ascontiguousarray(units.start[u0:u1 + 1] - e0)
            flags = units.flags[u0:u1].copy()
            flags[0] |= _RESET
        tokens = None if units.tokens is None else np.ascontiguousarray(units.tokens[u0:u1])
        units.parts.append(_Part(e0, e1, start, flags, np.ascontiguousarray(units.ids[e0:e1]), row0, tokens))
    return units.parts


def _run_units(units: _Units, w: int, n_workloads: int, predicted: np.ndarray,
               fn: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Run one workload's slice of ``units`` through ``fn(start, flags, ids, out, counters)`` (and the
    units' ``tokens`` last, for the pool's units) and put its results into ``predicted`` (the frame's
    row order); returns ``(out, counters)``."""
    part = _parts(units, n_workloads)[w]
    n = part.e1 - part.e0
    out = predicted[part.row0:part.row0 + n] if part.row0 >= 0 else np.empty(n, dtype=np.int8)
    counters = np.zeros(3, dtype=np.int64)
    if part.start is not None:
        rc = fn(part.start, part.flags, part.ids, out, counters, *(() if part.tokens is None else (part.tokens,)))
        if rc:
            raise MemoryError(f"replay core failed (code {rc})")
    if part.row0 < 0:
        predicted[units.rows[part.e0:part.e1]] = out
    return out, counters


def simulate(trace: tr.Trace | Replay, policy: str, *, slots_per_layer: int | None = None,
             budget_entries: int | None = None, fraction: float | None = None, mib: float | None = None,
             model: str | os.PathLike | None = None, expert_bytes: float | None = None, phase: str = "decode",
             inserts: int | None = None, max_batch: int = 1, admit: str = "always",
             admit_window: int | None = None, backend: str = "auto", lend_entries: int = 0,
             guard: str | None = None, timing: str | None = None,
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Replay ``policy`` over every workload of ``trace`` at one budget (see the module doc).

    ``guard`` and ``timing`` (the pool policies only, :data:`POOL_POLICIES`; default: the policy's):
    the guard that keeps a layer from being starved (:data:`POOL_GUARDS`) and when misses become
    resident (:data:`POOL_TIMINGS`).

    ``lend_entries`` (global-lru and global-lru-scan only, default 0): the stream tier's prefetch
    window, in entries (the trace header's ``stream_lend``, the preamble's ``prefetch_experts``). A
    unit that wants less than half of its layer's experts (decode) holds up to the budget plus these
    entries; a unit that wants half or more (a prefill's) first evicts its least recently used
    entries it does not need down to the budget, so that the window is free for the prefetch.

    ``inserts`` (layer-lru only): uploads per layer per step, 0 = unlimited; default: the trace
    header's, else 0. ``max_batch``: the largest ubatch (tokens) the engine's cache serves (1
    today; also scales the staging slots). ``admit`` (layer-lru only, :data:`ADMISSIONS`): which
    misses are uploaded: ``always`` every one (the engine today, the default); ``second-miss`` only
    an expert that also missed at one of the last ``admit_window`` steps of its layer (steps are
    served ubatches; default :data:`DEFAULT_ADMIT_WINDOW`). ``progress`` is called with 1 after
    each workload. ``backend`` (:data:`BACKENDS`): ``auto`` or ``c``, both the compiled core.
    Raises :class:`PolicyError` for an unknown policy, phase, backend or admission rule (or an
    admission other than ``always`` for a policy other than layer-lru, or a ``lend_entries`` for a
    policy other than global-lru(-scan)), :class:`BudgetError` for a bad budget, a negative
    ``lend_entries`` or an ``admit_window`` below 1 (or given with ``always``), and
    :class:`CoreError` when the compiled core is missing or does not load (every policy but
    ``static`` needs it).
    """
    if policy not in POLICIES:
        raise PolicyError(f"policy {policy!r}; accepted: {', '.join(POLICIES)}")
    _check_backend(backend)
    if isinstance(lend_entries, bool) or int(lend_entries) != lend_entries or lend_entries < 0:
        raise BudgetError(f"lend_entries {lend_entries!r}; accepted: an integer >= 0 (entries)")
    lend_entries = int(lend_entries)
    if lend_entries and policy not in ("global-lru", "global-lru-scan"):
        raise PolicyError(f"lend_entries {lend_entries} is modelled for global-lru and global-lru-scan only, "
                          f"not {policy!r}; accepted: 0")
    window = admission_window(admit, admit_window)
    if window and policy != "layer-lru":
        raise PolicyError(f"admit {admit!r} is modelled for layer-lru only, not {policy!r}; accepted: always")
    if max_batch < 1:
        raise BudgetError(f"max_batch {max_batch}; accepted: >= 1")
    if policy in POOL_POLICIES:
        timing, key, guard = pool_rule(policy, timing=timing, guard=guard)
    elif timing is not None or guard is not None:
        raise PolicyError(f"timing and guard are the pool's (policies {', '.join(POOL_POLICIES)}), not {policy!r}")
    rp = prepare(trace)
    counted = rp.mask(phase)
    if mib is not None and expert_bytes is None and model is not None:
        expert_bytes = gguf_expert_bytes(model)[0]
    entries = resolve_budget(n_layer=rp.n_layer, n_expert=rp.n_expert, slots_per_layer=slots_per_layer,
                             budget_entries=budget_entries, fraction=fraction, mib=mib, expert_bytes=expert_bytes)
    if inserts is None:
        inserts = rp.trace.meta.inserts or 0
    if inserts < 0:
        raise BudgetError(f"inserts {inserts}; accepted: >= 0 (0 = unlimited)")
    lib = require_core() if policy != "static" else None
    n_w = len(rp.workloads)
    predicted = np.full(rp.n_rows, -1, dtype=np.int8)
    uploads = np.zeros(n_w, dtype=np.int64)
    wasted = np.zeros(n_w, dtype=np.int64)
    hits = np.zeros(n_w, dtype=np.int64)

    if policy == "static":
        st = rp.static_counts(phase)
        for w in range(n_w):
            c, order, r, ent = st[w]
            n_pin = min(entries, int(np.count_nonzero(c)))
            is_pinned = np.zeros(rp.n_entries, dtype=bool)
            is_pinned[order[:n_pin]] = True                              # ties: the lower entry
            predicted[r] = is_pinned[ent]
            uploads[w] = n_pin
            hits[w] = int(c[order[:n_pin]].sum())
            if progress:
                progress(1)
    else:
        if policy == "layer-lru":
            slots = min(entries // rp.n_layer, rp.n_expert)
            entries = slots * rp.n_layer
            units = rp.layer_units(max_batch)
            cev = rp.counted_events(max_batch, phase)    # counted, in event order (None: all)
            stage = staging_slots(slots, rp.n_expert, rp.top_k, inserts, max_batch)

            def fn(start, flags, ids, out, counters):
                if slots == 0:          # the cache is off: nothing is served
                    out[:] = -1
                    return 0
                return lib.pybmoe_sim_layer_lru_admit(len(flags), start, flags, ids, rp.n_expert, slots, inserts,
                                                      stage, window, out, counters)
        elif policy in POOL_POLICIES:
            sync = timing == "sync"
            floor, cap = guard_params(guard, entries, rp.n_layer, rp.top_k, rp.n_expert)
            if cap:
                entries = cap * rp.n_layer
            units = rp.pool_units(max_batch, None if sync else phase)
            cev = None if not sync or phase == "all" else rp.mask(phase)[units.rows]
            stage = pool_staging(entries, rp.n_layer, rp.n_expert, rp.top_k) if sync else 0
            t_code, k_code = POOL_TIMINGS.index(timing), POOL_KEYS.index(key)

            def fn(start, flags, ids, out, counters, tokens):
                return lib.pybmoe_sim_pool(t_code, k_code, len(flags), start, flags, tokens, ids, rp.n_layer,
                                           rp.n_expert, entries, floor, cap, stage, out, counters)
        else:
            units = rp.global_units(phase)  # the counted rows only
            cev = None
            code = _GLOBAL_CODE[policy]

            def fn(start, flags, ids, out, counters):
                return lib.pybmoe_sim_global(code, len(flags), start, flags, ids, rp.n_entries, entries,
                                             rp.n_layer, lend_entries, out, counters)

        for w in range(n_w):
            out, counters = _run_units(units, w, n_w, predicted, fn)
            uploads[w] = counters[0]
            wasted[w] = counters[2]
            if cev is None:
                hits[w] = np.count_nonzero(out == 1)
            else:
                part = units.parts[w]
                hits[w] = np.count_nonzero((out == 1) & cev[part.e0:part.e1])
            if progress:
                progress(1)

    spl = entries / rp.n_layer
    lru = policy == "layer-lru"
    lagged = lru or (policy in POOL_POLICIES and timing == "sync")   # wasted uploads are counted
    return SimResult(policy, phase, entries, spl, inserts if lru else None, max_batch,
                     predicted, counted, _summary(rp, policy, phase, entries, spl,
                                                  inserts if lru else None, admit, window or None,
                                                  rp.accesses(phase), hits, uploads, wasted if lagged else None),
                     admit, window or None)


def admission_window(admit: str, admit_window: int | None) -> int:
    """The core's window for an admission rule: 0 for ``always``, else ``admit_window`` (steps,
    default :data:`DEFAULT_ADMIT_WINDOW`). Raises :class:`PolicyError` for an unknown rule and
    :class:`BudgetError` for a window that is not an integer >= 1, or one given with ``always``."""
    if admit not in ADMISSIONS:
        raise PolicyError(f"admit {admit!r}; accepted: {', '.join(ADMISSIONS)}")
    if admit == "always":
        if admit_window is not None:
            raise BudgetError(f"admit_window {admit_window} given with admit 'always'; accepted: admit_window "
                              "with admit 'second-miss' only")
        return 0
    w = DEFAULT_ADMIT_WINDOW if admit_window is None else admit_window
    if isinstance(w, bool) or int(w) != w or w < 1 or w > 2**31 - 1:
        raise BudgetError(f"admit_window {admit_window}; accepted: an integer >= 1 (steps)")
    return int(w)


def _summary(rp: Replay, policy: str, phase: str, entries: int, spl: float, inserts: int | None, admit: str,
             admit_window: int | None, acc: np.ndarray, hits: np.ndarray, uploads: np.ndarray,
             wasted: np.ndarray | None) -> pd.DataFrame:
    tokens = rp.tokens(phase)
    ov = rp.overlap()
    rows = []
    for w, name in enumerate(rp.workloads):
        o = ov.get(name, float("nan"))
        rows.append({"workload": name, "policy": policy, "phase": phase, "budget_entries": entries,
                     "slots_per_layer": spl, "inserts": inserts, "admit": admit, "admit_window": admit_window,
                     "accesses": int(acc[w]), "hits": int(hits[w]),
                     "misses": int(acc[w] - hits[w]), "hit_rate": float(hits[w] / acc[w]) if acc[w] else 0.0,
                     "tokens": int(tokens[w]), "uploads": int(uploads[w]),
                     "wasted": None if wasted is None else int(wasted[w]), "overlap": o,
                     "reach_tokens": reach_tokens(spl, rp.top_k, o) if not math.isnan(o) else float("nan")})
    df = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
    for c in ("inserts", "admit_window", "wasted"):
        df[c] = df[c].astype("Int64")
    return df


def sweep(trace: tr.Trace | Replay, policies: Sequence[str], budgets: Sequence[tuple[str, float]], *,
          phase: str = "decode", inserts: int | None = None, max_batch: int = 1, expert_bytes: float | None = None,
          admit: str = "always", admit_window: int | None = None, backend: str = "auto",
          progress: bool | None = None, lend_entries: int = 0) -> pd.DataFrame:
    """Replay every policy at every budget; the tidy concatenation of the summaries.

    ``budgets`` are ``(kind, value)`` pairs with ``kind`` in :data:`BUDGET_KINDS`. ``admit`` and
    ``admit_window`` (steps) as in :func:`simulate` (an admission other than ``always`` needs
    layer-lru as the only policy). ``lend_entries`` as in :func:`simulate`, for global-lru and
    global-lru-scan (the other policies replay without it). ``progress``: show a progress bar on stderr (None: only when
    stderr is a terminal). Raises like :func:`simulate`, before any replay.
    """
    from tqdm import tqdm
    rp = prepare(trace)
    for p in policies:
        if p not in POLICIES:
            raise PolicyError(f"policy {p!r}; accepted: {', '.join(POLICIES)}")
    _check_backend(backend)
    if admission_window(admit, admit_window) and set(policies) != {"layer-lru"}:
        others = ", ".join(p for p in policies if p != "layer-lru")
        raise PolicyError(f"admit {admit!r} is modelled for layer-lru only, not {others}; accepted: always")
    frames = []
    total = len(policies) * len(budgets) * len(rp.workloads)
    with tqdm(total=total, desc="replay", unit="run", file=sys.stderr, leave=False,
              disable=None if progress is None else not progress) as bar:
        for p in policies:
            for kind, v in budgets:
                if kind not in BUDGET_KINDS:
                    raise BudgetError(f"budget kind {kind!r}; accepted: {', '.join(BUDGET_KINDS)}")
                r = simulate(rp, p, phase=phase, inserts=inserts, max_batch=max_batch, expert_bytes=expert_bytes,
                             admit=admit, admit_window=admit_window, backend=backend, progress=bar.update,
                             lend_entries=lend_entries if p in ("global-lru", "global-lru-scan") else 0,
                             **{kind: v})
                frames.append(r.summary)
    return pd.concat(frames, ignore_index=True)


def pooled(df: pd.DataFrame) -> pd.DataFrame:
    """Per (policy, admission, budget): accesses, hits, misses, uploads, wasted uploads, tokens and
    hit rate summed over workloads (from a :func:`sweep` frame, or several concatenated)."""
    keys = ["policy", "admit", "admit_window", "budget_entries"] if "admit" in df else ["policy", "budget_entries"]
    extra = {"wasted": ("wasted", lambda x: x.sum(min_count=1))} if "wasted" in df else {}  # NA: not counted
    g = df.groupby(keys, sort=False, as_index=False, dropna=False).agg(
        slots_per_layer=("slots_per_layer", "first"), accesses=("accesses", "sum"), hits=("hits", "sum"),
        misses=("misses", "sum"), uploads=("uploads", "sum"), tokens=("tokens", "sum"), **extra)
    g["hit_rate"] = g["hits"] / g["accesses"].where(g["accesses"] > 0)
    return g


# --------------------------------------------------------------------------- derived tables

def misses_per_token(trace: tr.Trace | Replay, slots_per_layer: Sequence[int], batches: Sequence[int] = (1, 2, 4, 8, 16),
                     *, policy: str = "layer-lru", inserts: int = 0, backend: str = "auto") -> pd.DataFrame:
    """The "misses per token at batch b" table, from the decode rows.

    Consecutive decode tokens of each workload are regrouped into ubatches of ``b`` tokens (the
    engine then serves ubatches of up to ``b``: ``max_batch = b``) and replayed. A step that
    misses an expert loads it once for all of its tokens, so the cost is the distinct missed
    (layer, expert) entries per step. ``misses_per_token`` = those loads / (tokens * n_layer):
    experts loaded per token per layer (``k * (1 - hit rate)`` at b = 1 without duplicates).
    Columns ``policy, slots_per_layer, batch, tokens, loads, misses_per_token`` (pooled over
    workloads). Raises :class:`BudgetError` for a batch below 1.
    """
    rp = prepare(trace)
    dec = rp.trace.select("decode")
    if len(dec.frame) == 0:
        raise BudgetError("the trace has no decode rows; accepted: a trace with decode tokens")
    rows = []
    for b in batches:
        if b < 1:
            raise BudgetError(f"batch {b}; accepted: >= 1")
        f = dec.frame.copy()
        wl = pd.factorize(f["workload"].astype(str), sort=False)[0]
        tok = f["token"].to_numpy().astype(np.int64)
        first = pd.Series(tok).groupby(wl).transform("min").to_numpy()
        f["ubatch"] = ((tok - first) // b).astype(np.int32)
        rb = Replay(tr.Trace(f, dec.meta, dec.source))
        n_tokens = int(len(np.unique(wl * (int(tok.max()) + 1) + tok)))
        for s in slots_per_layer:
            r = simulate(rb, policy, slots_per_layer=s, phase="decode", inserts=inserts, max_batch=b, backend=backend)
            miss = r.predicted != 1
            unit = (rb.wl * (int(rb.ubatch.max()) + 1) + rb.ubatch) * rb.n_layer + rb.lay
            loads = len(np.unique(unit[miss] * rb.n_expert + rb.expert[miss]))
            rows.append({"policy": policy, "slots_per_layer": s, "batch": b, "tokens": n_tokens, "loads": loads,
                         "misses_per_token": loads / (n_tokens * rb.n_layer)})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- the engine check

def engine_replay(trace: tr.Trace | Replay, *, slots_per_layer: int | None = None, inserts: int | None = None,
                  max_batch: int | None = None, backend: str = "auto") -> SimResult:
    """The replay of an engine trace with the engine's own settings (the header's ``slots``,
    ``inserts``, ``max_batch``, ``admit`` — the admission window in steps, absent for ``always`` —
    and ``pool``, unless given).

    Without ``pool=`` it is the layer-lru replay (slots per layer). With ``pool=P:il,il,.../...`` (the
    engine sized in MiB: one bank per device and expert shape, :func:`parse_pool`) each bank is
    replayed on its own, policy ``pool`` with ``budget_entries=P`` over its layers, and the
    predictions are put back in the trace's row order; the summary sums the banks per workload.

    Raises :class:`BudgetError` when the slots are unknown, :class:`PolicyError` for a pool trace
    with an insert cap or an admission window (the pool is replayed without them), ``ValueError``
    for an ``admit=`` that is not a whole number of steps >= 1 or a malformed ``pool=``."""
    rp = prepare(trace)
    if max_batch is None:  # the engine writes max_batch= in the trace header
        max_batch = int(rp.trace.meta.extra.get("max_batch", 1))
    pool = rp.trace.meta.extra.get("pool")
    if pool is not None and slots_per_layer is None:
        return _engine_replay_pool(rp, parse_pool(pool), max_batch, backend,
                                   rp.trace.meta.inserts if inserts is None else inserts)
    slots = slots_per_layer if slots_per_layer is not None else rp.trace.meta.slots
    if slots is None:
        raise BudgetError("the trace header has no slots= (captured without the cache?); accepted: slots_per_layer=N")
    window = rp.trace.meta.extra.get("admit")  # --moe-expert-cache-admit second-miss:W
    admit = {}
    if window is not None:
        try:
            w = int(window)
        except (TypeError, ValueError):
            w = 0
        if w < 1:
            raise ValueError(f"the trace header's admit={window!r}: expected a window of >= 1 steps")
        admit = {"admit": "second-miss", "admit_window": w}
    return simulate(rp, "layer-lru", slots_per_layer=slots, inserts=inserts, phase="all", max_batch=max_batch,
                    backend=backend, **admit)


def parse_pool(value: str) -> list[tuple[int, list[int]]]:
    """The banks of an engine trace's ``pool=`` header value, ``P:il,il,.../P:il,...``: each bank's
    resident slots (entries) and its model layers in forward order. Raises ``ValueError`` when the
    value is not of that form."""
    banks = []
    for part in str(value).split("/"):
        p, sep, layers = part.partition(":")
        try:
            ils = [int(x) for x in layers.split(",")]
            entries = int(p)
        except ValueError:
            ils, entries = [], -1
        if not sep or not ils or entries < 0:
            raise ValueError(f"the trace header's pool={value!r}: expected P:il,il,.../P:il,... (slots, layers)")
        banks.append((entries, ils))
    return banks


def _engine_replay_pool(rp: Replay, banks: list[tuple[int, list[int]]], max_batch: int, backend: str,
                        inserts: int | None) -> SimResult:
    meta = rp.trace.meta
    if inserts or meta.extra.get("admit") is not None:
        raise PolicyError(f"the pool is replayed without an insert cap or an admission window; the trace has "
                          f"inserts={inserts} admit={meta.extra.get('admit')}")
    f = rp.trace.frame
    lay = f["layer"].to_numpy()
    predicted = np.full(len(f), -1, dtype=np.int8)
    counted = np.zeros(len(f), dtype=bool)
    parts = []
    for entries, ils in banks:
        rows = np.isin(lay, ils)
        if not rows.any():
            continue
        r = simulate(rp.restrict(rows), "pool", budget_entries=entries, phase="all", max_batch=max_batch,
                     backend=backend)
        predicted[rows] = r.predicted
        counted[rows] = r.counted
        parts.append(r.summary)
    entries = sum(e for e, _ in banks)
    n_layers = sum(len(ils) for _, ils in banks)
    if parts:
        s = pd.concat(parts).groupby("workload", sort=False, as_index=False).agg(
            {c: ("sum" if c in ("accesses", "hits", "misses", "uploads", "wasted") else "first")
             for c in SUMMARY_COLUMNS if c != "workload"})
        s["budget_entries"] = entries
        s["slots_per_layer"] = entries / n_layers
        s["hit_rate"] = (s["hits"] / s["accesses"].where(s["accesses"] > 0)).fillna(0.0)
        summary = s[list(SUMMARY_COLUMNS)]
    else:
        summary = pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    return SimResult("pool", "all", entries, entries / max(n_layers, 1), None, max_batch, predicted, counted, summary)


def compare_with_engine(trace: tr.Trace | Replay, result: SimResult) -> pd.DataFrame:
    """The rows where the replay and the engine's ``hit`` column disagree (empty when exact).

    Compared: every row of a layer the engine cached (a layer with any ``hit`` >= 0). Returns
    those rows of the frame with a ``predicted`` column added.
    """
    rp = prepare(trace)
    f = rp.trace.frame
    hit = f["hit"].to_numpy()
    cached_layers = np.unique(rp.lay[hit >= 0])
    cmp = np.isin(rp.lay, cached_layers)
    bad = cmp & (hit != result.predicted)
    out = f.loc[bad].copy()
    out["predicted"] = result.predicted[bad]
    return out
