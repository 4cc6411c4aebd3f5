"""The expert cache is exact: cache-on output is bit-identical to cache-off.

Layout: every layer on a loopback ggml-rpc-server (the stand-in device), experts in
host memory (--cpu-moe --no-repack). Both sides of the split run the same CPU
kernels, so any double-counted, dropped or torn expert changes the logits.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.engine import demo

N_PREDICT = 64
PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"


def logits_run(model: Path, rpc: engine.RpcServer, slots: int | None, inserts: int, tmp: Path,
               n_predict: int = N_PREDICT, repack: bool = False) -> engine.LogitsRun:
    """slots None: no cache flags at all; repack: let Q4_0/Q4_K host experts be repacked."""
    layout = engine.host_experts_args(rpc.endpoint)
    if repack:
        layout.remove("--no-repack")
        layout.append("-v")  # the buffer types are logged at INFO
    return engine.run_logits(model, tmp / f"logits-{model.stem}-{slots}-{inserts}-{int(repack)}.bin",
                             [*layout, *([] if slots is None else engine.cache_args(slots, inserts, sync=True))],
                             prompt=PROMPT, n_predict=n_predict, ctx=512, timeout=600)


@pytest.fixture(scope="module")
def spec(model_q8):
    return models.read_spec(model_q8)


@pytest.fixture(scope="module")
def baseline(model_q8, rpc, tmp_path_factory):
    return logits_run(model_q8, rpc, 0, 0, tmp_path_factory.mktemp("base"))


def test_cache_off_is_inert(baseline):
    assert baseline.layers == {}
    assert "moe-cache:" not in baseline.log
    assert len(baseline.tokens) == N_PREDICT
    # 63 single-token decode steps were recorded
    assert len(baseline.logits) % (N_PREDICT - 1) == 0 and len(baseline.logits) > 0


def test_zero_is_the_same_as_no_flag(model_q8, rpc, baseline, tmp_path):
    plain = logits_run(model_q8, rpc, None, 0, tmp_path)
    assert plain.logits == baseline.logits and plain.tokens == baseline.tokens


def test_repacked_host_experts_upload_gguf_bytes(rpc, tmp_path):
    """Q4_K host experts in the CPU_REPACK buffer: slots are filled from the GGUF, not the repacked
    tensor. Host (repacked kernels) and device (plain kernels) round differently, so the check is
    closeness to cache-off, which garbage slot bytes would break by orders of magnitude."""
    import numpy as np
    model = models.default_model_path("Q4_K")
    off = logits_run(model, rpc, 0, 0, tmp_path, n_predict=16, repack=True)
    on = logits_run(model, rpc, 8, 0, tmp_path, n_predict=16, repack=True)
    assert "CPU_REPACK" in on.log
    a = np.frombuffer(off.logits, dtype=np.float32)
    b = np.frombuffer(on.logits, dtype=np.float32)
    assert a.shape == b.shape and sum(h for h, _ in on.layers.values()) > 0
    assert np.max(np.abs(a - b)) < 0.05 * np.max(np.abs(a))


@pytest.mark.parametrize("inserts", [1, 0])
@pytest.mark.parametrize("slots_of", ["1", "top-k", "half", "all"])
def test_logits_bit_identical(model_q8, rpc, baseline, spec, tmp_path, slots_of, inserts):
    slots = {"1": 1, "top-k": spec.n_expert_used, "half": spec.n_expert // 2, "all": spec.n_expert}[slots_of]
    run = logits_run(model_q8, rpc, slots, inserts, tmp_path)

    assert run.tokens == baseline.tokens
    assert run.logits == baseline.logits, "cache-on logits differ from cache-off"

    # every decode step looks up top-k experts in every cached layer
    n_decode = N_PREDICT - 1
    assert sorted(run.layers) == list(range(spec.n_layer))
    for il, (hits, misses) in run.layers.items():
        assert hits + misses == spec.n_expert_used * n_decode, f"layer {il}"
    total_hits = sum(h for h, _ in run.layers.values())
    if slots >= spec.n_expert_used:
        assert total_hits > 0
    sums = engine.parse_cache_summaries(run.log)
    assert len(sums) == 1
    lookups = spec.n_expert_used * n_decode * spec.n_layer
    assert sums[0].hit_pct == pytest.approx(100.0 * total_hits / lookups, abs=0.05)
    if inserts == 1:
        assert sums[0].uploads <= n_decode * spec.n_layer


@pytest.mark.parametrize("ftype", ["F16", "Q4_K"])
def test_logits_bit_identical_other_types(ftype, rpc, tmp_path):
    model = models.default_model_path(ftype)
    k = models.read_spec(model).n_expert_used
    off = logits_run(model, rpc, 0, 0, tmp_path, n_predict=24)
    on = logits_run(model, rpc, 2 * k, 1, tmp_path, n_predict=24)
    assert on.logits == off.logits
    assert sum(h for h, _ in on.layers.values()) > 0


@pytest.fixture(scope="module")
def server_baseline(model_q8, rpc):
    return demo.run_once(model_q8, rpc.endpoint, 0, 0, PROMPT, N_PREDICT)


@pytest.mark.parametrize("inserts", [1, 0])
@pytest.mark.parametrize("slots_of", ["1", "top-k", "half", "all"])
def test_server_text_byte_identical(model_q8, rpc, spec, server_baseline, slots_of, inserts):
    slots = {"1": 1, "top-k": spec.n_expert_used, "half": spec.n_expert // 2, "all": spec.n_expert}[slots_of]
    on = demo.run_once(model_q8, rpc.endpoint, slots, inserts, PROMPT, N_PREDICT)
    assert server_baseline.tokens_predicted == N_PREDICT
    assert on.text.encode() == server_baseline.text.encode()
    assert on.summary is not None
    if slots >= spec.n_expert_used:
        assert on.summary.hit_pct > 0
    assert "moe-cache:" not in server_baseline.log
