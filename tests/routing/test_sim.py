"""Tests of pybmoe.routing.sim (replay of cache policies), pybmoe.routing.sizing and pybmoe.bench.plot (CPU only, ~10 s).

Expected values are computed here by hand or re-derived independently from the raw data, never
taken from the implementation. The hand-worked replays run on both implementations (the ``impl``
fixture, conftest.py): the compiled core (built from pybmoe/routing/_simcore.c into a temporary folder
when a C compiler is there) and the tests' oracle (lru_oracle.py); the two must also agree on random
traces and on granite.
"""
from __future__ import annotations

import re

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pybmoe.cli import simulate, size
from pybmoe.routing import sim, sizing
from pybmoe.routing import trace as tr
from pybmoe.routing.granite import GRANITE_TRACE as GRANITE  # the bundled copy (MIT notice beside it)

import lru_oracle


def mk(ubatches, *, n_expert: int, phases=None, workload: str = "w", layer: int = 0) -> tr.Trace:
    """A one-layer trace: ``ubatches`` is a list of ubatches, each a list of tokens, each a list of
    expert ids in router order; a bare list of ids is a one-token ubatch."""
    rows, tok = [], 0
    for u, ub in enumerate(ubatches):
        tokens = [ub] if ub and isinstance(ub[0], int) else ub
        for ids in tokens:
            for r, e in enumerate(ids):
                rows.append((workload, (phases or {}).get(u, "decode"), u, tok, layer, r, e, -1))
            tok += 1
    df = pd.DataFrame(rows, columns=tr.COLUMNS)
    k = max(len(t) for ub in ubatches for t in ([ub] if ub and isinstance(ub[0], int) else ub))
    return tr.from_frame(df, tr.TraceMeta(layer + 1, n_expert, k))


def pred(t: tr.Trace, policy: str, **kw) -> list[int]:
    return sim.simulate(t, policy, **kw).predicted.tolist()


def flat(x):
    return [v for row in x for v in row]


# --------------------------------------------------------------------------- layer-lru: the engine's policy, by hand

def test_layer_lru_lag(impl):
    # a miss at step s is resident from s + 2: expert 0 misses at steps 1 and 2
    t = mk([[0], [0], [0], [1], [0], [1]], n_expert=4)
    assert pred(t, "layer-lru", slots_per_layer=2) == [0, 0, 1, 0, 1, 1]


def test_layer_lru_evicts_lru_not_used_at_last_step(impl):
    # entry 4 admits 2 (evicting 1, the LRU; 0 was used at step 3) then 3 (evicting 2, the upload just
    # admitted: it was last used at step 2 < 3); entry 5 evicts 0 (3 was used at step 4)
    t = mk([[0, 1], [2, 3], [0, 4], [2, 3], [0, 4]], n_expert=8)
    assert pred(t, "layer-lru", slots_per_layer=2) == flat([[0, 0], [0, 0], [1, 0], [0, 1], [0, 1]])


def test_layer_lru_tie_break_lowest_expert_id(impl):
    # at entry 4, experts 3 and 5 were both last used at step 1: the lower id (3) is evicted
    t = mk([[5, 3], [6, 0], [7, 1], [5, 3]], n_expert=8)
    assert pred(t, "layer-lru", slots_per_layer=3) == flat([[0, 0], [0, 0], [0, 0], [1, 0]])


def test_layer_lru_drops_when_every_resident_was_just_used(impl):
    t = mk([[0, 1], [0, 1], [0, 1], [2, 0], [3, 1], [2, 0]], n_expert=4)
    r = sim.simulate(t, "layer-lru", slots_per_layer=1)
    assert r.predicted.tolist() == flat([[0, 0], [0, 0], [1, 0], [0, 1], [0, 0], [1, 0]])
    # uploads completed after each step: 2, 1, 1, 1, 2 (the last two after step 6); 5 of them dropped
    assert r.summary["uploads"].tolist() == [7]


def test_layer_lru_insert_cap(impl):
    t = mk([[0, 1]] * 4, n_expert=8)
    assert pred(t, "layer-lru", slots_per_layer=4, inserts=1) == flat([[0, 0], [0, 0], [1, 0], [1, 1]])
    assert pred(t, "layer-lru", slots_per_layer=4, inserts=0) == flat([[0, 0], [0, 0], [1, 1], [1, 1]])


def test_layer_lru_free_physical_slots_bound_uploads(impl):
    # with no staging slot, an upload needs a free resident slot
    start = np.array([0, 2, 4, 6], dtype=np.int64)
    flags = np.array([3, 1, 1], dtype=np.uint8)
    ids = np.array([0, 1, 0, 1, 0, 1], dtype=np.int32)
    out = np.zeros(6, dtype=np.int8)
    counters = np.zeros(3, dtype=np.int64)
    assert sim._load_core().pybmoe_sim_layer_lru_admit(3, start, flags, ids, 4, 1, 0, 0, 0, out, counters) == 0
    assert out.tolist() == [0, 0, 0, 0, 1, 0]


