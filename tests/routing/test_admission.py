"""layer-lru's admission rule (``admit="always" | "second-miss"``) in pybmoe.routing.sim and
``pybmoe simulate`` (CPU only, ~3 s).

Expected values: the replay of commit 976e433 (before the rule existed) for ``always``, and
streams worked out by hand for ``second-miss``, on both implementations (the compiled core built
from the current source, and the tests' oracle, lru_oracle.py).
"""
from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest

from pybmoe.cli import simulate as simulate_cli
from pybmoe.routing import sim
from pybmoe.routing import trace as tr
from pybmoe.routing.granite import GRANITE_TRACE as GRANITE

import lru_oracle
from test_sim import mk


# --------------------------------------------------------------------------- always: today's results

# granite, decode, per workload (english_prose, code, math): hits and uploads of the layer-lru
# replay before the admission rule existed, and the first 16 hex digits of the sha256 of its
# per-lookup answers (commit 976e433, the pure-Python replay of then, now lru_oracle.py)
BEFORE = {
    (4, 0, "decode"): ((2862, 3202, 2646), (7474, 7774, 7589), "a9d9b79880ac3621"),
    (8, 0, "decode"): ((4634, 5657, 4398), (5327, 5333, 5517), "4d135015bca4e3c7"),
    (16, 0, "decode"): ((7958, 9689, 7549), (3078, 2111, 3365), "1421d0fdb74b4a1f"),
    (24, 0, "decode"): ((10287, 11257, 10250), (1451, 893, 1489), "1a963f54c2f87e6d"),
    (8, 1, "all"): ((4337, 5781, 4347), (1509, 1506, 1509), "f48d968c66f2493b"),
}


@pytest.mark.parametrize("slots,inserts,phase", list(BEFORE))
def test_always_is_the_replay_before_the_rule(granite, impl, slots, inserts, phase):
    hits, uploads, digest = BEFORE[(slots, inserts, phase)]
    for kw in ({}, {"admit": "always"}):
        r = sim.simulate(granite, "layer-lru", slots_per_layer=slots, inserts=inserts, phase=phase, **kw)
        s = r.summary.set_index("workload").loc[["english_prose", "code", "math"]]
        assert tuple(s["hits"]) == hits
        assert tuple(s["uploads"]) == uploads
        assert hashlib.sha256(r.predicted.tobytes()).hexdigest()[:16] == digest
        assert r.admit == "always" and r.admit_window is None
        assert set(s["admit"]) == {"always"} and s["admit_window"].isna().all()


# --------------------------------------------------------------------------- second-miss, by hand

# one layer, 4 experts, 2 slots, one expert per step (staging 1, no insert cap)
STREAM = [[0], [0], [0], [0], [1], [2], [1], [1], [1]]


@pytest.mark.parametrize("admit,window,expected,uploads", [
    # always: 0 missed at step 1 lands after step 2 (hits from 3); 1 (step 5) lands after 6, 2 (step 6)
    # lands after 7, evicting 0 (used at step 4; 1 was used at 7): 1 still hits at 7, 8, 9
    ("always", None, [0, 0, 1, 1, 0, 0, 1, 1, 1], 3),
    # W = 2: 0's first miss (step 1) is only remembered, its second (step 2, 1 step later) is
    # scheduled and lands after step 3: 0 hits from step 4. 1 misses at 5 (remembered) and at 7 (2
    # steps later: scheduled), lands after 8, hits at 9. 2 misses once (step 6): never uploaded
    ("second-miss", 2, [0, 0, 0, 1, 0, 0, 0, 0, 1], 2),
    # W = 1: as W = 2, except that 1's miss at step 7 is 2 steps after its miss at 5: remembered
    # only; its miss at 8 is scheduled, lands after step 9: step 9 misses
    ("second-miss", 1, [0, 0, 0, 1, 0, 0, 0, 0, 0], 2),
])
def test_second_miss_by_hand(impl, admit, window, expected, uploads):
    r = sim.simulate(mk(STREAM, n_expert=4), "layer-lru", slots_per_layer=2, admit=admit, admit_window=window)
    assert r.predicted.tolist() == expected
    assert r.summary["uploads"].tolist() == [uploads]
    assert r.summary["hits"].tolist() == [sum(expected)]
    assert r.summary["misses"].tolist() == [len(expected) - sum(expected)]
    assert r.summary["wasted"].tolist() == [0]


