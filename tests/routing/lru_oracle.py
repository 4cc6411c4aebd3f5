"""The test oracle of the replay simulator: its cache policies written plainly in Python.

The replay itself runs in one implementation, the compiled core (``pybmoe/routing/_simcore.c``,
loaded by :mod:`pybmoe.routing.sim`); the engine runs the same per-layer policy in C++
(``ggml-ext/llama-moe-residency.cpp``), held to the simulator by ``test_residency.py`` and
``tests/engine/test_engine_replay.py``.

Why this module stays, outside the package: the core is written for speed (scanned arrays and lazy
heaps, linked lists, frequency buckets, bit trees over next-use steps), and a reader cannot check it
against the rules at a glance. Here each rule is a direct statement of docs/expert-cache.md and
docs/traces.md, in sets, dicts and ``min``: an independent account of the policy that the compiled
core, and through it the engine, is held to. The hand-worked cases of ``test_sim.py``,
``test_admission.py`` and ``test_pool.py`` run on both (through :func:`instead_of_the_core`), and
the core must equal this module event for event and counter for counter on random traces and on
unit streams sized for its structures (``test_sim_core.py``). It replays 0.6 to 1.8 M lookups/s,
the core tens of millions: enough for the tests' traces, not for real ones.

Each function takes the core's unit stream (``start`` int64 ``[units + 1]``, ``flags`` uint8
``[units]`` of ``sim._SERVED | sim._RESET | sim._STEP``, ids int32 ``[events]``), writes ``out``
int8 ``[events]`` (1 hit, 0 miss, -1 not served) and adds to ``counters`` int64 ``[3]``, as the
core's entry point named in its docstring does (its comment in ``_simcore.c`` states the rule).
"""
from __future__ import annotations

import contextlib
import heapq
from typing import Iterator

import numpy as np

from pybmoe.routing import sim
from pybmoe.routing.sim import _RESET, _SERVED, _STEP, CRF_CLASSES, CRF_FRAC_BITS, CRF_HALF_LIFE, PolicyError

_NEVER = 1 << 62
#: 2**30 * 2**(-j / CRF_HALF_LIFE) for j = 0 .. CRF_HALF_LIFE - 1, rounded: the decay of ClassLRU's CRF
#: over j tokens (the core computes the same table; test_pool.py compares them).
CRF_DECAY = tuple(round(2.0 ** 30 * 2.0 ** (-j / CRF_HALF_LIFE)) for j in range(CRF_HALF_LIFE))


# --------------------------------------------------------------------------- layer-lru and the global policies

def layer_lru(start: np.ndarray, flags: np.ndarray, expert: np.ndarray, n_expert: int, slots: int,
              cap: int, staging: int, out: np.ndarray, counters: np.ndarray, window: int = 0) -> None:
    """The engine's policy, written as docs/expert-cache.md states it (the core: pybmoe_sim_layer_lru_admit).

    ``window`` 0: every miss is scheduled (admission ``always``); ``window`` W > 0: a miss of step
    s is scheduled only when the expert also missed at one of the steps s - W .. s - 1 (``second-miss``).
    ``counters``: [0] += uploads completed, [1] += dropped, [2] (when there) += wasted (dropped, or
    evicted before any hit).
    """
    ids = expert.tolist()
    st = start.tolist()
    res = np.empty(len(ids), dtype=np.int8)
    R: set[int] = set()
    used = [0] * n_expert
    last_miss = [0] * n_expert                       # the ghost history: step of the last miss, 0 none
    got_hit = [False] * n_expert                     # a resident hit since it landed
    F: list[int] = []
    misses: list[int] = []
    step = last_step = 0
    uploads = dropped = wasted = 0
    for u, fl in enumerate(flags.tolist()):
        if fl & _RESET:
            R, used, F, misses, step, last_step = set(), [0] * n_expert, [], [], 0, 0
            last_miss = [0] * n_expert
        b, end = st[u], st[u + 1]
        if fl & _SERVED:                             # a step: lookups against R
            step += 1
            last_step = step
            missed_now: set[int] = set()
            for i in range(b, end):
                e = ids[i]
                used[e] = step
                if e in R:
                    res[i] = 1
                    got_hit[e] = True
                else:
                    res[i] = 0
                    if e not in missed_now:
                        missed_now.add(e)
                        prev, last_miss[e] = last_miss[e], step
                        if window == 0 or (prev > 0 and step - prev <= window):
                            misses.append(e)         # admitted: scheduled below
        else:
            res[b:end] = -1
        for e in F:                                  # after the ubatch: uploads scheduled after the previous one
            uploads += 1
            if len(R) == slots:
                cands = [x for x in R if used[x] < last_step]
                if not cands:
                    dropped += 1
                    wasted += 1
                    continue
                v = min(cands, key=lambda x: (used[x], x))
                wasted += not got_hit[v]
                R.remove(v)
            R.add(e)
            got_hit[e] = False
        F = []
        for e in misses:                             # then this one's admitted misses are scheduled
            if e in R:
                continue
            if cap > 0 and len(F) == cap:
                break
            if len(F) == staging + (slots - len(R)):
                break
            F.append(e)
        misses = []
    out[:] = res
    counters[0] += uploads
    counters[1] += dropped
    if len(counters) > 2:
        counters[2] += wasted