def test_layer_lru_unserved_ubatch_still_publishes_uploads(impl):
    # a 2-token ubatch is not served (max_batch 1), but the upload pending after it becomes resident
    t = mk([[0], [[1], [2]], [0]], n_expert=4)
    assert pred(t, "layer-lru", slots_per_layer=2, phase="all") == [0, -1, -1, 1]
    # served when the engine takes batches of 2: its lookups see the cache, and the lag is two steps again
    assert pred(t, "layer-lru", slots_per_layer=2, phase="all", max_batch=2) == [0, 0, 0, 1]


def test_layer_lru_warm_across_an_interleaved_prefill(impl):
    # as in a server: decode, a prompt of two 2-token ubatches, decode again, all one stream.
    # The prefill is not served, the upload pending after it lands, and the cache stays warm.
    t = mk([[0], [1], [[2], [3]], [[0], [2]], [1], [2], [0], [1]], n_expert=4,
           phases={2: "prefill", 3: "prefill"})
    # after step 5 the upload of 2 evicts 1 (last used at step 3; 0 was used at step 5)
    assert pred(t, "layer-lru", slots_per_layer=2, phase="all") == [0, 0, -1, -1, -1, -1, 1, 0, 1, 0]


def test_layer_lru_layer_without_rows_in_a_ubatch(impl):
    # in a prompt ubatch with no output token the last layer computes nothing (no rows), yet the
    # engine's bookkeeping after that ubatch publishes the layer's pending upload all the same
    rows = []
    for u, (phase, toks) in enumerate([("decode", [(0, [0], [0])]), ("decode", [(1, [1], [1])]),
                                       ("prefill", [(2, [2], None), (3, [3], None)]), ("decode", [(4, [1], [1])])]):
        for tok, l0, l1 in toks:
            rows += [("w", phase, u, tok, 0, r, e, -1) for r, e in enumerate(l0)]
            rows += [("w", phase, u, tok, 1, r, e, -1) for r, e in enumerate(l1 or [])]
    t = tr.from_frame(pd.DataFrame(rows, columns=tr.COLUMNS), tr.TraceMeta(2, 4, 1))
    r = sim.simulate(t, "layer-lru", slots_per_layer=2, phase="all")
    f = t.frame.assign(p=r.predicted)
    assert f[f["layer"] == 1]["p"].tolist() == [0, 0, 1]
    assert f[f["layer"] == 0]["p"].tolist() == [0, 0, -1, -1, 1]


def test_layer_lru_repeated_miss_within_a_step(impl):
    t = mk([[[0, 1], [0, 2]], [[0, 1], [1, 2]], [[0, 1], [0, 2]]], n_expert=4)
    # step 1 misses all four lookups (0 twice); step 2 too (uploads land at step 3)
    assert pred(t, "layer-lru", slots_per_layer=4, max_batch=2) == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]


def test_layer_lru_prefill_not_served_and_counted_by_phase(impl):
    t = mk([[[0], [1], [2]], [0], [0], [0]], n_expert=4, phases={0: "prefill"})
    r = sim.simulate(t, "layer-lru", slots_per_layer=2, phase="decode")
    assert r.predicted.tolist() == [-1, -1, -1, 0, 0, 1]       # prefill leaves the cache cold
    assert (r.summary["accesses"][0], r.summary["hits"][0]) == (3, 1)
    r = sim.simulate(t, "layer-lru", slots_per_layer=2, phase="all")
    assert (r.summary["accesses"][0], r.summary["misses"][0]) == (6, 5)
    r = sim.simulate(t, "layer-lru", slots_per_layer=2, phase="prefill")
    assert (r.summary["accesses"][0], r.summary["hits"][0]) == (3, 0)


def test_layer_lru_zero_slots_is_cache_off(impl):
    t = mk([[0], [0], [0]], n_expert=4)
    r = sim.simulate(t, "layer-lru", slots_per_layer=0)
    assert r.predicted.tolist() == [-1, -1, -1] and r.summary["misses"][0] == 3


def test_each_workload_starts_cold(impl):
    a = mk([[0], [0], [0]], n_expert=4, workload="a")
    b = mk([[0], [0], [0]], n_expert=4, workload="b")
    t = tr.concat([a, b])
    for policy in ("layer-lru", "global-lru"):
        r = sim.simulate(t, policy, slots_per_layer=2)
        assert r.summary["workload"].tolist() == ["a", "b"]
        assert r.summary["hits"].tolist() == ([1, 1] if policy == "layer-lru" else [2, 2])


