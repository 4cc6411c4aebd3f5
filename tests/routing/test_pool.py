"""The VRAM tier's pool in pybmoe.routing.sim: one bank over (layer, expert) entries, its guard, its
timings, ClassLRU, the compiled core against the tests' oracle (lru_oracle.py), and ``pybmoe simulate --mib``
(CPU only, a few seconds).

Expected values are worked out by hand from the rule in docs/expert-cache.md ("The pool"), or are
another policy's replay where the rule reduces to it (partitioned: layer-lru; instant and
unguarded: global-lru). Every replay runs on both implementations: the compiled core (built from
pybmoe/routing/_simcore.c into a temporary folder) and the oracle.
"""
from __future__ import annotations

from io import StringIO

import numpy as np
import pandas as pd
import pytest

from pybmoe.cli import simulate
from pybmoe.routing import sim
from pybmoe.routing import trace as tr
from pybmoe.routing.granite import GRANITE_TRACE as GRANITE

import lru_oracle


def trace_of(steps, *, n_expert: int, top_k: int | None = None, phases=None) -> tr.Trace:
    """``steps``: ubatches, each ``{layer: [token's ids, ...]}`` (a layer missing from a ubatch has no
    rows there), or ``{layer: ids}`` for one token. Tokens are numbered through."""
    rows, tok = [], 0
    for u, ub in enumerate(steps):
        per_layer = {l: ([ids] if ids and isinstance(ids[0], int) else ids) for l, ids in ub.items()}
        n_tok = max(len(v) for v in per_layer.values())
        for layer, tokens in sorted(per_layer.items()):
            for j, ids in enumerate(tokens):
                rows += [("w", (phases or {}).get(u, "decode"), u, tok + j, layer, r, e, -1) for r, e in enumerate(ids)]
        tok += n_tok
    df = pd.DataFrame(rows, columns=tr.COLUMNS)
    k = top_k or int(df.groupby(["ubatch", "token", "layer"]).size().max())
    return tr.from_frame(df, tr.TraceMeta(int(df["layer"].max()) + 1, n_expert, k))


def per_layer_hits(t: tr.Trace, r: sim.SimResult) -> list[int]:
    f = t.frame
    return [int(((r.predicted == 1) & (f["layer"].to_numpy() == l)).sum()) for l in sorted(f["layer"].unique())]


# --------------------------------------------------------------------------- the rule on hand-made traces

def test_the_bank_is_shared_between_layers(impl):
    """Layer 0 alternates experts 0 and 1, layer 1 always picks 0; a bank of 3 entries. The pool gives
    layer 0 two slots: resident from step 3 on (a miss at step s is resident from s + 2), so every
    lookup hits after the first two steps. Per-layer slots (1 each) keep missing the alternation:
    0 hits at odd steps from 3 on, and 1 is dropped each time (its victim was selected at the last step)."""
    t = trace_of([{0: [s % 2], 1: [0]} for s in range(10)], n_expert=4)
    for policy in ("pool", "pool-global"):
        r = sim.simulate(t, policy, budget_entries=3)
        assert r.predicted.tolist() == [0, 0, 0, 0] + [1] * 16, policy
        assert int(r.summary["uploads"][0]) == 3                      # 0 and 4 after step 2, 1 after step 3
    lru = sim.simulate(t, "layer-lru", budget_entries=3)
    assert per_layer_hits(t, lru) == [4, 8]                           # steps 3, 5, 7, 9 | steps 3 .. 10


def test_the_floor_keeps_a_layer_its_slots(impl):
    """top-4 of 8 experts, 2 layers, a bank of 4 (floor-half-k: floor min(4, 4 // 2) // 2 = 1). Layer 0
    picks 0..3 at every step and fills the bank (resident after step 2); layer 1 starts at step 4 with
    0..3. Unguarded, every resident is selected at every step, so layer 1's uploads are all dropped and
    it never hits. With the floor, layer 1 (under it) takes layer 0's least entry (0, selected at the
    last step) after step 5: from step 6 on, layer 0 hits 3 of 4 and layer 1 1 of 4."""
    steps = [{0: [0, 1, 2, 3]} for _ in range(3)] + [{0: [0, 1, 2, 3], 1: [0, 1, 2, 3]} for _ in range(7)]
    t = trace_of(steps, n_expert=8)
    assert sim.guard_params("floor-half-k", 4, 2, 4, 8) == (1, 0)
    glob = sim.simulate(t, "pool-global", budget_entries=4)
    assert per_layer_hits(t, glob) == [4 * 8, 0]                      # steps 3 .. 10
    pool = sim.simulate(t, "pool", budget_entries=4)
    assert per_layer_hits(t, pool) == [4 * 3 + 3 * 5, 5]              # steps 3 .. 5, then 6 .. 10
    # uploads settled: 4 after step 2; 4 after step 5 (1 in, 3 dropped); 3 dropped after step 6; then
    # 4 dropped after each of steps 7 .. 10 (0 of layer 0 and 9, 10, 11 of layer 1)
    s = pool.summary.iloc[0]
    assert int(s["uploads"]) == 4 + 4 + 3 + 4 * 4 and int(s["wasted"]) == 3 + 3 + 4 * 4