def _next_use(start: list[int], flags: list[int], ids: list[int]) -> list[int]:
    """Per event: the next unit of the same stream that needs the same entry (``_NEVER`` if none)."""
    nxt = [_NEVER] * len(ids)
    seen: dict[int, int] = {}
    for u in range(len(flags) - 1, -1, -1):
        for i in range(start[u], start[u + 1]):
            nxt[i] = seen.get(ids[i], _NEVER)
        for i in range(start[u], start[u + 1]):
            seen[ids[i]] = u
        if flags[u] & _RESET:
            seen = {}
    return nxt


def global_policy(policy: str, start: np.ndarray, flags: np.ndarray, entry: np.ndarray, n_entries: int,
                  capacity: int, out: np.ndarray, counters: np.ndarray, n_layer: int = 1,
                  lend: int = 0) -> None:
    """global-lru(-scan) / fifo / lfu / belady with a lazy heap (the core: pybmoe_sim_global, whose
    comment states the rules). ``n_layer``: the layers the entries span, global-lru-scan's guard and
    the lend's; ``lend``: entries a unit that wants less than half of its layer may hold beyond
    ``capacity``, global-lru(-scan) only. Raises PolicyError for a ``lend`` with another policy."""
    if lend and policy not in ("global-lru", "global-lru-scan"):
        raise PolicyError(f"lend {lend} is modelled for global-lru and global-lru-scan only, not {policy!r}")
    scan_guard = policy == "global-lru-scan"
    if scan_guard:
        policy = "global-lru"
    ids = entry.tolist()
    st = start.tolist()
    fls = flags.tolist()
    capacity = min(capacity, n_entries)
    nxt = _next_use(st, fls, ids) if policy == "belady" else None
    res = [0] * len(ids)
    key: dict[int, tuple[int, int]] = {}         # resident entry -> its current key
    heap: list[tuple[int, int, int]] = []
    freq: dict[int, int] = {}
    admitted = 0

    def new_key(e: int, u: int, i: int) -> tuple[int, int]:
        if policy == "global-lru":
            return (i, e)                            # recency per lookup, in router rank order
        if policy == "fifo":
            return (u, e)
        if policy == "lfu":
            return (freq[e], u * n_entries + e)
        return (-nxt[i], e)

    def pop_victim() -> tuple[int, int, int] | None:
        # the least current heap item the unit does not need (`need`), popped; None when there is none
        stash, victim = [], None
        while heap:
            a, bb, x = heapq.heappop(heap)
            if key.get(x) != (a, bb):
                continue                         # stale
            if x in need:
                stash.append((a, bb, x))         # needed by this unit: never evicted
                continue
            victim = (a, bb, x)
            break
        for s in stash:
            heapq.heappush(heap, s)
        return victim

    for u in range(len(fls)):
        if fls[u] & _RESET:
            key, heap, freq = {}, [], {}
        b, end = st[u], st[u + 1]
        need: dict[int, int] = {}                    # entry -> its first event in the unit
        for i in range(b, end):
            need.setdefault(ids[i], i)
        # the scan guard: a unit that wants half of its layer or more, and a pass of such units would
        # flush the cache; its admissions enter at the minimum end, each below the last, and stay there
        half = 2 * len(need) >= n_entries // n_layer
        scan = scan_guard and half and len(need) * n_layer > capacity
        # the lend: a unit that wants half of its layer or more holds capacity entries (it first evicts the
        # least recent entries it does not need down to that), the others capacity + lend
        cap = capacity if half else min(capacity + lend, n_entries)
        while len(key) > cap:
            victim = pop_victim()
            if victim is None:
                break
            del key[victim[2]]
        for i in range(b, end):
            e = ids[i]
            first = need[e] == i
            if e not in key:
                res[i] = 0
                continue
            res[i] = 1
            if policy == "global-lru" or (first and policy != "fifo"):
                if policy == "lfu":
                    freq[e] += 1
                key[e] = new_key(e, u, i)
                heapq.heappush(heap, (*key[e], e))
        for e, i in need.items():
            if e in key or cap == 0:
                continue
            if len(key) >= cap:
                victim = pop_victim()
                if victim is not None and policy == "belady" and nxt[i] >= -victim[0]:
                    heapq.heappush(heap, victim)     # the incoming entry is needed furthest away
                    victim = None
                if victim is None:
                    continue
                del key[victim[2]]
            if policy == "lfu":
                freq[e] = 1
            key[e] = (-1 - i, e) if scan else new_key(e, u, i)
            heapq.heappush(heap, (*key[e], e))
            admitted += 1
        if len(need) < end - b:                      # a repeated lookup of an entry admitted here hits
            for i in range(b, end):
                if res[i] == 0 and need[ids[i]] != i and ids[i] in key:
                    res[i] = 1
                    if policy == "global-lru" and not scan:
                        key[ids[i]] = new_key(ids[i], u, i)
                        heapq.heappush(heap, (*key[ids[i]], ids[i]))
        if len(heap) > 4 * len(key) + 64:
            heap = [(*k, e) for e, k in key.items()]
            heapq.heapify(heap)
    out[:] = np.asarray(res, dtype=np.int8)
    counters[0] += admitted


