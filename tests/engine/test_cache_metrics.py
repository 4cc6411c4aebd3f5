"""The cache's metrics lines: the preamble at load, the cliff guard, the summary at teardown."""
from __future__ import annotations

import subprocess

import pytest

from pybmoe import engine, models


def _run_args(model, rpc, tmp_path, extra, n_predict=16) -> subprocess.CompletedProcess:
    cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(tmp_path / "l.bin"), "-m", str(model),
           "-p", "Hello there", "-n", str(n_predict), "-c", "256", "-t", "2", "--fit", "off",
           *engine.host_experts_args(rpc.endpoint), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _run(model, rpc, slots: int, tmp_path, n_predict: int = 16) -> str:
    r = _run_args(model, rpc, tmp_path, engine.cache_args(slots, sync=True), n_predict)
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

    from pybmoe.engine import demo
    srv = engine.LlamaServer(demo.server_args(model_q8, rpc.endpoint, 8, 2, ["--metrics"]))
    with srv:
        srv.completion("Hello there", n_predict=16)
        text, props = srv.get("/metrics"), json.loads(srv.get("/props"))
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
    assert props["moe_expert_cache"] == {"slots": 8, "mib": 0, "inserts": 2, "trace": ""}
    # the summary at shutdown agrees with the counters
    s = engine.parse_cache_summaries(log)[-1]
    assert s.hit_pct == pytest.approx(100 * hits / (hits + misses), abs=0.05)
    # and pybmoe reads preamble, summary and /metrics into one record
    m = engine.parse_cache_metrics(text)
    assert (m["hits"], m["misses"]) == (hits, misses) and list(m["slots"].values()) == [8 * spec.n_layer]
    assert set(m["allocated_bytes"]) == set(m["slots"])
    rec = engine.cache_record(log, metrics=text)
    assert (rec["metrics_hits"], rec["metrics_misses"], rec["metrics_slots"]) == (hits, misses, 8 * spec.n_layer)
    assert rec["metrics_resident_mib"] == pytest.approx(s.resident_mib, abs=0.05)
    assert rec["metrics_upload_mib"] == pytest.approx(s.upload_mib, abs=0.05)
    assert rec["metrics_uploads"] == s.uploads and rec["slots"] == 8
    # the upload counters: the default mode never waits; every upload and table publish is a call
    assert series["llamacpp:moe_cache_waits_total"] == 0 and series["llamacpp:moe_cache_upload_wait_seconds_total"] == 0
    assert series["llamacpp:moe_cache_h2d_ops_total"] > 0
    assert "# TYPE llamacpp:moe_cache_h2d_ops_total counter" in text
    assert (rec["metrics_h2d_ops"], rec["metrics_waits"]) == (series["llamacpp:moe_cache_h2d_ops_total"], 0)
    assert s.sync is False and s.h2d >= rec["metrics_h2d_ops"]
    assert engine.parse_cache_metrics("llamacpp:prompt_tokens_total 3\n") is None


def test_auto_sizes_from_the_device_and_its_ceiling(model_q8, rpc, tmp_path):
    """auto with a ceiling: the slots are the most that fit the ceiling, layers x (slots + staging + 1)."""
    spec = models.read_spec(model_q8)
    slot_mib = models.expert_bytes(models.ModelSpec(ftype="Q8_0")) / 2**20
    ceil_mib = 6
    r = _run_args(model_q8, rpc, tmp_path, ["--moe-expert-cache", "auto", "--moe-expert-cache-floor-mb", "0",
                                            "--moe-expert-cache-ceil-mb", str(ceil_mib)])
    assert r.returncode == 0, r.stderr[-2000:]
    log = r.stdout + r.stderr
    rec = engine.cache_record(log)
    k, n = spec.n_expert_used, spec.n_expert
    expect = max(s for s in range(1, n + 1) if spec.n_layer * (s + min(k, n - s) + 1) * slot_mib <= ceil_mib)
    assert rec["slots"] == expect, log[-2000:]
    assert "moe-cache: auto on RPC0" in log


def test_auto_resolving_to_zero_warns_and_is_off(model_q8, rpc, tmp_path):
    r = _run_args(model_q8, rpc, tmp_path, ["--moe-expert-cache", "auto", "--moe-expert-cache-floor-mb", "999999999"])
    assert r.returncode == 0, r.stderr[-2000:]
    log = r.stdout + r.stderr
    assert "auto resolved to 0 slots on RPC0" in log
    assert "the expert cache is OFF" in log
    assert engine.parse_cache_summaries(log) == []


@pytest.mark.parametrize("args", [["--moe-expert-cache", "auto", "--moe-expert-cache", "8"],
                                  ["--moe-expert-cache", "8", "--moe-expert-cache", "auto"]])