def test_duplicate_ids_and_multi_token_ubatches(impl):
    """A ubatch of two tokens that both pick expert 0: sync, both lookups miss and one upload is
    scheduled; it is resident after the next ubatch. Instant: the first lookup admits it, the second hits."""
    t = trace_of([{0: [[0], [0]]}, {0: [[0], [0]]}, {0: [[0], [0]]}], n_expert=4)
    r = sim.simulate(t, "pool", budget_entries=2, max_batch=2)
    assert r.predicted.tolist() == [0, 0, 0, 0, 1, 1]
    assert int(r.summary["uploads"][0]) == 1
    r = sim.simulate(t, "pool", budget_entries=2, timing="instant")
    assert r.predicted.tolist() == [0, 1, 1, 1, 1, 1]
    # max_batch 1: the two-token ubatches are not served (-1, counted as misses), nothing is uploaded
    r = sim.simulate(t, "pool", budget_entries=2, max_batch=1)
    assert r.predicted.tolist() == [-1] * 6 and r.hit_rate == 0.0


def test_victim_ties_go_to_the_lowest_entry(impl):
    """Bank of 3, two layers. Steps 1-2 pick expert 0 in both layers (entries 0 and 4: they land after
    step 2), step 3 picks 1 in both (entries 1, 5), step 4 picks 2 in both, step 5 picks 0 in both. After
    step 4, 1 takes the free slot and 5 needs a victim among those not selected at step 4: 0 and 4 (last
    selected at step 2) and 1 (step 3). 0 and 4 tie on the step; the lower entry, layer 0's, goes. So at
    step 5 layer 0 misses and layer 1 hits."""
    t = trace_of([{0: [0], 1: [0]}, {0: [0], 1: [0]}, {0: [1], 1: [1]}, {0: [2], 1: [2]}, {0: [0], 1: [0]}],
                 n_expert=4)
    r = sim.simulate(t, "pool-global", budget_entries=3)
    assert r.predicted.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    # the lag: a miss at step s is resident from s + 2, so repeats at s + 1 miss
    t = trace_of([{0: [0]}, {0: [0]}, {0: [0]}], n_expert=4)
    assert sim.simulate(t, "pool-global", budget_entries=3).predicted.tolist() == [0, 0, 1]


def test_classlru_keeps_the_frequent_entry(impl):
    """Instant, one layer, 2 slots: A used at tokens 1-5 (CRF ~4.9, class 2), B at 6, C at 7, D at 8,
    A at 9. ClassLRU evicts the largest age / 2**class: at 7, B (1 / 1) before A (2 / 4); at 8, C
    (1 / 1) before A (3 / 4); so A hits at 9. LRU evicts A at 7 and misses it at 9."""
    A, B, C, D = 0, 1, 2, 3
    t = trace_of([{0: [e]} for e in (A, A, A, A, A, B, C, D, A)], n_expert=4)
    r = sim.simulate(t, "classlru", budget_entries=2)
    assert r.predicted.tolist() == [0, 1, 1, 1, 1, 0, 0, 0, 1]
    r = sim.simulate(t, "global-lru", budget_entries=2)
    assert r.predicted.tolist() == [0, 1, 1, 1, 1, 0, 0, 0, 0]


def test_crf_fixed_point():
    # the oracle's CRF (the core's is the same arithmetic, checked through the replays and the decay table)
    use, cls = lru_oracle.crf_use, lru_oracle.crf_class
    one = 1 << sim.CRF_FRAC_BITS
    assert use(0, 0) == one and cls(one) == 0
    assert use(one, 128) == one + one // 2                            # half-life 128 tokens: 1 / 2 + 1
    assert use(one, 256) == one + one // 4
    c = one
    for _ in range(2):
        c = use(c, 1)
    assert c / one == pytest.approx(1 + 2 ** (-1 / 128) + 2 ** (-2 / 128), rel=1e-6) and cls(c) == 1
    for _ in range(5000):                                             # used at every token: 1 / (1 - 2**(-1/128))
        c = use(c, 1)
    assert c / one == pytest.approx(1 / (1 - 2 ** (-1 / 128)), rel=1e-4)  # 185.2
    assert cls(c) == 7 == sim.CRF_CLASSES - 1                         # upstream's 8 classes: 0 .. 7
    assert use(c, 10 ** 9) == one                                     # decayed to nothing


