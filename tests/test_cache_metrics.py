"""The cache's metrics lines: the preamble at load, the cliff guard, the summary at teardown."""
from __future__ import annotations

import subprocess

import pytest

from pybmoe import engine, models


def _run(model, rpc, slots: int, tmp_path, n_predict: int = 16) -> str:
    cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(tmp_path / "l.bin"), "-m", str(model),
           "-p", "Hello there", "-n", str(n_predict), "-c", "256", "-t", "2", "--fit", "off",
           *engine.host_experts_args(rpc.endpoint), *engine.cache_args(slots)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout + r.stderr


@pytest.mark.parametrize("slots", [1, 3, 4, 8])
def test_cliff_warning_below_the_cycle_only(model_q8, rpc, tmp_path, slots):
    k = models.read_spec(model_q8).n_expert_used
    log = _run(model_q8, rpc, slots, tmp_path)
    warned = "is below the per-layer token cycle" in log
    assert warned == (slots < k), log[-2000:]
    assert log.count("is below the per-layer token cycle") <= 1


def test_preamble_and_summary_make_one_record(model_q8, rpc, tmp_path):
    spec = models.read_spec(model_q8)
    n_predict = 16
    log = _run(model_q8, rpc, 8, tmp_path, n_predict)
    rec = engine.cache_record(log)
    slot_mib = rec["slot_mib"]
    assert rec["layers"] == spec.n_layer and rec["n_expert"] == spec.n_expert and rec["top_k"] == spec.n_expert_used
    assert rec["slots"] == 8 and rec["staging"] == spec.n_expert_used and rec["layer_cycle_slots"] == spec.n_expert_used
    # worst-case cycle: every cached layer's experts x top-k
    assert rec["cache_cycle_mb"] == pytest.approx(spec.n_layer * spec.n_expert_used * slot_mib, rel=1e-3)
    # the device budget holds slots + staging + the zero slot per layer, plus the tables
    assert rec["budget_mib"] >= spec.n_layer * (8 + spec.n_expert_used + 1) * slot_mib
    assert rec["steps"] == n_predict - 1
    # every step asks top-k experts of every layer
    assert rec["layer_demand_mib"] == pytest.approx(spec.n_expert_used * slot_mib, abs=0.01)
    assert rec["token_demand_mib"] == pytest.approx(spec.n_layer * spec.n_expert_used * slot_mib, abs=0.01)
    assert rec["below_cycle"] is False
    pd = pytest.importorskip("pandas")
    assert len(pd.DataFrame([rec])) == 1


def test_server_metrics_and_props(model_q8, rpc):
    import json
    import urllib.request

    from pybmoe import demo
    srv = engine.LlamaServer(demo.server_args(model_q8, rpc.endpoint, 8, 2, ["--metrics"]))
    with srv:
        srv.completion("Hello there", n_predict=16)
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        with urllib.request.urlopen(srv.url + "/props", timeout=30) as r:
            props = json.loads(r.read())
    log = srv.stop()
    series = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:moe_cache"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    hits, misses = series["llamacpp:moe_cache_hits_total"], series["llamacpp:moe_cache_misses_total"]
    spec = models.read_spec(model_q8)
    assert hits + misses == spec.n_layer * spec.n_expert_used * 15  # 15 single-token decode steps
    assert hits > 0 and series["llamacpp:moe_cache_uploads_total"] > 0
    assert series["llamacpp:moe_cache_upload_bytes_total"] > 0 and series["llamacpp:moe_cache_resident_bytes"] > 0
    slots = [v for k, v in series.items() if k.startswith("llamacpp:moe_cache_slots{device=\"RPC")]
    assert slots == [8 * spec.n_layer]
    assert "# TYPE llamacpp:moe_cache_hits_total counter" in text
    assert props["moe_expert_cache"] == {"slots": 8, "inserts": 2, "trace": ""}
    # the summary at shutdown agrees with the counters
    s = engine.parse_cache_summaries(log)[-1]
    assert s.hit_pct == pytest.approx(100 * hits / (hits + misses), abs=0.05)
