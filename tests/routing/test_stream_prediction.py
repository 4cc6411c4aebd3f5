"""pybmoe.routing.sizing.predict_stream: the stream tier's decode predicted from a trace."""
from __future__ import annotations

import pytest

from pybmoe.routing import sim, sizing

SHAPE = sizing.ModelShape(n_layer=24, n_expert=32, top_k=8, expert_bytes=1.59375 * 2**20)


def test_the_hit_rate_is_global_lru_and_the_time_adds_compute_and_reads(granite):
    """Decode holds the budget plus the prefetch window (by default a fixed budget's: a quarter of the 32
    experts of a layer, 8): the hit rate is global-lru's with those 8 entries lent."""
    p = sizing.predict_stream(SHAPE, granite, 200.0, disk_mib_s=1000.0, resident_tok_s=20.0)
    assert p.window_experts == sizing.default_window_experts(SHAPE) == 8
    r = sim.simulate(granite, "global-lru", mib=200.0, expert_bytes=SHAPE.expert_bytes, phase="decode", lend_entries=8)
    assert p.budget_entries == r.budget_entries == int(200 // 1.59375)
    assert p.hit_rate == pytest.approx(r.hit_rate)
    # the same as 8 more entries of budget, in decode (no step there wants half a layer), and more than none
    plus = sim.simulate(granite, "global-lru", budget_entries=int(200 // 1.59375) + 8, phase="decode")
    assert r.hit_rate == pytest.approx(plus.hit_rate)
    # well above the cache cycle (192 entries; at 200 .. 240 global LRU sits on a plateau), the 8 entries buy hits
    lent = sizing.predict_stream(SHAPE, granite, 510.0, disk_mib_s=1000.0, resident_tok_s=20.0)
    none = sizing.predict_stream(SHAPE, granite, 510.0, disk_mib_s=1000.0, resident_tok_s=20.0, window_experts=0)
    assert none.window_experts == 0 and 0 < none.hit_rate < lent.hit_rate
    assert none.hit_rate == pytest.approx(sim.simulate(granite, "global-lru", mib=510.0, expert_bytes=SHAPE.expert_bytes,
                                                       phase="decode").hit_rate)
    lookups_per_token = SHAPE.n_layer * SHAPE.top_k
    assert p.miss_mib_per_token == pytest.approx((1 - r.hit_rate) * lookups_per_token * 1.59375)
    overhead = 24 * sizing.STREAM_STEP_OVERHEAD_MS / 1000
    assert p.tok_s == pytest.approx(1 / (1 / 20.0 + overhead + p.miss_mib_per_token / 1000.0))
    more = sizing.predict_stream(SHAPE, granite, 400.0, disk_mib_s=1000.0, resident_tok_s=20.0)
    assert more.hit_rate > p.hit_rate and more.tok_s > p.tok_s


def test_without_a_measured_decode_the_ram_bandwidth_gives_the_compute(granite):
    p = sizing.predict_stream(SHAPE, granite, 200.0, disk_mib_s=1000.0, ram_mib_s=10_000.0, dense_mib=240.0)
    assert p.compute_s_per_token == pytest.approx((24 * 8 * 1.59375 + 240.0) / 10_000.0 + 24 * 1.0 / 1000)


def test_a_short_run_counts_the_misses_of_its_own_tokens_from_an_empty_cache(granite):
    """llama-bench -n 8: a warm-up token and 8 timed ones, from an empty cache: the misses of tokens
    1 .. 8 of a global-lru replay of the first 9 tokens (the cold start a whole-trace hit rate hides)."""
    from pybmoe.routing import trace as tr
    f = granite.frame
    first = f[(f["workload"] == f["workload"].iloc[0]) & (f["phase"] == "decode")]
    first = first.assign(token=first["token"] - first["token"].min())
    one = tr.from_frame(first.reset_index(drop=True), granite.meta, granite.source)
    p = sizing.predict_stream(SHAPE, one, 400.0, disk_mib_s=1000.0, resident_tok_s=20.0, step_overhead_ms=0.0,
                              tokens=9, skip=1)
    def misses(n):
        t = tr.from_frame(first[first["token"] < n].reset_index(drop=True), granite.meta, granite.source)
        return int(sim.simulate(t, "global-lru", mib=400.0, expert_bytes=SHAPE.expert_bytes, phase="decode",
                                lend_entries=8).summary["misses"].sum())
    timed = misses(9) - misses(1)
    assert p.miss_mib_per_token == pytest.approx(timed * 1.59375 / 8)
    assert p.hit_rate == pytest.approx(1 - timed / (8 * 24 * 8))
    whole = sizing.predict_stream(SHAPE, one, 400.0, disk_mib_s=1000.0, resident_tok_s=20.0)
    assert whole.hit_rate > p.hit_rate  # the cold start
    with pytest.raises(sizing.SizingError):
        sizing.predict_stream(SHAPE, one, 400.0, disk_mib_s=1000.0, resident_tok_s=20.0, tokens=1, skip=1)


@pytest.mark.parametrize("kw", [dict(disk_mib_s=0.0, resident_tok_s=1.0), dict(disk_mib_s=1.0),
                                dict(disk_mib_s=1.0, resident_tok_s=-2.0),
                                dict(disk_mib_s=1.0, resident_tok_s=1.0, window_experts=-1)])
def test_bad_figures_are_refused(granite, kw):
    with pytest.raises(sizing.SizingError):
        sizing.predict_stream(SHAPE, granite, 200.0, **kw)


def test_pybmoe_size_prints_the_prediction_per_budget(capsys):
    from pybmoe import models
    from pybmoe.cli import size
    from pybmoe.routing.granite import GRANITE_TRACE
    # the granite trace's routing shape (24 layers, 32 experts, top-8) at the narrowest widths: what size
    # reads from the model is its shape (the 210 MiB GRANITE_TRACE_SPEC model cost the fast subset seconds)
    model = models.cached_model_path(models.ModelSpec(n_layer=24, n_expert=32, n_expert_used=8, n_embd=64,
                                                      n_ff_exp=64, n_head=2, n_head_kv=1, head_dim=32))
    rc = size.main(["-m", str(model), "--trace", str(GRANITE_TRACE), "--stream-mb", "2", "--stream-mb", "4",
                    "--disk-mib-s", "1000", "--resident-tok-s", "20"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("predicted ") == 2 and "--moe-stream-cache-mb 2:" in out
    assert "(+8 of the prefetch window in decode)" in out  # a quarter of the 32 experts
    assert size.main(["-m", str(model), "--stream-mb", "2"]) == 2  # no trace, no bandwidth
    assert "--stream-mb 2 needs --trace and --disk-mib-s" in capsys.readouterr().err  # names the value (issue 52)