# --------------------------------------------------------------------------- global policies, by hand

S1 = [[0], [1], [0], [2], [0], [3]]
S2 = [[0], [0], [0], [1], [2], [1], [2], [0]]


@pytest.mark.parametrize("policy,seq,expected", [
    ("global-lru", S1, [0, 0, 1, 0, 1, 0]),
    ("fifo", S1, [0, 0, 1, 0, 0, 0]),
    ("lfu", S1, [0, 0, 1, 0, 1, 0]),
    ("belady", S1, [0, 0, 1, 0, 1, 0]),
    ("global-lru", S2, [0, 1, 1, 0, 0, 1, 1, 0]),
    ("fifo", S2, [0, 1, 1, 0, 0, 1, 1, 0]),
    ("lfu", S2, [0, 1, 1, 0, 0, 0, 0, 1]),
    ("belady", S2, [0, 1, 1, 0, 0, 1, 1, 0]),
    ("static", S2, [1, 1, 1, 1, 0, 1, 0, 1]),
    ("static", S1, [1, 1, 1, 0, 1, 0]),
])
def test_global_policies_by_hand(impl, policy, seq, expected):
    assert pred(mk(seq, n_expert=4), policy, budget_entries=2) == expected


def test_belady_bypasses_an_entry_needed_no_sooner(impl):
    # S1 at 2 entries: 2 and 3 are never needed again, so neither displaces 0
    r = sim.simulate(mk(S1, n_expert=4), "belady", budget_entries=2)
    assert r.summary["uploads"].tolist() == [2]


def test_entries_the_step_needs_are_never_evicted(impl):
    # step 2 misses 3; the LRU entry is 1, but step 2 needs it: 2 is evicted and 1 hits
    # (a cache that admits lookup by lookup would evict 1 and miss it: see docs/traces.md)
    t = mk([[1, 2], [3, 1]], n_expert=4)
    for policy in ("global-lru", "fifo", "lfu"):
        assert pred(t, policy, budget_entries=2) == [0, 0, 0, 1]


def two_layers(ubatches: list[list[list[int]]], n_expert: int = 4) -> tr.Trace:
    """ubatches[u][token] = (layer 0's expert, layer 1's expert), top-1: one unit per layer per ubatch."""
    tokens = [(u, ids) for u, toks in enumerate(ubatches) for ids in toks]
    rows = [("w", "decode", u, t, layer, 0, ids[layer], -1) for t, (u, ids) in enumerate(tokens) for layer in (0, 1)]
    return tr.from_frame(pd.DataFrame(rows, columns=tr.COLUMNS), tr.TraceMeta(2, n_expert, 1))


def test_the_scan_guard_by_hand(impl):
    """3 entries, 2 layers. Ubatch 1 wants 2 experts a layer: 2 x 2 layers > 3, a scan. Plain LRU
    evicts L0E0 then L1E0 for it; the guard admits at the least recent end, so the scan's misses
    evict each other (L0E1, L0E2 for layer 1's) and L1E0 is still there at ubatch 2."""
    t = two_layers([[[0, 0]], [[1, 1], [2, 2]], [[0, 0]]])
    # rows are token-major within a ubatch, as the frame above: (u0 L0, u0 L1, u1 t0 L0, u1 t0 L1, ...)
    order = np.lexsort((t.frame["rank"], t.frame["token"], t.frame["layer"], t.frame["ubatch"]))
    plain = np.asarray(pred(t, "global-lru", budget_entries=3))[order].tolist()
    scan = np.asarray(pred(t, "global-lru-scan", budget_entries=3))[order].tolist()
    #          u0 L0, L1 | u1 L0 t0, t1 | u1 L1 t0, t1 | u2 L0, L1
    assert plain == [0, 0, 0, 0, 0, 0, 0, 0]
    assert scan == [0, 0, 0, 0, 0, 0, 0, 1]
    # at 4 entries the same ubatch fits (2 x 2 layers): the guard is off and the two policies agree
    assert pred(t, "global-lru-scan", budget_entries=4) == pred(t, "global-lru", budget_entries=4)