def test_one_off_experts_waste_uploads_only_when_always_admitted(impl):
    # 1 slot, 4 experts each used once, then 0 again. always: 0 lands after step 2, is evicted by 1
    # after step 3 without a hit (wasted), 1 by 2 after step 4 (wasted); 0's upload after step 4 is
    # still in flight at the end. second-miss (W = 4): nothing is uploaded until 0 misses again at
    # step 4 (3 steps after its first miss), and that upload is still in flight at the end
    t = mk([[0], [1], [2], [0]], n_expert=4)
    a = sim.simulate(t, "layer-lru", slots_per_layer=1)
    b = sim.simulate(t, "layer-lru", slots_per_layer=1, admit="second-miss", admit_window=4)
    assert a.predicted.tolist() == b.predicted.tolist() == [0, 0, 0, 0]
    assert (a.summary["uploads"][0], a.summary["wasted"][0]) == (3, 2)
    assert (b.summary["uploads"][0], b.summary["wasted"][0]) == (0, 0)
    # W = 2: 0's second miss is 3 steps after its first: not admitted either
    c = sim.simulate(t, "layer-lru", slots_per_layer=1, admit="second-miss", admit_window=2)
    assert c.summary["uploads"][0] == 0


def test_dropped_uploads_are_wasted(impl):
    # the stream of test_sim.test_layer_lru_drops_when_every_resident_was_just_used: 7 uploads
    # completed, 5 of them dropped; the one that landed (0 after step 2, 2 after step 5) hit first
    t = mk([[0, 1], [0, 1], [0, 1], [2, 0], [3, 1], [2, 0]], n_expert=4)
    r = sim.simulate(t, "layer-lru", slots_per_layer=1)
    assert (r.summary["uploads"][0], r.summary["wasted"][0]) == (7, 5)


def test_second_miss_window_counts_served_steps_only(impl):
    # a prefill ubatch between two decode steps is not a step: the two misses of 0 are one step apart
    t = mk([[0], [[1], [2]], [0], [3], [0]], n_expert=4)
    r = sim.simulate(t, "layer-lru", slots_per_layer=2, phase="all", admit="second-miss", admit_window=1)
    # step 1: 0 remembered; ubatch 1 not served; step 2: 0 scheduled; step 3: 3 remembered, 0 lands; step 4 hits
    assert r.predicted.tolist() == [0, -1, -1, 0, 0, 1]


def test_each_workload_starts_with_an_empty_history(impl):
    # b's first miss of 0 is its first there (a missed 0 at its own step 1): remembered only, so 0 is
    # scheduled at b's step 3 and nothing lands
    frames = [mk(steps, n_expert=4, workload=w).frame for w, steps in (("a", [[0]]), ("b", [[0], [1], [0]]))]
    t = tr.from_frame(pd.concat(frames, ignore_index=True), tr.TraceMeta(1, 4, 1))
    r = sim.simulate(t, "layer-lru", slots_per_layer=2, admit="second-miss", admit_window=2)
    assert r.predicted.tolist() == [0, 0, 0, 0]
    assert r.summary.set_index("workload")["uploads"].to_dict() == {"a": 0, "b": 0}


# --------------------------------------------------------------------------- the core against the oracle

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_core_equals_the_oracle_with_admission_on_random_traces(core, seed):
    from test_sim import random_trace
    rp = sim.prepare(random_trace(seed))
    for entries in (2, 9, 14, 30):
        for phase in ("decode", "all"):
            for inserts, max_batch in ((0, 1), (1, 1), (2, 2), (0, 3)):
                for window in (1, 2, 5):
                    kw = dict(budget_entries=entries, phase=phase, inserts=inserts, max_batch=max_batch,
                              admit="second-miss", admit_window=window)
                    a = sim.simulate(rp, "layer-lru", **kw)
                    with lru_oracle.instead_of_the_core():
                        b = sim.simulate(rp, "layer-lru", **kw)
                    assert np.array_equal(a.predicted, b.predicted), kw
                    pd.testing.assert_frame_equal(a.summary, b.summary)


