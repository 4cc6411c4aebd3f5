"""Trace synthesis: a synthetic trace keeps the source's per-layer LRU hit-rate curve."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pybmoe import cli
from pybmoe.routing import sim, synth
from pybmoe.routing import trace as tr
from pybmoe.routing.granite import GRANITE_TRACE as GRANITE  # the bundled copy (MIT notice beside it)

SLOTS = (4, 8, 16, 24)


def per_layer_hit_pct(t: tr.Trace, slots: int) -> tuple[pd.Series, float]:
    """The engine policy's (layer-lru) decode hit rate per layer and pooled, in percent."""
    r = sim.simulate(t, "layer-lru", slots_per_layer=slots, phase="decode")
    m = r.counted
    df = pd.DataFrame({"layer": t.frame["layer"].to_numpy()[m], "hit": r.predicted[m] == 1})
    return df.groupby("layer")["hit"].mean() * 100, 100 * r.hit_rate


def test_stack_distances_small_case():
    # stack before each token: [], [1 2], [2 3 1]  (most recent first; a token's experts in rank order)
    steps = [np.array([1, 2]), np.array([2, 3]), np.array([1, 2])]
    depth: list[int] = []
    d = synth.stack_distances(steps, depth)
    assert d.tolist() == [-1, -1, 1, -1, 2, 0]
    assert depth == [0, 2, 3]
    # an empty step starts a new workload
    assert synth.stack_distances([np.array([1]), np.array([], dtype=np.int64), np.array([1])]).tolist() == [-1, -1]


def test_synthetic_keeps_the_per_layer_lru_curve(granite):
    # workloads as long as the source's (64 decode tokens), so both pay the same cold starts; the
    # source's curve per layer rests on 3 x 64 x 8 = 1,536 lookups, hence 5 points per layer
    syn = synth.synthesize(granite, 64, seed=1, workloads=32)
    assert len(syn.frame) == 32 * 64 * 24 * 8
    for s in SLOTS:
        src_l, src_all = per_layer_hit_pct(granite, s)
        syn_l, syn_all = per_layer_hit_pct(syn, s)
        assert list(src_l.index) == list(syn_l.index)
        assert abs(syn_all - src_all) < 2.0, (s, src_all, syn_all)
        worst = float((syn_l - src_l).abs().max())
        assert worst < 5.0, (s, worst)


def test_long_trace_keeps_the_reuse(granite):
    syn = synth.synthesize(granite, 1500, seed=3)
    assert syn.workloads == ["synth"]
    # reuse within 1, 2 and 8 tokens (warm lookups) as in the source, within 3 points
    a = tr.reuse_histogram(granite.select("decode")).set_index("distance")["cum_share"]
    b = tr.reuse_histogram(syn).set_index("distance")["cum_share"]
    for col in ("1", "2", "5-8"):
        assert abs(a[col] - b[col]) < 0.03, (col, a[col], b[col])
    # below the source's reach the engine policy's hit rate carries over to the long trace
    for s in (4, 8):
        assert abs(per_layer_hit_pct(syn, s)[1] - per_layer_hit_pct(granite, s)[1]) < 3.0


def test_shape_determinism_and_format(granite, tmp_path):
    a = synth.synthesize(granite, 50, seed=1)
    b = synth.synthesize(granite, 50, seed=1)
    c = synth.synthesize(granite, 50, seed=2)
    pd.testing.assert_frame_equal(a.frame, b.frame)
    assert not a.frame["expert"].equals(c.frame["expert"])
    f = a.frame
    assert set(f["phase"]) == {"decode"} and (f["hit"] == -1).all()
    assert (f["token"] == f["ubatch"]).all()
    assert sorted(f["layer"].unique()) == list(range(24))
    # k distinct experts per token and layer, in range
    g = f.groupby(["token", "layer"])["expert"]
    assert (g.nunique() == 8).all() and (g.size() == 8).all()
    assert f["expert"].between(0, 31).all()
    # the engine's --moe-trace CSV, read back unchanged
    out = tr.write_trace(a, tmp_path / "synth.csv")
    first = out.read_text().splitlines()[0]
    assert first.startswith("# pybmoe-trace v1 n_layer=24 n_expert=32 n_expert_used=8")
    back = tr.read_trace(out)
    assert back.meta.n_expert_used == 8 and back.meta.extra["synth_seed"] == "1"
    assert back.frame["expert"].tolist() == f["expert"].tolist()


def test_cli(granite, tmp_path, capsys):
    out = tmp_path / "long.csv"
    assert cli.main(["trace", "synth", "--from", str(GRANITE), "--steps", "40", "--seed", "5", "--out", str(out)]) == 0
    t = tr.read_trace(out)
    assert t.frame["token"].max() == 39 and t.meta.n_expert == 32
    assert cli.main(["trace", "synth", "--from", str(GRANITE), "--steps", "0", "--out", str(out)]) == 2
    assert "steps=0" in capsys.readouterr().err


def test_bad_arguments(granite):
    with pytest.raises(ValueError, match="steps"):
        synth.synthesize(granite, 0)
    with pytest.raises(ValueError, match="block"):
        synth.synthesize(granite, 10, block=0.5)
    with pytest.raises(ValueError, match="no decode rows"):
        synth.synthesize(granite.select("prefill"), 10)


# --- the shape map: a trace for another model's shape (route replay on a synthetic big model) ---

