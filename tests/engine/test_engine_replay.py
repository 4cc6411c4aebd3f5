"""The replay simulator reproduces the engine's own hits and misses, event for event.

The engine writes its routing and each lookup's hit/miss with --moe-trace; pybmoe.routing.sim replays the
routing through its layer-lru policy (the engine's policy, re-implemented in the simulator's compiled
core, which tests/routing/ holds to a plain Python statement of the rule) and must predict every hit
and miss the engine recorded.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pybmoe import engine, models
from pybmoe.cli import demo as demo_cli
from pybmoe.engine import demo
from pybmoe.routing import granite, sim
from pybmoe.routing import trace as tr

PROMPT = "Once upon a time, in a land of many experts,"


def _engine_trace(model: Path, rpc, slots: int, inserts: int, tmp: Path, n_predict: int = 48):
    path = tmp / f"trace-{slots}-{inserts}.csv"
    run = engine.run_logits(model, tmp / "l.bin", [*engine.host_experts_args(rpc.endpoint),
                                                   *engine.cache_args(slots, inserts, sync=True), "--moe-trace", str(path)],
                            prompt=PROMPT, n_predict=n_predict, ctx=512, timeout=600)
    return path, run.layers


@pytest.mark.parametrize("inserts", [1, 0])
@pytest.mark.parametrize("slots_of", ["1", "top-k", "half", "all"])
def test_replay_matches_engine_event_for_event(model_q8, rpc, tmp_path, slots_of, inserts):
    spec = models.read_spec(model_q8)
    slots = {"1": 1, "top-k": spec.n_expert_used, "half": spec.n_expert // 2, "all": spec.n_expert}[slots_of]
    path, layers = _engine_trace(model_q8, rpc, slots, inserts, tmp_path)

    t = tr.read_trace(path)
    assert t.meta.slots == slots and t.meta.inserts == inserts
    f = t.frame
    decode = f[f["phase"] == "decode"]
    assert len(decode) == spec.n_layer * spec.n_expert_used * 47  # 47 single-token decode steps
    assert (decode["hit"] >= 0).all() and (f[f["phase"] == "prefill"]["hit"] == -1).all()

    res = sim.engine_replay(t)
    bad = sim.compare_with_engine(t, res)
    assert bad.empty, f"{len(bad)} lookups differ, first:\n{bad.head()}"

    # and the engine's own counters agree with its trace
    for il, (hits, misses) in layers.items():
        d = decode[decode["layer"] == il]
        assert (int((d["hit"] == 1).sum()), int((d["hit"] == 0).sum())) == (hits, misses)


def test_replay_matches_engine_across_server_requests(model_q8, rpc, tmp_path):
    """Two requests through llama-server: prefill and decode interleave, the cache stays warm."""
    path = tmp_path / "server-trace.csv"
    extra = ["--moe-trace", str(path), "--moe-expert-cache-sync"]  # exact replay needs deterministic visibility
    srv = engine.LlamaServer(demo.server_args(model_q8, rpc.endpoint, 6, 2, extra))
    with srv:
        srv.completion(PROMPT, n_predict=24)
        srv.completion("A different prompt about the sea", n_predict=24)
    srv.stop()
    t = tr.read_trace(path)
    f = t.frame
    assert set(f["phase"]) == {"prefill", "decode"}
    assert (f["hit"] >= 0).sum() > 0
    bad = sim.compare_with_engine(t, sim.engine_replay(t))
    assert bad.empty, f"{len(bad)} lookups differ"


def test_trace_without_cache_is_routing_only(model_q8, rpc, tmp_path):
    path = tmp_path / "off.csv"
    engine.run_logits(model_q8, tmp_path / "l.bin", [*engine.host_experts_args(rpc.endpoint), "--moe-trace", str(path)],
                      prompt=PROMPT, n_predict=8, ctx=512)
    f = tr.read_trace(path).frame
    assert (f["hit"] == -1).all()
    spec = models.read_spec(model_q8)
    # every decode token has top-k distinct experts per layer
    d = f[f["phase"] == "decode"]
    per = d.groupby(["token", "layer"])["expert"].nunique()
    assert (per == spec.n_expert_used).all() and len(per) == 7 * spec.n_layer
    assert np.all((f["expert"] >= 0) & (f["expert"] < spec.n_expert))


@pytest.fixture(scope="module")
def granite_replay():
    """(model of the granite trace's shape, the trace as engine CSV, prompt tokens): granite.granite_replay();
    not conftest's ``granite``, which is the trace itself."""
    return granite.granite_replay()


@pytest.mark.parametrize("slots", [6, 16])
def test_replay_matches_engine_on_real_routing(granite_replay, rpc, tmp_path, slots):
    """The granite trace replayed through a model of its shape (--moe-route-replay): the engine's
    hits and misses on real routing are the simulator's, lookup for lookup, and the routing the
    engine saw is the trace's."""
    model, csv, n_prompt = granite_replay
    path = tmp_path / "seen.csv"
    n_predict = 24
    engine.run_logits(model, tmp_path / "l.bin", [*engine.host_experts_args(rpc.endpoint), *engine.cache_args(slots, sync=True),
                                                  "--moe-route-replay", str(csv), "--moe-trace", str(path)],
                      prompt=" ".join(["hello"] * (n_prompt - 1)), n_predict=n_predict, ctx=512, timeout=600)
    t = tr.read_trace(path)
    f = t.frame
    decode = f[f["phase"] == "decode"]
    assert len(decode) == 24 * 8 * (n_predict - 1)
    bad = sim.compare_with_engine(t, sim.engine_replay(t))
    assert bad.empty, f"{len(bad)} lookups differ"
    # the decode steps routed exactly as the trace's first tokens after the engine's prompt
    src = tr.read_trace(csv).frame
    n_tok_engine = int(f["token"].max()) + 1
    want = src[(src["workload"] == "english_prose") & (src["token"] < n_tok_engine)]
    got = f[f["phase"] == "decode"].merge(want, on=["token", "layer", "rank"], suffixes=("", "_src"))
    assert len(got) == len(decode) and (got["expert"] == got["expert_src"]).all()
    hit = (decode["hit"] == 1).mean()
    assert 0.2 < hit < 0.99  # real locality: neither all misses nor all hits


def test_demo_replays_granite_routing(granite_replay):
    lines: list[str] = []
    off, on = demo_cli.run_demo(route_replay="granite", n_predict=16, out=lines.append)
    assert off.text == on.text and on.tokens_predicted == 16
    s = on.summary
    assert s is not None and 0 < s.hit_pct < 100 and s.uploads > 0
    assert any("replayed from" in l for l in lines)
    assert any("IDENTICAL" in l for l in lines)


@pytest.mark.parametrize("window", [1, 4])
@pytest.mark.parametrize("slots_of", ["top-k", "half"])
def test_replay_matches_engine_with_second_miss_admission(model_q8, rpc, tmp_path, slots_of, window):
    """--moe-expert-cache-admit second-miss:W: the engine uploads a miss only when the expert also
    missed at one of its layer's last W steps. The trace header records admit=W, the simulator replays
    the same rule from it, event for event; the logits stay those of the cache off."""
    spec = models.read_spec(model_q8)
    slots = {"top-k": spec.n_expert_used, "half": spec.n_expert // 2}[slots_of]
    path = tmp_path / "trace.csv"
    base = engine.run_logits(model_q8, tmp_path / "off.bin", [*engine.host_experts_args(rpc.endpoint)],
                             prompt=PROMPT, n_predict=48, ctx=512, timeout=600)
    run = engine.run_logits(model_q8, tmp_path / "on.bin",
                            [*engine.host_experts_args(rpc.endpoint),
                             *engine.cache_args(slots, 0, sync=True, admit=f"second-miss:{window}"),
                             "--moe-trace", str(path)], prompt=PROMPT, n_predict=48, ctx=512, timeout=600)
    assert run.logits == base.logits and run.tokens == base.tokens
    t = tr.read_trace(path)
    assert t.meta.extra.get("admit") == str(window)
    res = sim.engine_replay(t)
    bad = sim.compare_with_engine(t, res)
    assert bad.empty, f"{len(bad)} lookups differ, first:\n{bad.head()}"
    s = engine.parse_cache_summaries(run.log)[-1]
    assert f"admit second-miss:{window} (" in run.log
    # the rule keeps uploads down: fewer than the same run admitting every miss
    always = engine.run_logits(model_q8, tmp_path / "always.bin",
                               [*engine.host_experts_args(rpc.endpoint), *engine.cache_args(slots, 0, sync=True)],
                               prompt=PROMPT, n_predict=48, ctx=512, timeout=600)
    assert s.uploads < engine.parse_cache_summaries(always.log)[-1].uploads


def test_replay_rejects_a_bad_admit_header(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("# pybmoe-trace v1 n_layer=1 n_expert=4 n_expert_used=1 slots=2 inserts=0 max_batch=1 admit=x\n"
                    "workload,phase,ubatch,token,layer,rank,expert,hit\n"
                    "engine,decode,0,0,0,0,1,0\n")
    with pytest.raises(ValueError, match=r"admit='x': expected a window of >= 1 steps"):
        sim.engine_replay(tr.read_trace(path))