def test_core_equals_the_oracle_with_admission_on_granite(core, granite):
    rp = sim.prepare(granite)
    for slots in (3, 8, 20):
        for window in (1, 4):
            kw = dict(slots_per_layer=slots, phase="all", inserts=2, admit="second-miss", admit_window=window)
            a = sim.simulate(rp, "layer-lru", **kw)
            with lru_oracle.instead_of_the_core():
                b = sim.simulate(rp, "layer-lru", **kw)
            assert np.array_equal(a.predicted, b.predicted), kw
            pd.testing.assert_frame_equal(a.summary, b.summary)


# --------------------------------------------------------------------------- errors, early and named

def test_api_errors_name_the_parameter(granite):
    with pytest.raises(sim.PolicyError, match=r"admit 'lru2'; accepted: always, second-miss"):
        sim.simulate(granite, "layer-lru", slots_per_layer=8, admit="lru2")
    for w in (0, -3, 1.5):
        with pytest.raises(sim.BudgetError, match=r"admit_window .*; accepted: an integer >= 1 \(steps\)"):
            sim.simulate(granite, "layer-lru", slots_per_layer=8, admit="second-miss", admit_window=w)
    with pytest.raises(sim.BudgetError, match="admit_window 4 given with admit 'always'"):
        sim.simulate(granite, "layer-lru", slots_per_layer=8, admit_window=4)
    with pytest.raises(sim.PolicyError, match="modelled for layer-lru only, not 'global-lru'"):
        sim.simulate(granite, "global-lru", slots_per_layer=8, admit="second-miss")
    with pytest.raises(sim.PolicyError, match="layer-lru only, not fifo"):
        sim.sweep(granite, ["layer-lru", "fifo"], [("slots_per_layer", 8)], admit="second-miss", progress=False)
    assert sim.simulate(granite, "layer-lru", slots_per_layer=8, admit="second-miss").admit_window == \
        sim.DEFAULT_ADMIT_WINDOW == 4


@pytest.mark.parametrize("args,message", [
    (["--admit-window", "0", "--admit", "second-miss"], "argument --admit-window: invalid value '0'; accepted: an integer >= 1"),
    (["--admit-window", "two", "--admit", "second-miss"], "argument --admit-window: invalid value 'two'"),
    (["--admit", "lru2"], "argument --admit: invalid choice: 'lru2'"),
    (["--admit-window", "3"], "--admit-window applies to --admit second-miss only"),
    (["--admit", "second-miss", "--policy", "layer-lru,belady"], "--admit second-miss is modelled for layer-lru only; "
                                                                  "--policy also names belady"),
    (["--admit", "second-miss", "--verify"], "--verify replays the engine"),
])
def test_cli_errors_name_the_flag(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        simulate_cli.main([str(GRANITE), "--slots-per-layer", "8", "--no-progress", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_second_miss_csv(granite, capsys):
    assert simulate_cli.main([str(GRANITE), "--slots-per-layer", "8", "--admit", "second-miss", "--admit-window", "2",
                              "--csv", "--no-progress"]) == 0
    from io import StringIO
    df = pd.read_csv(StringIO(capsys.readouterr().out))
    assert set(df["admit"]) == {"second-miss"} and set(df["admit_window"]) == {2}
    r = sim.simulate(granite, "layer-lru", slots_per_layer=8, admit="second-miss", admit_window=2)
    assert df["hits"].tolist() == r.summary["hits"].tolist()
    assert df["uploads"].tolist() == r.summary["uploads"].tolist()
    # fewer uploads than always on granite, every workload
    base = sim.simulate(granite, "layer-lru", slots_per_layer=8)
    assert (df["uploads"].to_numpy() < base.summary["uploads"].to_numpy()).all()
