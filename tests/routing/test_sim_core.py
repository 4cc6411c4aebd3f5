"""The compiled replay core (pybmoe/routing/_simcore.c) against the tests' oracle (lru_oracle.py), on
unit streams built here (CPU only, ~5 s).

The core keeps each policy's residents in structures of its own (lists, frequency buckets, bit
trees over next-use units and over entries; for layer-lru an array scanned up to 64 slots, a
lazily updated heap above), so these streams are sized to reach what
the random traces of test_sim.py do not: hundreds to thousands of entries, bit trees of two and
three levels, many victims per step, steps that need every resident, resets within one call,
repeated lookups within a step. Expected values are the oracle's (lru_oracle.global_policy,
lru_oracle.layer_lru, written as docs/traces.md and docs/expert-cache.md state the rules), and a
few small cases worked out by hand.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pybmoe.routing import sim
from pybmoe.routing import trace as tr

import lru_oracle

GLOBAL = ("global-lru", "global-lru-scan", "fifo", "lfu", "belady")


@pytest.fixture
def lib(core):
    """The compiled core, built from the current source (conftest.py)."""
    return core


def stream(seed: int, *, n_units: int, n_entries: int, max_len: int, p_reset: float = 0.0, p_empty: float = 0.0,
           served: float = 1.0):
    """Units of 0 .. max_len lookups (Zipf-skewed entries, repeats allowed), some empty, some
    flagged as a new stream; ``served`` of them served (layer-lru)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, max_len + 1, n_units)
    lens[rng.random(n_units) < p_empty] = 0
    start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    w = 1.0 / np.arange(1, n_entries + 1) ** rng.uniform(0.5, 1.3)
    ids = rng.permutation(n_entries)[rng.choice(n_entries, int(start[-1]), p=w / w.sum())].astype(np.int32)
    flags = np.where(rng.random(n_units) < served, sim._SERVED, 0).astype(np.uint8)
    flags[rng.random(n_units) < p_reset] |= sim._RESET
    flags[0] |= sim._RESET
    return start, flags, ids


def run_global(lib, policy, start, flags, ids, n_entries, cap, n_layer=3, lend=0):
    # n_layer: global-lru-scan's guard and the lend's half a layer (3: units of n_entries / 6 distinct entries or
    # more want half; those of more than cap / 3 are scans); lend: entries lent to the other units
    out_c, cnt_c = np.empty(len(ids), np.int8), np.zeros(2, np.int64)
    assert lib.pybmoe_sim_global(sim._GLOBAL_CODE[policy], len(flags), start, flags, ids, n_entries, cap, n_layer,
                                 lend, out_c, cnt_c) == 0
    out_p, cnt_p = np.empty(len(ids), np.int8), np.zeros(2, np.int64)
    lru_oracle.global_policy(policy, start, flags, ids, n_entries, cap, out_p, cnt_p, n_layer, lend)
    return (out_c, cnt_c), (out_p, cnt_p)


