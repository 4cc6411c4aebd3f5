"""The stream tier's runtime resize and its Python surface.

Gate S3 (the BigMoeOnEdge seed): warm the cache, shrink it to force a full eviction, generate again:
the output is byte-identical to a fresh process at the new size, and the resident MiB drops. Also:
a resize from inside a generation is refused, the Python bindings' stats and errors, and the C
struct's layout against the ctypes mirror.
"""
from __future__ import annotations

import ctypes
import subprocess

import pytest

from pybmoe import engine, models
from pybmoe.engine import bindings

SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320)
PROMPT = "The stream tier reads experts from the file as the layers need them, and keeps the recent ones."


@pytest.fixture(scope="module")
def model():
    return models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))


def test_the_stats_struct_matches_its_ctypes_mirror():
    out = subprocess.run([str(engine.find_binary("pybmoe-logits")), "--abi-stream"], capture_output=True, text=True).stdout
    name, size, *fields = out.split()
    assert name == "llama_moe_stream_stats" and int(size) == ctypes.sizeof(bindings.MoeStreamStatsC)
    offsets = dict(f.split("=") for f in fields)
    assert set(offsets) == {f for f, _ in bindings.MoeStreamStatsC._fields_}
    for f, _ in bindings.MoeStreamStatsC._fields_:
        assert int(offsets[f]) == getattr(bindings.MoeStreamStatsC, f).offset, f


def test_a_shrink_mid_run_evicts_at_once_and_changes_no_logit(model, tmp_path):
    args = ["-ngl", "0", "--no-repack", "-ub", "1"]
    base = engine.run_logits(model, tmp_path / "base.bin", args, prompt=PROMPT, n_predict=12)
    r = engine.run_logits(model, tmp_path / "resized.bin", [*args, "--moe-stream-cache-mb", "16",
                                                             "--moe-stream-resize-at", "4:2"], prompt=PROMPT, n_predict=12)
    line = next(ln for ln in r.log.splitlines() if ln.startswith("moe-stream-resize "))
    _, rc, resident = line.split()
    assert int(rc) == 2 and int(resident) <= 2 * 2**20      # 2 MiB: 4 experts of 0.50 MiB at most
    assert r.logits == base.logits and r.tokens == base.tokens


def test_s3_warm_shrink_generate_equals_a_fresh_process_at_the_new_size(model):
    kw = dict(n_gpu_layers=0, n_ubatch=1, n_batch=512, verbose=False, seed=0)
    warm = bindings.Llama(model, moe_stream_cache_mb=16, **kw)
    first = warm(PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    before = warm.moe_stream_stats()
    assert before.resident_mib > 2 and before.hits > 0
    assert warm.set_moe_stream_budget_mb(2) == 2
    after = warm.moe_stream_stats()
    assert after.resident_mib <= 2.0 < before.resident_mib and after.budget_mib == 2.0
    warm.reset()
    again = warm(PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    fresh = bindings.Llama(model, moe_stream_cache_mb=2, **kw)
    want = fresh(PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    assert again == want and first == want
    assert warm.moe_stream_stats().misses > after.misses   # it really re-read what the shrink evicted


def test_python_errors_name_the_range(model):
    llm = bindings.Llama(model, moe_stream_cache_mb=4, n_gpu_layers=0, n_ubatch=1, verbose=False)
    with pytest.raises(ValueError, match=r"accepted: 2 \.\. 16 MiB"):
        llm.set_moe_stream_budget_mb(1)
    # issue 43, item 5: a negative budget named 0 .. 2147483647, not the tier's real range
    with pytest.raises(ValueError, match=r"^budget_mb=-1 is invalid; accepted: 2 \.\. 16 MiB \(more, up to "):
        llm.set_moe_stream_budget_mb(-1)
    with pytest.raises(ValueError, match="moe_stream_cache_mb"):
        bindings.Llama(model, moe_stream_cache_mb=-3, n_gpu_layers=0, verbose=False)
    with pytest.raises(ValueError, match="mechanical minimum"):
        bindings.Llama(model, moe_stream_cache_mb=2, n_gpu_layers=0, n_ubatch=512, verbose=False)
    off = bindings.Llama(model, n_gpu_layers=0, verbose=False)
    with pytest.raises(ValueError, match="stream tier is off"):
        off.moe_stream_stats()


def test_server_metrics_carry_the_stream_counters(model):
    srv = engine.LlamaServer(["-m", str(model), "-ngl", "0", "--no-repack", "-c", "512", "-np", "1", "-t", "2",
                              "-ub", "32", "--moe-stream-cache-mb", "8", "--metrics"])
    with srv:
        srv.completion(PROMPT, n_predict=8)
        text = srv.get("/metrics")
    log = srv.stop()
    rec = engine.stream_record(log, metrics=text)
    hits, misses = rec["stream_metrics_hits"], rec["stream_metrics_misses"]
    assert hits > 0 and misses > 0
    assert rec["stream_metrics_budget_bytes"] == 8 * 2**20
    # decode also holds the prefetch window (a quarter of a layer's 16 experts at ubatch 32, beside the budget)
    assert rec["stream_prefetch_experts"] == 4
    window = rec["stream_prefetch_experts"] * rec["stream_entry_mb"] * 2**20
    assert 0 < rec["stream_metrics_resident_bytes"] <= 8 * 2**20 + window
    assert rec["stream_metrics_read_bytes"] >= misses * 0.49 * 2**20   # each miss reads one 0.50 MiB expert
    assert rec["stream_metrics_io_wait_seconds"] >= 0
    # the summary at teardown counts the same lookups (the scrape came after the only request)
    assert rec["stream_hit_pct"] == pytest.approx(100 * hits / (hits + misses), abs=0.06)