def test_a_scans_repeats_hit_and_keep_its_admissions_at_the_least_recent_end(impl):
    """Ubatch 1 is a scan at 3 entries (2 distinct x 2 layers > 3). Layer 0 (1, 2, 1): 2 evicts
    L0E0 (L0E1 is needed), the repeat of 1 hits and leaves it at the least recent end. Layer 1
    (3, 0, 3): 3 evicts L0E2, the scan's last admission, not L0E1; L1E0, resident before, hits and
    becomes the most recent. Ubatch 2: L0E0 misses and evicts L1E3; L1E0 hits."""
    t = two_layers([[[0, 0]], [[1, 3], [2, 0], [1, 3]], [[0, 0]]])
    order = np.lexsort((t.frame["rank"], t.frame["token"], t.frame["layer"], t.frame["ubatch"]))
    scan = np.asarray(pred(t, "global-lru-scan", budget_entries=3))[order].tolist()
    #        u0 L0, L1 | u1 L0: 1, 2, 1 | u1 L1: 3, 0, 3 | u2 L0, L1
    assert scan == [0, 0, 0, 0, 1, 0, 1, 1, 0, 1]


@pytest.mark.parametrize("policy", ["global-lru", "global-lru-scan"])
def test_the_prefetch_windows_lend_by_hand(impl, policy):
    """2 entries and a window of 1 lent to decode, 2 layers of 4 experts. Decode (top-1: a quarter of
    the layer) holds 3 entries: at ubatch 2 both of ubatch 1's and L1E0 are still there, where 2
    entries hit only L0E1. Ubatch 3 wants half of each layer: it first evicts down to 2 (L1E1, the least
    recent it does not need), then admits L0E2 over L1E0, so layer 1's lookup of 0 misses; a plain
    capacity of 3 would have kept L1E0."""
    t = two_layers([[[0, 0]], [[1, 1]], [[1, 0]], [[1, 0], [2, 3]]])
    order = np.lexsort((t.frame["rank"], t.frame["token"], t.frame["layer"], t.frame["ubatch"]))

    def run(**kw):
        return np.asarray(pred(t, policy, **kw))[order].tolist()
    #                                          u0 L0, L1 | u1 L0, L1 | u2 L0, L1 | u3 L0: 1, 2 | u3 L1: 0, 3
    assert run(budget_entries=2, lend_entries=1) == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert run(budget_entries=2) == [0, 0, 0, 0, 1, 0, 1, 0, 0, 0]
    assert run(budget_entries=3) == [0, 0, 0, 0, 1, 1, 1, 0, 1, 0]


def test_a_bad_lend_is_refused():
    t = two_layers([[[0, 0]]])
    with pytest.raises(sim.BudgetError, match="lend_entries -1; accepted: an integer >= 0"):
        sim.simulate(t, "global-lru", budget_entries=2, lend_entries=-1)
    with pytest.raises(sim.PolicyError, match="lend_entries 1 is modelled for global-lru and global-lru-scan only"):
        sim.simulate(t, "lfu", budget_entries=2, lend_entries=1)


def test_instant_admission_within_a_multi_token_step(impl):
    t = mk([[[0, 1], [0, 2]]], n_expert=4)
    assert pred(t, "global-lru", budget_entries=3) == [0, 0, 1, 0]
    assert pred(t, "global-lru", budget_entries=1) == [0, 0, 1, 0]   # 1 and 2 find no victim
    assert pred(t, "global-lru", budget_entries=0) == [0, 0, 0, 0]
    t = mk([[[0, 1], [1, 0]]], n_expert=4)
    assert pred(t, "global-lru", budget_entries=1) == [0, 0, 0, 1]   # a bypassed entry misses again


# --------------------------------------------------------------------------- the core equals the oracle

def random_trace(seed: int) -> tr.Trace:
    rng = np.random.default_rng(seed)
    E, L, K = 10, 3, 3
    frames = []
    for w in range(3):
        rows, tok = [], 0
        ubs = [("prefill", int(rng.integers(2, 5)))] + [("decode", int(rng.choice([1, 1, 1, 2, 3]))) for _ in range(40)]
        for u, (phase, n) in enumerate(ubs):
            for _ in range(n):
                for lay in range(L):
                    ids = rng.choice(E, K, replace=False, p=np.arange(E, 0, -1) / (E * (E + 1) / 2))
                    rows += [(f"w{w}", phase, u, tok, 2 * lay + 1, r, int(e), -1) for r, e in enumerate(ids)]
                tok += 1
        frames.append(pd.DataFrame(rows, columns=tr.COLUMNS))
    return tr.from_frame(pd.concat(frames, ignore_index=True), tr.TraceMeta(2 * L + 1, E, K))


