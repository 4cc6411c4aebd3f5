"""The cache serves every ubatch of up to --moe-expert-cache-max-batch tokens (prompt chunks,
speculative verify batches, parallel decoding) and stays exact: bit-identical logits, the
simulator's hits and misses, greedy speculative output equal to no speculation and no cache."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.engine import demo
from pybmoe.routing import sim
from pybmoe.routing import trace as tr

# 33 prompt tokens or so: ubatches of every size below, and a remainder
PROMPT = ("The expert cache keeps the experts that were used most recently on the device, and the "
          "host computes the rest; a verify batch checks several drafted tokens at once.")
N_PREDICT = 12
MAX_BATCH = 32


def _run(model: Path, rpc, tmp: Path, ub: int, extra: list[str], name: str):
    run = engine.run_logits(model, tmp / f"{name}.bin",
                            ["-b", "512", "-ub", str(ub), *engine.host_experts_args(rpc.endpoint), *extra],
                            prompt=PROMPT, n_predict=N_PREDICT, ctx=512)
    return run.logits, run.log


@pytest.fixture(scope="module")
def spec(model_q8):
    return models.read_spec(model_q8)


@pytest.mark.parametrize("ub", [1, 2, 7, 8, 9, 16, 32])
def test_ubatches_bit_identical(model_q8, rpc, spec, tmp_path, ub):
    """ubatch in {1, 2, 7, 8, 9, 16, 32} x slots in {1, k-1, k, n_expert/2, n_expert}: every prompt
    chunk goes through the cache (max batch 32), and the logits equal the cache off."""
    k, n = spec.n_expert_used, spec.n_expert
    base, _ = _run(model_q8, rpc, tmp_path, ub, [], "off")
    for slots in (1, k - 1, k, n // 2, n):
        on, log = _run(model_q8, rpc, tmp_path, ub,
                       [*engine.cache_args(slots, sync=True), "--moe-expert-cache-max-batch", str(MAX_BATCH)], f"on-{slots}")
        assert on == base, f"ub={ub} slots={slots}: cache-on logits differ"
        rec = engine.cache_record(log)
        assert rec["max_batch"] == MAX_BATCH
        # every ubatch was served: prompt chunks plus the decode steps
        n_prompt_ubatches = rec["steps"] - (N_PREDICT - 1)
        assert n_prompt_ubatches >= 1
        if ub == 1:
            assert n_prompt_ubatches > 20


def test_larger_ubatches_use_the_stock_graph(model_q8, rpc, tmp_path):
    base, _ = _run(model_q8, rpc, tmp_path, 64, [], "off")
    on, log = _run(model_q8, rpc, tmp_path, 64, [*engine.cache_args(8, sync=True), "--moe-expert-cache-max-batch", "4", "-v"], "on")
    assert on == base
    assert engine.cache_record(log)["steps"] == N_PREDICT - 1  # the prompt ubatch was not served
    assert "batches of more than 4 token(s) use the stock graph" in log


@pytest.mark.parametrize("inserts", [0, 2, 9])
def test_simulator_matches_the_engine_on_small_batches(model_q8, rpc, tmp_path, inserts):
    """Multi-token steps: one LRU step per ubatch, uploads capped by the staging slots
    (top-k, or the insert cap, at most top-k x max batch); the simulator reads max_batch from the
    trace header and predicts every lookup."""
    trace = tmp_path / "t.csv"
    _run(model_q8, rpc, tmp_path, 5, [*engine.cache_args(6, inserts, sync=True), "--moe-expert-cache-max-batch", "8",
                                     "--moe-trace", str(trace)], "t")
    t = tr.read_trace(trace)
    assert t.meta.extra.get("max_batch") == "8"
    served = t.frame[t.frame["hit"] >= 0]
    assert (served["phase"] == "prefill").any()  # prompt chunks of 5 tokens were served
    bad = sim.compare_with_engine(t, sim.engine_replay(t))
    assert bad.empty, f"{len(bad)} lookups differ"


def test_max_batch_flag_is_validated(model_q8):
    r = subprocess.run([str(engine.find_binary("llama-server")), "-m", str(model_q8),
                        "--moe-expert-cache-max-batch", "-2"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--moe-expert-cache-max-batch" in r.stdout + r.stderr


def _serve(model, rpc, slots, spec_args, prompt, n_predict, extra=()):
    """One greedy request through llama-server (demo.run_once), flash attention off."""
    return demo.run_once(model, rpc.endpoint, slots, 0, prompt, n_predict, ["-fa", "off", *spec_args, *extra])


def test_speculative_ngram_greedy_output_is_unchanged(model_q8, rpc, tmp_path):
    """n-gram speculation verifies drafted tokens in small batches through the cache; the greedy
    text equals speculation off and the cache off, and the default max batch covers the verify
    batches: (1 + draft max) x parallel sequences."""
    prompt = "one two three one two three one two three one two three"
    n = 48
    plain = _serve(model_q8, rpc, 0, [], prompt, n)
    spec_args = ["--spec-type", "ngram-simple"]
    spec_off = _serve(model_q8, rpc, 0, spec_args, prompt, n)
    trace = tmp_path / "spec.csv"
    spec_on = _serve(model_q8, rpc, 8, spec_args, prompt, n, ["--moe-trace", str(trace), "--moe-expert-cache-sync"])
    assert spec_off.text == plain.text
    assert spec_on.text == plain.text
    rec = engine.cache_record(spec_on.log)
    assert rec["max_batch"] > 1 and rec["hit_pct"] > 0
    # verify batches (several tokens after the prompt) were served by the cache, and the
    # simulator still predicts every lookup
    t = tr.read_trace(trace)
    f = t.frame
    per_ub = f[f["hit"] >= 0].groupby("ubatch")["token"].nunique()
    assert (per_ub.iloc[1:] > 1).any(), "no multi-token verify batch reached the cache"
    bad = sim.compare_with_engine(t, sim.engine_replay(t))
    assert bad.empty, f"{len(bad)} lookups differ"


def test_draft_model_speculation_is_unchanged_and_says_the_draft_has_no_cache(model_q8, rpc, tmp_path):
    """A separate draft model: the target's cache serves the verify batches, the greedy text equals
    speculation off and the cache off, and the log says the draft model runs without the cache."""
    draft = models.make_model(tmp_path / "draft.gguf", seed=1)
    prompt = "one two three one two three one two three"
    n = 32
    plain = _serve(model_q8, rpc, 0, [], prompt, n)
    spec_args = ["-md", str(draft), "-ngld", "0", "--spec-type", "draft-simple", "--spec-draft-n-max", "4"]
    on = _serve(model_q8, rpc, 8, spec_args, prompt, n)
    log = on.log
    assert on.text == plain.text
    assert "moe-cache: the draft model runs without the expert cache, trace or route replay" in log
    assert log.count("MoE layers cached") == 1  # the target's cache only
    rec = engine.cache_record(log)
    assert rec["max_batch"] >= 5 and rec["hit_pct"] > 0
