"""The cache is exact on every MoE variant `pybmoe make-model` writes: cache-on logits are
bit-identical to cache-off for ubatch in {1, 2, 7, 8, 9, 16, 32} x slots in {1, k-1, k, n_expert/2,
n_expert} and a pool (a MiB budget) of at least top-k slots per layer, and greedy n-gram speculation through the cache gives the text of no speculation and no
cache.

The variants: qwen3moe (separate gate/up/down, SiLU), gpt-oss (per-expert biases through add_id,
swiglu_oai), gemma4 (fused gate_up, GEGLU, per-expert down scale, shared expert), deepseek2 (shared
expert, expert groups, selection bias), qwen35moe (hybrid gated-delta-net, shared expert with a
gate, an MTP block).
Every run also checks that the cache served the layers and every prompt ubatch (hits + misses), so a
variant that fell back to the stock graph cannot pass as "identical".
"""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.engine import demo

PROMPT = ("The expert cache keeps the experts that were used most recently on the device, and the "
          "host computes the rest; a verify batch checks several drafted tokens at once.")
N_PREDICT = 6
MAX_BATCH = 32
# small: 2 blocks (qwen35moe: 3, one of them the MTP block), 8 experts, top-3 (slots 1, 2, 3, 4, 8)
SHAPE = dict(n_layer=2, n_expert=8, n_expert_used=3)
N_LAYER = {"qwen35moe": 3}
ARCHS = [a for a in ("qwen3moe", "gpt-oss", "gemma4", "deepseek2", "qwen35moe") if a in models.ARCHES]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request) -> Path:
    return models.cached_model_path(models.ModelSpec(arch=request.param, **{**SHAPE, "n_layer": N_LAYER.get(request.param, 2)}))


def _run(model: Path, rpc, tmp: Path, ub: int, extra: list[str], name: str) -> tuple[bytes, str, dict[int, tuple[int, int]]]:
    run = engine.run_logits(model, tmp / f"{name}.bin",
                            ["-b", "512", "-ub", str(ub), *engine.host_experts_args(rpc.endpoint), *extra],
                            prompt=PROMPT, n_predict=N_PREDICT, ctx=512)
    return run.logits, run.log, run.layers