@pytest.mark.parametrize("seed", [0, 1])
def test_core_equals_the_oracle_on_random_traces(core, seed):
    t = random_trace(seed)
    rp = sim.prepare(t)
    for policy in sim.POLICIES:
        for entries in (0, 2, 5, 9, 14, 30):
            for phase in ("decode", "all"):
                for inserts, max_batch in (((0, 1), (1, 1), (2, 2), (0, 3)) if policy == "layer-lru" else ((0, 1),)):
                    kw = dict(budget_entries=entries, phase=phase, inserts=inserts, max_batch=max_batch)
                    a = sim.simulate(rp, policy, **kw)
                    with lru_oracle.instead_of_the_core():
                        b = sim.simulate(rp, policy, **kw)
                    assert np.array_equal(a.predicted, b.predicted), (policy, kw)
                    pd.testing.assert_frame_equal(a.summary, b.summary)


def test_core_equals_the_oracle_on_granite(core, granite):
    rp = sim.prepare(granite)
    for policy in sim.POLICIES:
        for slots in (3, 8, 20):
            a = sim.simulate(rp, policy, slots_per_layer=slots, phase="all", inserts=2)
            with lru_oracle.instead_of_the_core():
                b = sim.simulate(rp, policy, slots_per_layer=slots, phase="all", inserts=2)
            assert np.array_equal(a.predicted, b.predicted), (policy, slots)
            pd.testing.assert_frame_equal(a.summary, b.summary)


# --------------------------------------------------------------------------- known values on the granite trace

def test_granite_layer_lru_full_cache_misses_compulsory_plus_lag(granite, granite_raw, impl):
    # 32 of 32 slots: nothing is ever evicted; an expert first selected at decode step f misses at f and,
    # because of the two-step lag, at f + 1 if selected again then. Derived from the raw JSON.
    expected = {}
    for name, p in granite_raw["prompts"].items():
        misses = 0
        for layer in range(granite_raw["num_layers"]):
            steps = [set(tok[layer]) for tok in p["decode"]]
            first: dict[int, int] = {}
            for s, ids in enumerate(steps):
                for e in ids:
                    first.setdefault(e, s)
            misses += sum(1 + (f + 1 < len(steps) and e in steps[f + 1]) for e, f in first.items())
        expected[name] = misses
    r = sim.simulate(granite, "layer-lru", slots_per_layer=32)
    assert dict(zip(r.summary["workload"], r.summary["misses"])) == expected
    # the prefill is not served: with --phase all its lookups are misses on top, and the decode ones do not change
    r_all = sim.simulate(granite, "layer-lru", slots_per_layer=32, phase="all")
    prefill = {n: len(p["prefill"]) * 24 * 8 for n, p in granite_raw["prompts"].items()}
    assert dict(zip(r_all.summary["workload"], r_all.summary["misses"])) == {n: expected[n] + prefill[n] for n in expected}


@pytest.mark.parametrize("policy", ["global-lru", "fifo", "lfu", "belady"])
def test_granite_full_global_cache_misses_only_compulsory(granite, granite_raw, impl, policy):
    for phase, parts in (("decode", ("decode",)), ("all", ("prefill", "decode"))):
        expected = {name: len({(layer, e) for part in parts for tok in p[part] for layer, ids in enumerate(tok) for e in ids})
                    for name, p in granite_raw["prompts"].items()}
        r = sim.simulate(granite, policy, budget_entries=768, phase=phase)
        assert dict(zip(r.summary["workload"], r.summary["misses"])) == expected, phase


def test_granite_global_lru_below_the_token_cycle_is_zero(granite, impl):
    # the token cycle is 24 x 8 = 192 entries. An entry survives to the next token only if the other 23
    # layers' 184 entries leave room: at or below 184 entries no lookup ever hits (0.0%, exactly)
    for entries in (1, 8, 100, 184):
        for policy in ("global-lru", "fifo", "lfu"):
            r = sim.simulate(granite, policy, budget_entries=entries)
            assert r.summary["hits"].sum() == 0, (policy, entries)
    # between 184 and 192 some of the layer's entries from the previous token survive: not zero
    assert sim.simulate(granite, "global-lru", budget_entries=185).hit_rate > 0
    # a per-layer partition has no such cliff
    assert sim.simulate(granite, "layer-lru", budget_entries=184).hit_rate > 0.3


def test_granite_overlap_and_reach(granite, granite_raw):
    r = sim.simulate(granite, "layer-lru", slots_per_layer=8)
    for name, p in granite_raw["prompts"].items():
        dec = p["decode"]
        shared = [len(set(dec[t][layer]) & set(dec[t - 1][layer])) / 8 for t in range(1, 64) for layer in range(24)]
        ov = sum(shared) / len(shared)
        row = r.summary[r.summary["workload"] == name].iloc[0]
        assert row["overlap"] == pytest.approx(ov)
        assert row["reach_tokens"] == pytest.approx(8 / (8 * (1 - ov)))