def test_map_writes_the_target_shape(granite, tmp_path):
    m = synth.synthesize(granite, 40, seed=2, n_layer=48, n_expert=128)
    f = m.frame
    assert sorted(f["layer"].unique()) == list(range(48))
    assert f["expert"].between(0, 127).all() and f["rank"].between(0, 7).all()
    g = f.groupby(["token", "layer"])["expert"]
    assert (g.nunique() == 8).all() and (g.size() == 8).all()
    # layers that share a source layer are relabelled independently
    assert not f[f.layer == 0]["expert"].equals(f[f.layer == 24]["expert"].reset_index(drop=True))
    # every expert id can occur (the relabelling covers all 128)
    assert f["expert"].nunique() > 120
    out = tr.write_trace(m, tmp_path / "m.csv")
    head = out.read_text().splitlines()[0]
    assert head.startswith("# pybmoe-trace v1 n_layer=48 n_expert=128 n_expert_used=8")
    assert "synth_map_from=L24xE32xK8" in head and "synth_distance_scale=4" in head
    # the map is deterministic per seed
    pd.testing.assert_frame_equal(f, synth.synthesize(granite, 40, seed=2, n_layer=48, n_expert=128).frame)


def test_map_keeps_the_curve_at_the_same_fraction_of_experts(granite):
    """E_src/2 = 16 of 32 slots on granite against 64 of 128 on the mapped trace (and 8 -> 32,
    24 -> 96). Long workloads on both synthetic sides: a mapped workload must fill a stack 4x as
    deep, so short ones pay 4x the cold misses (docs/traces.md)."""
    plain = synth.synthesize(granite, 1024, seed=1, workloads=2)
    mapped = synth.synthesize(granite, 1024, seed=1, workloads=2, n_layer=48, n_expert=128)
    src_of = np.arange(48) % 24
    for s in (8, 16, 24):
        src_l, src_all = per_layer_hit_pct(granite, s)
        p_l, p_all = per_layer_hit_pct(plain, s)
        m_l, m_all = per_layer_hit_pct(mapped, 4 * s)
        assert abs(m_all - p_all) < 2.0, (s, p_all, m_all)
        assert abs(m_all - src_all) < 5.0, (s, src_all, m_all)
        d = m_l.to_numpy() - p_l.to_numpy()[src_of]
        assert float(np.abs(d).mean()) < 3.0 and float(np.abs(d).max()) < 12.0, (s, d)
        # and per layer, roughly the source's own curve
        assert float(np.abs(m_l.to_numpy() - src_l.to_numpy()[src_of]).mean()) < 5.0, s


def test_map_top_k_and_errors(granite, tmp_path, capsys):
    m = synth.synthesize(granite, 20, seed=0, n_layer=6, n_expert=64, top_k=4)
    assert m.meta.n_expert_used == 4 and m.frame["rank"].max() == 3 and m.meta.n_layer == 6
    assert (m.frame.groupby(["token", "layer"])["expert"].nunique() == 4).all()
    with pytest.raises(ValueError, match="no rows for more ranks"):
        synth.synthesize(granite, 10, top_k=10)
    with pytest.raises(ValueError, match="top_k=8 is out of range"):
        synth.synthesize(granite, 10, n_expert=4)
    with pytest.raises(ValueError, match="distance_scale"):
        synth.synthesize(granite, 10, n_expert=64, distance_scale=0)
    out = tmp_path / "cli.csv"
    assert cli.main(["trace", "synth", "--from", str(GRANITE), "--steps", "16", "--n-layer", "30", "--n-expert", "96",
                     "--out", str(out)]) == 0
    t = tr.read_trace(out)
    assert (t.meta.n_layer, t.meta.n_expert, t.meta.n_expert_used) == (30, 96, 8)
    assert "30 layers, 96 experts, top-8" in capsys.readouterr().out
    assert cli.main(["trace", "synth", "--from", str(GRANITE), "--steps", "16", "--top-k", "9", "--out", str(out)]) == 2


def test_a_uniform_trace_has_no_locality():
    """`pybmoe trace synth --uniform`: top-k distinct experts per (token, layer), uniformly drawn, so a
    global LRU of B entries hits about B / (n_layer * n_expert) of its lookups (the worst case)."""
    import numpy as np
    from pybmoe.routing import sim
    t = synth.uniform(1500, n_layer=4, n_expert=32, top_k=4, seed=3)
    f = t.frame
    assert len(f) == 1500 * 4 * 4 and t.meta.n_expert == 32 and t.meta.n_expert_used == 4
    per = f.groupby(["token", "layer"]).expert.nunique()
    assert (per == 4).all()
    counts = np.bincount(f.expert, minlength=32)
    assert counts.min() > 0.85 * counts.mean()
    r = sim.simulate(t, "global-lru", budget_entries=64, phase="decode")
    assert abs(r.hit_rate - 64 / 128) < 0.05  # about B / N: a step never repeats an expert of its layer
    assert synth.uniform(10, n_layer=2, n_expert=8, top_k=2, seed=1).frame.equals(
        synth.uniform(10, n_layer=2, n_expert=8, top_k=2, seed=1).frame)
    with pytest.raises(ValueError, match="top_k=9 is out of range"):
        synth.uniform(10, n_layer=2, n_expert=8, top_k=9)


def test_the_cli_wants_a_shape_for_a_uniform_trace(tmp_path, capsys):
    from pybmoe.cli import trace as trace_cli
    assert trace_cli.main(["synth", "--uniform", "--steps", "4", "--out", str(tmp_path / "u.csv")]) == 2
    assert "--uniform needs --n-layer, --n-expert and --top-k" in capsys.readouterr().err
    assert trace_cli.main(["synth", "--uniform", "--steps", "4", "--n-layer", "2", "--n-expert", "8", "--top-k", "2",
                           "--out", str(tmp_path / "u.csv")]) == 0
    from pybmoe.routing import trace as tr
    assert len(tr.read_trace(tmp_path / "u.csv").frame) == 4 * 2 * 2