def test_auto_mixed_with_a_number_is_refused(model_q8, args):
    r = subprocess.run([str(engine.find_binary("llama-server")), "-m", str(model_q8), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "mutually exclusive" in r.stdout + r.stderr


def test_slots_above_n_expert_are_clamped_with_one_line(model_q8, rpc, tmp_path):
    # at the default verbosity (a WARN: llama-server's default hides INFO lines)
    r = _run_args(model_q8, rpc, tmp_path, ["--moe-expert-cache", "40"])
    assert r.returncode == 0
    log = r.stdout + r.stderr
    assert log.count("40 slots > 16 experts per layer, clamped to 16") == 1
    assert engine.cache_record(log)["slots"] == 16


def test_runtime_shrink_is_byte_safe(model_q8, rpc, tmp_path):
    """The seed's gate S3: warm the cache, shrink it to 0 (a full eviction), generate on; the output
    equals a fresh process, and the counters show the eviction."""
    n = 40
    fresh = _run_args(model_q8, rpc, tmp_path, ["--moe-expert-cache", "0"], n_predict=n)
    fresh_logits = (tmp_path / "l.bin").read_bytes()
    r = _run_args(model_q8, rpc, tmp_path, ["--moe-expert-cache", "8", "--moe-resize-at", "20:0"], n_predict=n)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "moe-cache-resize 0" in r.stdout
    assert (tmp_path / "l.bin").read_bytes() == fresh_logits
    assert [l for l in r.stdout.splitlines() if l.startswith("token")] == \
           [l for l in fresh.stdout.splitlines() if l.startswith("token")]
    s = engine.parse_cache_summaries(r.stdout + r.stderr)[-1]
    assert s.resident_mib == 0.0  # nothing resident after the shrink
    # once no slot can hold an expert, no upload is started: 18 more tokens add none
    short = _run_args(model_q8, rpc, tmp_path, ["--moe-expert-cache", "8", "--moe-resize-at", "20:0"], n_predict=22)
    s22 = engine.parse_cache_summaries(short.stdout + short.stderr)[-1]
    assert s.uploads == s22.uploads and s.uploads > 0
    # growing back within the allocation works; beyond it is refused
    r = _run_args(model_q8, rpc, tmp_path, ["--moe-expert-cache", "8", "--moe-resize-at", "10:9"], n_predict=16)
    assert "moe-cache-resize -1" in r.stdout and "out of range" in r.stdout + r.stderr


def test_resize_during_a_decode_is_refused(model_q8, rpc, tmp_path):
    """A resize called while a decode graph is being computed (from an eval callback) is refused
    (-2), changes nothing, and the output equals a run without the attempt."""
    plain = _run_args(model_q8, rpc, tmp_path, engine.cache_args(8, sync=True))
    assert plain.returncode == 0, plain.stderr[-2000:]
    plain_logits = (tmp_path / "l.bin").read_bytes()
    r = _run_args(model_q8, rpc, tmp_path, [*engine.cache_args(8, sync=True), "--moe-resize-in-graph", "0"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "moe-cache-resize-in-graph -2 8" in r.stdout  # refused; still 8 slots
    assert "a graph is being computed; resize between generations" in r.stderr
    assert (tmp_path / "l.bin").read_bytes() == plain_logits
    counts = lambda log: engine.parse_cache_summaries(log)[-1].without_timings()  # noqa: E731
    assert counts(r.stdout + r.stderr) == counts(plain.stdout + plain.stderr)


def _moe_series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:moe_cache"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_server_metrics_while_sleeping_keep_the_cache_counters(model_q8, rpc):
    """A sleeping server frees the model and serves /metrics from a snapshot taken before sleep;
    the snapshot holds the cache's counters too (found by upstream's test_sleep with the cache on)."""
    import json
    import time

    from pybmoe.engine import demo
    srv = engine.LlamaServer(demo.server_args(model_q8, rpc.endpoint, 8, 0, ["--metrics", "--sleep-idle-seconds", "1"]))
    with srv:
        srv.completion("Hello there", n_predict=8)
        awake = _moe_series(srv.get("/metrics"))
        deadline = time.time() + 20
        while True:
            if json.loads(srv.get("/props")).get("is_sleeping"):
                break
            assert time.time() < deadline, "the server did not go to sleep"
            time.sleep(0.2)
        asleep = _moe_series(srv.get("/metrics"))
    srv.stop()
    assert awake["llamacpp:moe_cache_hits_total"] + awake["llamacpp:moe_cache_misses_total"] > 0
    assert asleep == awake


def test_the_memory_line_and_the_preamble_show_slots_staging_and_zero_apart(model_q8, rpc, tmp_path):
    """Staging and the zero slot never hold residents: the load says what each costs."""
    import re
    r = _run_args(model_q8, rpc, tmp_path, [*engine.cache_args(8), "-v"])  # -v: the INFO memory line
    assert r.returncode == 0, r.stderr[-2000:]
    log = r.stdout + r.stderr
    m = re.search(r"moe-cache:\s+([\d.]+) MiB of expert slots for 4 layers in \S+: ([\d.]+) MiB resident slots \(8/layer\), "
                  r"([\d.]+) MiB staging \(4/layer\), ([\d.]+) MiB zero slot, ([\d.]+) MiB tables and bias copies", log)
    assert m, log[-3000:]
    total, slots, staging, zero, rest = map(float, m.groups())
    spec = models.read_spec(model_q8)
    slot_mib = engine.cache_record(log)["slot_mib"]
    assert slots == pytest.approx(8 * spec.n_layer * slot_mib, abs=0.01)
    assert staging == pytest.approx(4 * spec.n_layer * slot_mib, abs=0.01)
    assert zero == pytest.approx(spec.n_layer * slot_mib, abs=0.01)
    assert slots + staging + zero + rest == pytest.approx(total, abs=0.02) and rest < 1
    rec = engine.cache_record(log)
    assert (rec["slots"], rec["staging"], rec["zero"]) == (8, 4, 1)