def test_reach_formula_matches_the_thread():
    # 216 slots, top-10, 44.2% overlap: 38.7 tokens
    assert sim.reach_tokens(216, 10, 0.442) == pytest.approx(38.7, abs=0.05)
    assert sim.reach_tokens(8, 8, 1.0) == math.inf


def test_misses_per_token_at_batch_one_is_the_miss_rate(granite):
    mpt = sim.misses_per_token(granite, [4, 16], [1, 4])
    for s in (4, 16):
        r = sim.simulate(granite, "layer-lru", slots_per_layer=s)
        b1 = mpt[(mpt["slots_per_layer"] == s) & (mpt["batch"] == 1)].iloc[0]
        assert b1["misses_per_token"] == pytest.approx(r.summary["misses"].sum() / (3 * 64 * 24))
        assert b1["tokens"] == 3 * 64
    assert set(mpt["batch"]) == {1, 4}


# --------------------------------------------------------------------------- budgets

def test_budgets_resolve_to_entries():
    kw = dict(n_layer=24, n_expert=32)
    assert sim.resolve_budget(slots_per_layer=8, **kw) == 192
    assert sim.resolve_budget(slots_per_layer=99, **kw) == 768             # clamped like the engine
    assert sim.resolve_budget(budget_entries=100, **kw) == 100
    assert sim.resolve_budget(fraction=0.25, **kw) == 192
    assert sim.resolve_budget(mib=3.0, expert_bytes=2**20 / 4, **kw) == 12
    with pytest.raises(sim.BudgetError, match="exactly one"):
        sim.resolve_budget(slots_per_layer=8, fraction=0.5, **kw)
    with pytest.raises(sim.BudgetError, match="exactly one"):
        sim.resolve_budget(**kw)
    with pytest.raises(sim.BudgetError, match="fraction 1.5; accepted: 0 .. 1"):
        sim.resolve_budget(fraction=1.5, **kw)
    with pytest.raises(sim.BudgetError, match="slots_per_layer -1"):
        sim.resolve_budget(slots_per_layer=-1, **kw)
    with pytest.raises(sim.BudgetError, match="expert_bytes"):
        sim.resolve_budget(mib=10, **kw)


def test_layer_lru_reports_its_effective_budget(granite):
    r = sim.simulate(granite, "layer-lru", budget_entries=100)
    assert (r.budget_entries, r.slots_per_layer) == (96, 4.0)
    with pytest.raises(sim.PolicyError, match="policy 'lru'; accepted"):
        sim.simulate(granite, "lru", budget_entries=100)
    with pytest.raises(sim.BudgetError, match="inserts -1"):
        sim.simulate(granite, "layer-lru", budget_entries=100, inserts=-1)


def test_staging_slots_formula():
    assert sim.staging_slots(8, 32, 8) == 8
    assert sim.staging_slots(8, 32, 8, inserts=2) == 2
    assert sim.staging_slots(30, 32, 8) == 2
    assert sim.staging_slots(32, 32, 8) == 0
    # a step of 4 tokens starts top-k uploads, or up to the insert cap (at most k x 4)
    assert sim.staging_slots(8, 64, 8, max_batch=4) == 8
    assert sim.staging_slots(8, 64, 8, inserts=20, max_batch=4) == 20
    assert sim.staging_slots(8, 64, 8, inserts=50, max_batch=4) == 32
    assert sim.staging_slots(8, 64, 8, inserts=20, max_batch=1) == 8


# --------------------------------------------------------------------------- the engine check

def test_verify_against_an_engine_trace(tmp_path, granite, capsys):
    r = sim.simulate(granite, "layer-lru", slots_per_layer=8, inserts=1, phase="all")
    frame = granite.frame.copy()
    frame["hit"] = r.predicted
    engine = tr.Trace(frame, tr.TraceMeta(24, 32, 8, slots=8, inserts=1), "engine")
    path = tr.write_trace(engine, tmp_path / "engine.csv")
    back = tr.read_trace(path)
    assert len(sim.compare_with_engine(back, sim.engine_replay(back))) == 0
    assert simulate.main([str(path), "--verify"]) == 0
    assert "0 of 58368 lookups differ" in capsys.readouterr().out
    frame.loc[5000, "hit"] = 1 - frame.loc[5000, "hit"] if frame.loc[5000, "hit"] >= 0 else 0
    bad = tr.write_trace(tr.Trace(frame, engine.meta), tmp_path / "bad.csv")
    diff = sim.compare_with_engine(tr.read_trace(bad), sim.engine_replay(tr.read_trace(bad)))
    assert diff.index.tolist() == [5000]
    assert simulate.main([str(bad), "--verify"]) == 1


# --------------------------------------------------------------------------- CLI and plot

