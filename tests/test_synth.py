"""Trace synthesis: a synthetic trace keeps the source's per-layer LRU hit-rate curve."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pybmoe import cli, sim, synth
from pybmoe import trace as tr

REPO = Path(__file__).resolve().parents[1]
GRANITE = REPO.parent / "shared" / "data" / "granite-3.0-1b-a400m-routing.json"
SLOTS = (4, 8, 16, 24)


@pytest.fixture(scope="module")
def granite() -> tr.Trace:
    if not GRANITE.is_file():
        pytest.skip(f"the granite routing trace is not at {GRANITE} (shared data absent)")
    return tr.read_trace(GRANITE)


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