def test_crf_decay_table_of_the_core(core):
    lib = sim._load_core()
    assert [lib.pybmoe_sim_crf_decay(j) for j in range(sim.CRF_HALF_LIFE)] == list(lru_oracle.CRF_DECAY)
    assert lru_oracle.CRF_DECAY[0] == 2 ** 30 and lru_oracle.CRF_DECAY[64] == round(2 ** 29.5)


def test_guard_params():
    # granite: 24 layers, top-8 of 32
    assert sim.guard_params("floor-half-k", 24 * 3, 24, 8, 32) == (1, 0)      # under the cycle: share 3
    assert sim.guard_params("floor-half-k", 24 * 16, 24, 8, 32) == (4, 0)     # above: half the top-k
    assert sim.guard_params("floor-k", 24 * 16, 24, 8, 32) == (8, 0)
    assert sim.guard_params("floor-share", 24 * 16 + 5, 24, 8, 32) == (16, 0)
    assert sim.guard_params("partition", 24 * 40, 24, 8, 32) == (0, 32)
    assert sim.guard_params("none", 500, 24, 8, 32) == (0, 0)
    with pytest.raises(sim.PolicyError, match="accepted: none, floor-half-k"):
        sim.guard_params("floor", 100, 24, 8, 32)


def test_pool_options_refused():
    t = trace_of([{0: [0]}], n_expert=4)
    with pytest.raises(sim.PolicyError, match="guard 'x'; accepted"):
        sim.simulate(t, "pool", budget_entries=1, guard="x")
    with pytest.raises(sim.PolicyError, match="timing 'later'; accepted: sync, instant"):
        sim.simulate(t, "pool", budget_entries=1, timing="later")
    with pytest.raises(sim.PolicyError, match="the pool's"):
        sim.simulate(t, "layer-lru", budget_entries=1, guard="none")


# --------------------------------------------------------------------------- where the rule reduces to another