def test_cli_csv_one_row_per_workload(granite, capsys):
    assert simulate.main([str(GRANITE), "--policy", "layer-lru,global-lru", "--slots-per-layer", "8,32", "--csv",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    from io import StringIO
    df = pd.read_csv(StringIO(out))
    assert {"workload", "policy", "budget_entries", "accesses", "misses", "hit_rate"} <= set(df.columns)
    assert len(df) == 3 * 2 * 2
    assert sorted(set(df["workload"])) == ["code", "english_prose", "math"]
    assert set(df["budget_entries"]) == {192, 768}


def test_cli_lend_replays_the_prefetch_window(granite, capsys):
    """--lend N is simulate(lend_entries=N) for the two LRUs; layer-lru replays without it; a negative N is
    refused with the accepted range."""
    from io import StringIO
    argv = [str(GRANITE), "--policy", "global-lru-scan,layer-lru", "--budget-entries", "400", "--csv", "--no-progress"]
    assert simulate.main(argv + ["--lend", "40"]) == 0
    df = pd.read_csv(StringIO(capsys.readouterr().out))
    want = sim.simulate(granite, "global-lru-scan", budget_entries=400, lend_entries=40).summary
    got = df[df["policy"] == "global-lru-scan"].reset_index(drop=True)
    assert got["hits"].tolist() == want["hits"].tolist()
    assert got["hits"].sum() > sim.simulate(granite, "global-lru-scan", budget_entries=400).summary["hits"].sum()
    plain = sim.simulate(granite, "layer-lru", budget_entries=400).summary
    assert df[df["policy"] == "layer-lru"]["hits"].tolist() == plain["hits"].tolist()
    assert simulate.main(argv + ["--lend", "-1"]) == 2
    assert "lend_entries -1; accepted: an integer >= 0" in capsys.readouterr().err


def test_cli_errors_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        simulate.main(["--help"])
    assert e.value.code == 0 and "--slots-per-layer" in capsys.readouterr().out
    assert simulate.main([str(GRANITE), "--fraction", "1.5"]) == 2
    assert "fraction 1.5; accepted: 0 .. 1" in capsys.readouterr().err
    assert simulate.main([str(GRANITE)]) == 2
    assert "no budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate.main([str(GRANITE), "--fraction", "0.5", "--slots-per-layer", "4"])


def test_cli_report_prints_slot_counts_as_integers(granite, capsys):
    """A slot count is a whole number (issue 17: `8.000`); a budget in entries that is not whole slots
    per layer keeps two decimals."""
    assert simulate.main([str(GRANITE), "--workload", "code", "--policy", "layer-lru,global-lru",
                          "--budget-entries", "192,100", "--no-progress"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.lstrip().startswith("code ")]
    slots = {(r[1], r[2]): r[3] for r in rows}
    assert slots[("layer-lru", "192")] == "8" and slots[("global-lru", "192")] == "8"
    assert slots[("global-lru", "100")] == "4.17"


def test_cli_report_plot_and_batch_table(granite, tmp_path, capsys):
    png = tmp_path / "hit.png"
    assert simulate.main([str(GRANITE), "--policy", "all", "--budget-entries", "96:768:96", "--plot", str(png),
                     "--batch-table", "1,2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "token cycle 192" in out and "misses per token" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- sizing

def tiny_gguf(path: Path, n_layer=24, n_expert=32, top_k=8, n_embd=8, n_ff=4) -> Path:
    import gguf
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(n_layer)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(top_k)
    w.add_embedding_length(n_embd)
    for i in range(n_layer):
        for name, shape in (("gate", (n_expert, n_ff, n_embd)), ("up", (n_expert, n_ff, n_embd)),
                            ("down", (n_expert, n_embd, n_ff))):
            w.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", np.zeros(shape, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_expert_bytes_from_gguf(tmp_path):
    p = tiny_gguf(tmp_path / "m.gguf")
    assert sim.gguf_expert_bytes(p) == (3 * 8 * 4 * 2, 24, 32, 8)
    shape = sizing.model_shape(p)
    assert shape == sizing.ModelShape(24, 32, 8, 192.0)
    # 8 slots: 8 staging + 1 zero slot, plus the I32 table
    assert sizing.device_bytes(8, shape) == 24 * ((8 + 8 + 1) * 192 + 4 * 32)
    assert sizing.device_bytes(0, shape) == 0
    # --moe-expert-cache-mb for 8 slots: the slots, staging and zero slot, rounded up to whole MiB
    # (24 x 17 x 192 B = 78,336 B: 1 MiB); a model of 1 MiB experts needs exactly n_layer x 17 MiB
    assert sizing.budget_mib(8, shape) == 1 and sizing.budget_mib(0, shape) == 0
    big = sizing.ModelShape(24, 32, 8, float(2**20))
    assert sizing.budget_mib(8, big) == 24 * 17 and sizing.budget_mib(30, big) == 24 * (30 + 2 + 1)


def test_expert_bytes_of_the_embedded_model(model_q8):
    from pybmoe import models
    assert sim.gguf_expert_bytes(model_q8)[0] == models.expert_bytes(models.ModelSpec(ftype="Q8_0"))


def test_sizing_recommendation(tmp_path, granite):
    shape = sizing.model_shape(tiny_gguf(tmp_path / "m.gguf"))
    free = sizing.device_bytes(20, shape) / 2**20
    assert sizing.max_slots(shape, free) == 20
    assert sizing.max_slots(shape, free - 1e-6) == 19
    rec = sizing.recommend(shape, trace=granite)
    hits = {s: sim.simulate(granite, "layer-lru", slots_per_layer=s).hit_rate for s in range(1, 33)}
    best = min(s for s in hits if hits[s] >= hits[32] - 0.01)
    assert rec.slots_per_layer == best and rec.hit_rate == pytest.approx(hits[best])
    assert not rec.below_cycle and not rec.warnings
    # beside each candidate, the pool the same MiB buy (the engine's bank sizing) and its hit rate
    for s in (1, 8, 20):
        P = sizing.pool_slots(s, shape)
        assert P + sim.pool_staging(P, 24, 32, 8) + 1 <= 24 * (s + min(8, 32 - s) + 1)
        assert P == 24 * 32 or P + 1 + sim.pool_staging(P + 1, 24, 32, 8) + 1 > 24 * (s + min(8, 32 - s) + 1)
        row = rec.table[rec.table["slots_per_layer"] == s].iloc[0]
        assert row["pool_slots"] == P
        assert row["pool_hit_rate"] == pytest.approx(sim.simulate(granite, "pool", budget_entries=P).hit_rate)
    assert sizing.pool_slots(0, shape) == 0
    small = sizing.recommend(shape, free_mib=sizing.device_bytes(4, shape) / 2**20, trace=granite)
    assert small.slots_per_layer == 4 and small.below_cycle and "below the cycle" in small.warnings[0]
    none = sizing.recommend(shape, free_mib=0.001)
    assert none.slots_per_layer == 0 and "leave the cache off" in none.warnings[0]
    with pytest.raises(sizing.SizingError, match="accepted: a trace of this model"):
        sizing.recommend(sizing.ModelShape(24, 16, 8, 1.0), trace=granite)


def test_size_cli(tmp_path, granite, capsys):
    m = tiny_gguf(tmp_path / "m.gguf")
    assert size.main(["-m", str(m), "--trace", str(GRANITE), "--free-mb", "0.08"]) == 0
    out = capsys.readouterr()
    assert "recommended: --moe-expert-cache" in out.out and "expected hit rate" in out.out
    assert re.search(r"--moe-expert-cache-mb \d+ \(one pool of \d+ slots, expected hit rate [\d.]+%\)", out.out), out.out
    assert size.main(["-m", str(m), "--free-mb", "0.06"]) == 0
    out = capsys.readouterr()
    assert "--moe-expert-cache 3 " in out.out and "below the cycle" in out.err
    # without a trace no hit rate is predicted, and the output says so (issue 17: a column of NaN)
    assert "NaN" not in out.out and "hit_rate" not in out.out and "no trace given" in out.out
    assert size.main(["-m", str(m), "--free-mb", "0.02"]) == 0
    assert "leave the cache off" in capsys.readouterr().err


# --------------------------------------------------------------------------- libcachesim, where its semantics match

def test_libcachesim_agrees_when_a_step_is_one_lookup(impl):
    lcs = pytest.importorskip("libcachesim")
    seq = np.random.default_rng(3).zipf(1.3, 3000) % 40
    t = mk([[int(e)] for e in seq], n_expert=40)
    for ours, theirs in (("global-lru", lcs.LRU), ("fifo", lcs.FIFO)):
        for size in (4, 16):
            cache = theirs(cache_size=size)
            ref = [int(cache.get(lcs.Request(obj_id=int(e) + 1, obj_size=1))) for e in seq]
            assert pred(t, ours, budget_entries=size) == ref, (ours, size)
    # with several lookups per step they differ: libcachesim evicts an entry the step still needs
    cache = lcs.LRU(cache_size=2)
    ref = [int(cache.get(lcs.Request(obj_id=e + 1, obj_size=1))) for e in (1, 2, 3, 1)]
    assert ref == [0, 0, 0, 0]
    assert pred(mk([[1, 2], [3, 1]], n_expert=4), "global-lru", budget_entries=2) == [0, 0, 0, 1]
