"""The tiers under load (docs/reliability.md, "Under load"): one ``llama-server -np 8`` with
continuous batching and churning tiers, 8 client threads of mixed greedy requests; every answer
equals the same request run alone on a tier-off server (or diverges at a near tie), none is lost,
none fails, and the tiers' counters add up. The full run is ``pybmoe load`` (8 x 200); CI runs
8 x 20. Timings go to the CSV, never into an assertion."""
from __future__ import annotations

import math

import pytest

from pybmoe.bench import load


def _answer(ids, top2=None):
    return load.Answer(list(ids), "".join(map(str, ids)), top2 or [(-1.0, -2.0)] * len(ids), 3, len(ids))


def test_compare_identical_near_tie_and_wrong():
    ref = _answer([1, 2, 3], [(-1.0, -2.0), (-1.0, -1.015), (-1.0, -3.0)])
    assert load.compare(ref, _answer([1, 2, 3])) == ("identical", -1)
    assert load.compare(ref, _answer([1, 9, 9])) == ("near_tie", 1)  # top two 0.015 apart
    assert load.compare(ref, _answer([1, 2, 9])) == ("wrong", 2)
    assert load.compare(ref, _answer([1, 2])) == ("wrong", 2)  # lost a token
    same_ids_other_text = load.Answer([1, 2, 3], "x", ref.top2, 3, 3)
    assert load.compare(ref, same_ids_other_text) == ("wrong", 3)


def test_the_pool_straddles_the_offload_boundary_and_mixes_kinds():
    pool = load.make_pool(list(range(100, 300)))
    lengths = {len(r.prompt) for r in pool if r.kind == "completion"}
    assert {31, 33} <= lengths
    assert {(r.kind, r.stream) for r in pool} == {("completion", False), ("completion", True), ("chat", False),
                                                   ("chat", True)}
    assert len({r.name for r in pool}) == len(pool)
    with pytest.raises(ValueError, match="at least"):
        load.make_pool([1, 2, 3])
    plan = load.schedule(pool, 8, 20)
    assert len(plan) == 8 and all(len(p) == 20 for p in plan) and plan == load.schedule(pool, 8, 20)


def test_counters_must_add_up():
    series = {"moe_cache_hits_total": 30, "moe_cache_misses_total": 10, "moe_stream_hits_total": 50,
              "moe_stream_misses_total": 20}
    trace = dict(rows=100, vram_hits=30, vram_misses=10, stream_hits=50, stream_misses=20)
    assert load.check_counters(series, trace, vram=True, stream=True) == []
    assert load.check_counters({**series, "moe_stream_misses_total": 19}, trace, vram=True, stream=True)
    assert load.check_counters(series, {**trace, "rows": 101}, vram=True, stream=True)  # a lookup nobody answered
    only = {"moe_stream_hits_total": 60, "moe_stream_misses_total": 40}
    assert load.check_counters(only, dict(trace, vram_hits=0, vram_misses=0, stream_hits=60, stream_misses=40),
                               vram=False, stream=True) == []
    assert load.check_counters(series, trace, vram=False, stream=True)  # VRAM counters with the tier off


def test_trace_counts_read_both_columns(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("# pybmoe-trace v1\nworkload,phase,ubatch,token,layer,rank,expert,hit,ram_hit\n"
                 "engine,decode,1,5,0,0,14,1,-1\nengine,decode,1,5,0,1,3,0,1\nengine,prefill,0,0,0,0,2,-1,0\n")
    assert load.trace_counts(p) == dict(rows=3, vram_hits=1, vram_misses=1, stream_hits=1, stream_misses=1)


def test_the_stream_budget_is_just_above_the_cycle(model_q8):
    from pybmoe.routing import sim
    entry, n_layer, _, k = sim.gguf_expert_bytes(model_q8)
    mib = load.stream_budget_mib(model_q8)
    assert n_layer * k * entry < mib * 2**20 <= (n_layer * k + 1) * entry + 2**20


@pytest.mark.parametrize("config", ["stream", "both"])
def test_under_load_every_answer_is_right_and_counted(model_q8, rpc, tmp_path, config):
    """8 clients x 20 requests on one configuration: the disk tier alone, or both tiers."""
    (r,) = load.run_load(model_q8, rpc.endpoint, configs=[config], clients=8, per_client=20, n_predict=(4, 8, 12),
                         timeout_s=120, log_dir=tmp_path)
    summary, per_request = load.write_csv([r], tmp_path)
    assert summary.exists() and per_request.exists()
    detail = load.format_result(r) + "\n" + "\n".join(
        f"{o.request}: {o.verdict} at {o.first_diff} {o.error}" for o in r.outcomes if o.verdict in ("error", "wrong"))
    # no request fails, none is lost, every answer is there: these hold now
    assert r.requests == 160 and r.answered == 160 and (r.errors, r.lost) == (0, 0), detail
    assert r.identical + r.near_tie + r.wrong == 160 and not math.isnan(r.p50_ms)
    assert r.stream_hits > 0 and r.stream_misses > 0 and (config != "both" or r.vram_hits > 0)
    # every answer equals the lone run (flash attention off: stock under load is bit-identical), and
    # each tier's counters add up to the trace's lookups
    assert r.wrong == 0 and not r.counter_problems, detail
    assert r.ok