@pytest.mark.parametrize("seed,n_entries,n_units,max_len,p_reset", [
    (0, 7, 600, 3, 0.02),        # tiny: steps that need every resident, many bypasses
    (1, 70, 2500, 8, 0.0),       # two-level bit tree over entries
    (2, 300, 5000, 8, 0.001),    # two-level bit tree over units, a reset within the call
    (3, 130, 1500, 40, 0.0),     # multi-token steps: repeats, many victims per step
])
def test_global_core_matches_the_oracle(lib, seed, n_entries, n_units, max_len, p_reset):
    start, flags, ids = stream(seed, n_units=n_units, n_entries=n_entries, max_len=max_len, p_reset=p_reset)
    for cap in sorted({0, 1, 2, 5, n_entries // 7, n_entries // 2, n_entries - 1, n_entries, n_entries + 3}):
        for policy in GLOBAL:
            # global-lru-scan over 3 layers, and over 40 (layers of a few entries: most units are scans)
            for n_layer in ((3, 40) if policy == "global-lru-scan" else (3,)):
                # the prefetch window's lend (the two LRUs only): none, one entry, a third of the entries
                for lend in ((0, 1, n_entries // 3) if policy.startswith("global-lru") else (0,)):
                    (out_c, cnt_c), (out_p, cnt_p) = run_global(lib, policy, start, flags, ids, n_entries, cap,
                                                                n_layer, lend)
                    assert np.array_equal(out_c, out_p), (policy, cap, n_layer, lend)
                    assert cnt_c[0] == cnt_p[0], (policy, cap, n_layer, lend)


def test_global_core_deep_bit_trees(lib):
    # 300,000 units, mostly empty (more than 64**3 next-use units: a three-level tree), and
    # 5,000 entries (three levels for the entries never needed again)
    start, flags, ids = stream(4, n_units=300_000, n_entries=5000, max_len=6, p_empty=0.97)
    for cap in (40, 900):
        for policy in GLOBAL:
            (out_c, cnt_c), (out_p, cnt_p) = run_global(lib, policy, start, flags, ids, 5000, cap)
            assert np.array_equal(out_c, out_p), (policy, cap)
            assert cnt_c[0] == cnt_p[0], (policy, cap)


@pytest.mark.parametrize("seed,n_expert,max_len,served", [(5, 16, 4, 1.0), (6, 64, 12, 0.9), (7, 5, 3, 0.7),
                                                          (9, 150, 16, 0.95)])
def test_layer_lru_core_matches_the_oracle(lib, seed, n_expert, max_len, served):
    # up to 64 slots the core scans its residents for the victim, above that it keeps a heap
    start, flags, ids = stream(seed, n_units=3000, n_entries=n_expert, max_len=max_len, p_reset=0.01, served=served)
    for slots in sorted({1, 2, n_expert // 3, 64, 65, n_expert - 1, n_expert} & set(range(1, n_expert + 1))):
        for cap, staging in ((0, 0), (0, 4), (1, 1), (3, 8)):
            # the admission rule: window 0, always; W > 0, second miss
            for window in (0, 1, 3):
                out_c, cnt_c = np.empty(len(ids), np.int8), np.zeros(3, np.int64)
                assert lib.pybmoe_sim_layer_lru_admit(len(flags), start, flags, ids, n_expert, slots, cap, staging,
                                                      window, out_c, cnt_c) == 0
                out_p, cnt_p = np.empty(len(ids), np.int8), np.zeros(3, np.int64)
                lru_oracle.layer_lru(start, flags, ids, n_expert, slots, cap, staging, out_p, cnt_p, window)
                assert np.array_equal(out_c, out_p), (slots, cap, staging, window)
                assert np.array_equal(cnt_c, cnt_p), (slots, cap, staging, window)


def test_layer_lru_core_refuses_a_negative_window(lib):
    start, flags, ids = stream(10, n_units=5, n_entries=4, max_len=2)
    out, cnt = np.empty(len(ids), np.int8), np.zeros(3, np.int64)
    assert lib.pybmoe_sim_layer_lru_admit(len(flags), start, flags, ids, 4, 2, 0, 1, -1, out, cnt) == -2


# --------------------------------------------------------------------------- ties, by hand

def one_layer(steps: list[list[int]], n_expert: int = 4) -> tr.Trace:
    rows = [("w", "decode", u, u, 0, r, e, -1) for u, ids in enumerate(steps) for r, e in enumerate(ids)]
    return tr.from_frame(pd.DataFrame(rows, columns=tr.COLUMNS), tr.TraceMeta(1, n_expert, max(map(len, steps))))


@pytest.mark.parametrize("policy,steps,expected", [
    # step 0 admits 1 then 0. fifo: both admitted at step 0, the lower id goes first (0 is evicted
    # for 2); global-lru: recency is per lookup in rank order, so 1 is the older (evicted for 2)
    ("fifo", [[1, 0], [2], [0, 1]], [0, 0, 0, 0, 1]),
    ("global-lru", [[1, 0], [2], [0, 1]], [0, 0, 0, 1, 0]),
    # lfu: same frequency, same last step: the lower id goes first
    ("lfu", [[1, 0], [2], [0, 1]], [0, 0, 0, 0, 1]),
    # lfu: 0 needed twice, 1 once: 1 goes for 2; then 2 (once) goes for 1, and 0 still hits
    ("lfu", [[0, 1], [0], [2], [1], [0]], [0, 0, 1, 0, 0, 1]),
    # belady: 3 and 2 are both needed next at step 3, 0 sooner: the lower id (2) goes for it
    ("belady", [[3, 2], [0], [0], [2, 3]], [0, 0, 0, 1, 0, 1]),
])
def test_ties_by_hand(impl, policy, steps, expected):
    assert sim.simulate(one_layer(steps), policy, budget_entries=2).predicted.tolist() == expected


# --------------------------------------------------------------------------- the frame's row order

def test_results_follow_the_frame_rows_in_any_order(lib):
    # the replay writes straight into the result when a workload's events are consecutive frame
    # rows, and scatters them otherwise: a shuffled frame must give the same answer per row
    rng = np.random.default_rng(8)
    rows = []
    for w in range(3):
        for t in range(60):
            for lay in range(4):
                ids = rng.choice(12, 3, replace=False)
                phase = "prefill" if t < 5 else "decode"
                rows += [(f"w{w}", phase, t, t, lay, r, int(e), -1) for r, e in enumerate(ids)]
    df = pd.DataFrame(rows, columns=tr.COLUMNS)
    meta = tr.TraceMeta(4, 12, 3)
    perm = rng.permutation(len(df))
    a = sim.prepare(tr.from_frame(df, meta))
    b = sim.prepare(tr.from_frame(df.iloc[perm].reset_index(drop=True), meta))
    for policy in sim.POLICIES:
        for phase in ("decode", "all"):
            for entries in (6, 20):
                ra = sim.simulate(a, policy, budget_entries=entries, phase=phase)
                rb = sim.simulate(b, policy, budget_entries=entries, phase=phase)
                assert np.array_equal(ra.predicted[perm], rb.predicted), (policy, phase, entries)
                by_name = [x.summary.sort_values("workload", ignore_index=True) for x in (ra, rb)]
                pd.testing.assert_frame_equal(*by_name)