def layered_trace(seed: int, *, E: int = 9, L: int = 4, K: int = 3, n: int = 60, multi: bool = True) -> tr.Trace:
    """Every layer has rows in every ubatch (as in the engine); a prefill of a few tokens first, then
    decode ubatches of 1 token (and some of 2 or 3 when ``multi``); Zipf-skewed experts; 2 workloads."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, E + 1) ** 1.1
    frames = []
    for wl in range(2):
        rows, tok = [], 0
        ubs = [("prefill", 3)] + [("decode", int(rng.choice([1, 1, 1, 2, 3] if multi else [1]))) for _ in range(n)]
        for u, (phase, n_tok) in enumerate(ubs):
            for _ in range(n_tok):
                for lay in range(L):
                    ids = rng.choice(E, K, replace=False, p=rng.permutation(w) / w.sum())
                    rows += [(f"w{wl}", phase, u, tok, lay, r, int(e), -1) for r, e in enumerate(ids)]
                tok += 1
        frames.append(pd.DataFrame(rows, columns=tr.COLUMNS))
    return tr.from_frame(pd.concat(frames, ignore_index=True), tr.TraceMeta(L, E, K))


@pytest.mark.parametrize("seed", [0, 1])
def test_partitioned_pool_is_layer_lru(impl, seed):
    """Per-layer slots are the pool partitioned: equal event for event, uploads and wasted uploads too
    (one-token steps; the prefill's ubatches are not served and still settle the uploads)."""
    rp = sim.prepare(layered_trace(seed))
    for slots in (1, 2, 3, 5, 9):
        for max_batch in (1,):
            for phase in ("decode", "all"):
                a = sim.simulate(rp, "pool", slots_per_layer=slots, guard="partition", max_batch=max_batch,
                                 phase=phase)
                b = sim.simulate(rp, "layer-lru", slots_per_layer=slots, max_batch=max_batch, phase=phase)
                assert np.array_equal(a.predicted, b.predicted), (slots, max_batch, phase)
                assert a.summary["uploads"].tolist() == b.summary["uploads"].tolist()
                assert a.summary["wasted"].tolist() == b.summary["wasted"].tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_instant_unguarded_pool_is_global_lru(impl, seed):
    rp = sim.prepare(layered_trace(seed))
    for entries in (0, 1, 3, 7, 12, 20, 36):
        for phase in ("decode", "all"):
            a = sim.simulate(rp, "pool-global", budget_entries=entries, timing="instant", phase=phase)
            b = sim.simulate(rp, "global-lru", budget_entries=entries, phase=phase)
            assert np.array_equal(a.predicted, b.predicted), (entries, phase)
            assert a.summary["uploads"].tolist() == b.summary["uploads"].tolist()


def test_core_equals_the_oracle(core):
    """Every guard, timing and order, at budgets from none to all, on traces with multi-token ubatches,
    prefills, two workloads and a layer missing from some ubatches."""
    ts = [layered_trace(2), layered_trace(3, E=16, L=3, K=4, n=40)]
    f = ts[0].frame
    ts.append(tr.from_frame(f[~((f["layer"] == 2) & (f["ubatch"] % 5 == 1))].reset_index(drop=True), ts[0].meta))
    for t in ts:
        rp = sim.prepare(t)
        for policy in ("pool", "pool-classlru"):      # the two orders; guard and timing are given
            for guard in sim.POOL_GUARDS:
                for timing in sim.POOL_TIMINGS:
                    for entries in (2, rp.n_layer * 2, rp.n_layer * 3 + 1, rp.n_entries - 2):
                        kw = dict(budget_entries=entries, guard=guard, timing=timing, max_batch=2, phase="all")
                        a = sim.simulate(rp, policy, **kw)
                        with lru_oracle.instead_of_the_core():
                            b = sim.simulate(rp, policy, **kw)
                        assert np.array_equal(a.predicted, b.predicted), (policy, kw)
                        pd.testing.assert_frame_equal(a.summary, b.summary)


def test_default_pool_on_granite_holds_per_layer_slots_and_never_collapses(core):
    """Granite decode, 8 slots per layer (the cycle) and 4 (under it): the default pool is within a
    point of per-layer slots and far from the unguarded instant LRU's collapse (0 % under the cycle,
    docs/traces.md); its worst layer keeps hits. Values: docs/benchmarks/vram-pool-sim/hit-rates.csv."""
    t = tr.read_trace(GRANITE).select("decode")
    rp = sim.prepare(t)
    for slots, pool_hit, lru_hit in ((4, 0.247, 0.236), (8, 0.400, 0.398)):
        pool = sim.simulate(rp, "pool", slots_per_layer=slots)
        assert pool.hit_rate == pytest.approx(pool_hit, abs=5e-4)
        assert sim.simulate(rp, "layer-lru", slots_per_layer=slots).hit_rate == pytest.approx(lru_hit, abs=5e-4)
        assert sim.simulate(rp, "global-lru", slots_per_layer=slots).hit_rate < 0.42
        hits = np.bincount(rp.lay, weights=pool.predicted == 1, minlength=rp.n_layer)
        assert hits.min() > 0


# --------------------------------------------------------------------------- pybmoe simulate --mib

def test_cli_mib_sizes_the_pool(capsys):
    argv = [str(GRANITE), "--policy", "pool,layer-lru", "--csv", "--no-progress", "--expert-mib", "0.75"]
    assert simulate.main(argv + ["--mib", "144,150"]) == 0
    df = pd.read_csv(StringIO(capsys.readouterr().out))
    # 144 MiB / 0.75 MiB = 192 entries (8 slots per layer); 150 MiB = 200 entries, per-layer slots 8
    got = df.groupby(["policy", "budget_entries"])["budget_mib"].first().to_dict()
    assert got == {("layer-lru", 192): 144.0, ("pool", 192): 144.0, ("pool", 200): 150.0}
    want = sim.simulate(tr.read_trace(GRANITE), "pool", budget_entries=200).summary
    assert df[(df["policy"] == "pool") & (df["budget_entries"] == 200)]["hits"].tolist() == want["hits"].tolist()
    # the report shows the MiB beside the slots
    assert simulate.main(argv[:3] + ["--no-progress", "--expert-mib", "0.75", "--mib", "144"]) == 0
    out = capsys.readouterr().out
    assert "budget_mib" in out and "144.000" in out


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf", "1,-2"])
def test_cli_mib_bad_values_refused_in_one_line(capsys, value):
    assert simulate.main([str(GRANITE), "--policy", "pool", "--no-progress", "--expert-mib", "0.75",
                          f"--mib={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pybmoe simulate: error: --mib {value}; accepted: a finite number of MiB >= 0 per device; "
                   "576 MiB hold every expert of the trace"]


def test_cli_expert_mib_and_model_refused(capsys):
    assert simulate.main([str(GRANITE), "--policy", "pool", "--mib", "10", "--expert-mib", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("pybmoe simulate: error: --expert-mib 0; accepted: a finite number "
                                               "of MiB > 0")
    assert simulate.main([str(GRANITE), "--policy", "pool", "--mib", "10"]) == 2
    assert "accepted: -m MODEL.gguf or --expert-mib X" in capsys.readouterr().err