@pytest.mark.parametrize("ub", [1, 2, 7, 8, 9, 16, 32])
def test_every_variant_is_bit_identical(arch_model, rpc, tmp_path, ub):
    spec = models.read_spec(arch_model)
    k, n = spec.n_expert_used, spec.n_expert
    base, base_log, _ = _run(arch_model, rpc, tmp_path, ub, [], "off")
    assert "moe-cache:" not in base_log
    n_prompt = None
    for slots in sorted({1, k - 1, k, n // 2, n}):
        on, log, layers = _run(arch_model, rpc, tmp_path, ub,
                               [*engine.cache_args(slots, sync=True), "--moe-expert-cache-max-batch", str(MAX_BATCH)], f"on-{slots}")
        for why in ("not cached", "cannot split", "stock graph"):
            assert why not in log, log[-3000:]
        assert on == base, f"{arch_model.name} ub={ub} slots={slots}: cache-on logits differ from cache-off"
        # the cache served the MoE layers the main graph runs, top-k lookups per routed row (the last
        # layer routes only the output rows of a prompt ubatch; an MTP block's layer runs only when
        # it drafts)
        served = [h + m for h, m in layers.values() if h + m]
        assert served and all(s % k == 0 for s in served), f"slots={slots}: {layers}\n{log[-3000:]}"
        assert max(served) >= k * (len(PROMPT) // 8 + N_PREDICT - 1) // 2  # every token of the first layer
        if slots >= k:
            assert sum(h for h, _ in layers.values()) > 0
        rec = engine.cache_record(log)
        n_prompt = rec["steps"] - (N_PREDICT - 1) if n_prompt is None else n_prompt
        assert rec["steps"] - (N_PREDICT - 1) == n_prompt >= 1  # every prompt ubatch was served
        slot_mib = rec["slot_mib"] * rec["layers"]
    # the pool (a MiB budget): every layer's MUL_MAT_ID reads one bank, its biases stay its own
    mib = math.ceil((k + min(k, n - k) + 1) * slot_mib)
    on, log, layers = _run(arch_model, rpc, tmp_path, ub, ["--moe-expert-cache-mb", str(mib), "--moe-expert-cache-sync",
                                                           "--moe-expert-cache-max-batch", str(MAX_BATCH)], "on-pool")
    assert "one pool of" in log, log[-3000:]
    assert on == base, f"{arch_model.name} ub={ub} pool of {mib} MiB: cache-on logits differ from cache-off"
    assert sum(h for h, _ in layers.values()) > 0


def test_every_variant_speculates_through_the_cache(arch_model, rpc):
    """n-gram speculation verifies drafted tokens in small batches through the cache: the greedy
    text equals no speculation and no cache."""
    prompt = "one two three one two three one two three one two three"
    n = 24
    base = ["-fa", "off", "--temp", "0"]
    plain = demo.run_once(arch_model, rpc.endpoint, 0, 0, prompt, n, base)
    spec = demo.run_once(arch_model, rpc.endpoint, 4, 0, prompt, n, [*base, "--spec-type", "ngram-simple"])
    assert plain.tokens_predicted == n
    assert spec.text == plain.text
    rec = engine.cache_record(spec.log)
    assert rec["max_batch"] > 1 and rec["steps"] > 0


@pytest.mark.skipif("qwen35moe" not in models.ARCHES, reason="needs the qwen35moe generator")
def test_draft_mtp_speculation_shares_the_cache(rpc):
    """draft-mtp: the MTP draft context runs on the target model, so its MoE block is one more cache
    layer; the target's verify batches and the draft's steps both go through the cache, and the
    greedy text equals no speculation and no cache."""
    model = models.cached_model_path(models.ModelSpec(arch="qwen35moe", n_layer=4, n_expert=8, n_expert_used=3))
    prompt = "one two three one two three one two three"
    n = 16
    base = ["-fa", "off", "--temp", "0"]
    plain = demo.run_once(model, rpc.endpoint, 0, 0, prompt, n, base)
    mtp = demo.run_once(model, rpc.endpoint, 4, 0, prompt, n,
                        [*base, "--spec-type", "draft-mtp", "--spec-draft-n-max", "3"])
    assert plain.tokens_predicted == n
    assert mtp.text == plain.text
    log = mtp.log
    assert "the MTP draft context shares the target model's expert cache" in log
    rec = engine.cache_record(log)
    assert rec["layers"] == 4  # 3 trunk MoE blocks + the MTP block (block_count 4)
    assert rec["max_batch"] >= 4 and rec["steps"] > 0


def test_the_device_chain_adds_its_biases_on_the_device(rpc, tmp_path):
    """gpt-oss: the device chain's add_id of the up/gate biases, and the down bias after the sum,
    read the cache's device copies of the biases, so the scheduler keeps them on the device (with
    the model's host biases they would run on the CPU, with copies each way per layer). Checked on
    the scheduler's node assignments."""
    import os
    model = models.cached_model_path(models.ModelSpec(arch="gpt-oss", **SHAPE))
    out = tmp_path / "l.bin"
    cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(out), "-m", str(model), "-p", "Hello",
           "-n", "2", "-c", "256", "-t", "2", "--fit", "off", *engine.host_experts_args(rpc.endpoint),
           *engine.cache_args(4, sync=True), "-v"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "GGML_SCHED_DEBUG": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    # "node #117 (    ADD_ID): ffn_moe_gate_biased- (3K) [RPC0[ ...] ...:  ffn_moe_gate-1-cache (3K) [RPC0[..."
    adds = [l[l.index("node #"):] for l in (r.stdout + r.stderr).splitlines() if "node #" in l and "ADD_ID)" in l]
    on_cache = [l for l in adds if "-cache (" in l.split("):", 1)[1].split("]", 1)[1]]
    assert on_cache, "\n".join(adds)
    # the node's own backend is the first [...] of the line
    assert all(l.split("[", 1)[1].startswith("RPC0") for l in on_cache), "\n".join(on_cache)
    assert len(on_cache) % (2 * SHAPE["n_layer"]) == 0  # up and gate, every layer, in every graph printed
    # the down bias, added once after the two chains' sum, from its copy too
    down = [l for l in adds if "ffn_moe_down_biased" in l.split("):", 1)[1].split("(", 1)[0]
            and "ffn_moe_down_split" in l]  # graphs the cache splits (larger reserve graphs are stock)
    assert down and all(l.split("[", 1)[1].startswith("RPC0") for l in down), "\n".join(down)