# --------------------------------------------------------------------------- the pool (ClassLRU's CRF, then the bank)

def crf_use(crf: int, age: int) -> int:
    """The fixed-point CRF after one more use, ``age`` tokens after the last one (``crf`` 0: never used)."""
    if crf and age:
        crf = (crf * CRF_DECAY[age % CRF_HALF_LIFE]) >> 30 >> min(age // CRF_HALF_LIFE, 63)
    return crf + (1 << CRF_FRAC_BITS)


def crf_class(crf: int) -> int:
    """``floor(log2(CRF))`` of a fixed-point CRF of at least 1, at most ``CRF_CLASSES - 1``."""
    return min(CRF_CLASSES - 1, crf.bit_length() - 1 - CRF_FRAC_BITS)


def pool(start: np.ndarray, flags: np.ndarray, entry: np.ndarray, tokens: np.ndarray, n_expert: int,
         capacity: int, timing: int, key: int, floor: int, cap: int, staging: int, out: np.ndarray,
         counters: np.ndarray) -> None:
    """The pool, written as docs/expert-cache.md ("The pool") states it (the core: pybmoe_sim_pool).

    Units are layer steps (one layer's lookups in one ubatch) in forward order, entries ``layer *
    n_expert + expert``; ``_STEP`` marks the first unit of a ubatch, ``tokens`` its token count (the
    ClassLRU clock). ``timing`` 0 (sync, the engine's): a served ubatch's lookups see the residents as
    they were before it; after every ubatch the uploads scheduled after the previous one settle, then
    its distinct misses are scheduled. ``timing`` 1 (instant, upstream's): each layer step admits its
    misses before the next. ``key`` 0: LRU, 1: ClassLRU. The guard: a victim is an entry of the
    incoming entry's own layer, or of a layer holding more than ``floor`` entries; a layer holding
    ``cap`` entries (0: no cap) takes its victim from its own entries. ``staging``: uploads in flight
    beyond the free slots (sync). ``counters``: [0] += uploads (sync: completed, dropped included;
    instant: admissions), [1] += dropped, [2] += wasted (dropped, or evicted before any hit; sync).
    """
    ids = entry.tolist()
    st = start.tolist()
    fls = flags.tolist()
    tok = tokens.tolist()
    n_units = len(fls)
    res = [0] * len(ids)
    uploads = dropped = wasted = 0
    R: set[int] = set()
    cnt: dict[int, int] = {}
    used: dict[int, int] = {}       # sync: the served step of the last lookup; instant: its event index
    crf: dict[int, int] = {}
    last: dict[int, int] = {}       # the clock (tokens) at the last use
    cls: dict[int, int] = {}
    got_hit: set[int] = set()
    F: list[int] = []
    misses: list[int] = []
    step = last_step = clock = 0

    def touch(x: int) -> None:
        c = crf_use(crf.get(x, 0), clock - last.get(x, clock))
        crf[x], last[x], cls[x] = c, clock, crf_class(c)

    def order(y: int):
        # the victim is the least of this key
        if key == 0:
            return (used[y], y)
        # the largest age / 2**class first: age * 2**(CRF_CLASSES - 1 - class) orders the same, in integers
        return (-((clock - last[y]) << (CRF_CLASSES - 1 - cls[y])), used[y], y)

    def full_for(x: int) -> bool:
        return len(R) >= capacity or (cap > 0 and cnt.get(x // n_expert, 0) >= cap)

    def victim(x: int, protected) -> int | None:
        lx = x // n_expert
        own = cap > 0 and cnt.get(lx, 0) >= cap
        best = None
        for y in R:
            if protected(y):
                continue
            ly = y // n_expert
            if ly != lx and (own or cnt[ly] <= floor):
                continue
            if best is None or order(y) < order(best):
                best = y
        if best is None and cnt.get(lx, 0) < floor:     # under its floor: an over-floor layer gives, even
            for y in R:                                   # an entry selected at the last step
                ly = y // n_expert
                if ly != lx and cnt[ly] > floor and (best is None or order(y) < order(best)):
                    best = y
        return best

    def evict(v: int) -> None:
        R.remove(v)
        cnt[v // n_expert] -= 1
        got_hit.discard(v)

    def admit(x: int) -> None:
        R.add(x)
        cnt[x // n_expert] = cnt.get(x // n_expert, 0) + 1

    u = 0
    while u < n_units:
        if fls[u] & _RESET:
            R, cnt, used, crf, last, cls, got_hit = set(), {}, {}, {}, {}, {}, set()
            F, misses, step, last_step, clock = [], [], 0, 0, 0
        if timing == 1:                                  # instant: one layer step
            if fls[u] & _STEP:
                clock += tok[u]
            b, end = st[u], st[u + 1]
            u += 1
            if not fls[u - 1] & _SERVED:
                res[b:end] = [-1] * (end - b)
                continue
            need: dict[int, int] = {}
            for i in range(b, end):
                need.setdefault(ids[i], i)
                res[i] = int(ids[i] in R)
            for x in need:
                if x in R:
                    continue
                if full_for(x):
                    v = victim(x, lambda y: y in need)
                    if v is None:
                        continue                         # bypassed: all its lookups here miss
                    evict(v)
                admit(x)
                uploads += 1
            for i in range(b, end):
                x = ids[i]
                if x in R:
                    res[i] = 1 if need[x] != i else res[i]   # a repeat of an admitted entry hits
                    used[x] = i
            if key == 1:
                for x in need:
                    touch(x)
            continue
        # sync: one ubatch, units u .. v - 1
        v = u + 1
        while v < n_units and not fls[v] & _STEP:
            v += 1
        b, end = st[u], st[v]
        if fls[u] & _SERVED:
            step += 1
            last_step = step
            clock += tok[u]
            missed: dict[int, None] = {}
            seen: dict[int, None] = {}
            for i in range(b, end):
                x = ids[i]
                used[x] = step
                seen[x] = None
                if x in R:
                    res[i] = 1
                    got_hit.add(x)
                else:
                    res[i] = 0
                    missed[x] = None
            if key == 1:
                for x in seen:
                    touch(x)
            new_misses = list(missed)
        else:
            res[b:end] = [-1] * (end - b)
            new_misses = []
        for x in F:                                      # after the ubatch: the uploads scheduled after the previous one
            uploads += 1
            if full_for(x):
                vt = victim(x, lambda y: used.get(y, 0) >= last_step)
                if vt is None:
                    dropped += 1
                    wasted += 1
                    continue
                wasted += vt not in got_hit
                evict(vt)
            admit(x)
        F = []
        for x in new_misses:                             # then this one's misses are scheduled
            if x in R:
                continue
            if len(F) == staging + (capacity - len(R)):
                break
            F.append(x)
        u = v
    out[:] = np.asarray(res, dtype=np.int8)
    counters[0] += uploads
    counters[1] += dropped
    counters[2] += wasted


# --------------------------------------------------------------------------- the oracle in place of the core

class OracleCore:
    """The compiled core's entry points that :mod:`pybmoe.routing.sim` calls, with the same arguments,
    answered by this module's functions (each returns 0, the core's success code)."""

    def pybmoe_sim_layer_lru_admit(self, n_units, start, flags, expert, n_expert, slots, cap, staging, window, out,
                                   counters) -> int:
        layer_lru(start, flags, expert, n_expert, slots, cap, staging, out, counters, window)
        return 0

    def pybmoe_sim_global(self, code, n_units, start, flags, entry, n_entries, capacity, n_layer, lend, out,
                          counters) -> int:
        policy = {c: p for p, c in sim._GLOBAL_CODE.items()}[code]
        global_policy(policy, start, flags, entry, n_entries, capacity, out, counters, n_layer, lend)
        return 0

    def pybmoe_sim_pool(self, timing, key, n_units, start, flags, tokens, entry, n_layer, n_expert, capacity, floor,
                        cap, staging, out, counters) -> int:
        pool(start, flags, entry, tokens, n_expert, capacity, timing, key, floor, cap, staging, out, counters)
        return 0

    def pybmoe_sim_crf_decay(self, j: int) -> int:
        return CRF_DECAY[j] if 0 <= j < CRF_HALF_LIFE else 0


@contextlib.contextmanager
def instead_of_the_core() -> Iterator[None]:
    """Within the block, :func:`pybmoe.routing.sim.simulate` (and what calls it) replays through this
    module instead of the compiled core; the core in use before is restored after."""
    saved = sim._core
    sim._core = OracleCore()
    try:
        yield
    finally:
        sim._core = saved
