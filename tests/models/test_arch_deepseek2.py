"""The deepseek2 architecture of pybmoe.models (pybmoe/models/archs/deepseek2.py): MLA attention, a leading
dense layer, a shared expert and DeepSeek-V3 routing (sigmoid, exp_probs_b bias, grouped top-k).

A small shape is written, read back against the tensor plan, and run in llama.cpp: plain CPU, with
the selection bias zeroed (the routing must change), and with the expert cache on a loopback RPC
device (bit-identical to the plain run).
"""
from __future__ import annotations


import numpy as np
import pytest

from pybmoe import engine, models
from pybmoe.models.archs import deepseek2

# 1 dense + 2 MoE layers; 8 experts in 4 groups of 2, the best 2 groups kept, top-2
SMALL = dict(n_layer=3, n_expert=8, n_expert_used=2, n_embd=64, n_ff_exp=64, n_head=2, n_head_kv=2, head_dim=32)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds2") / "ds2.gguf"
    models.make_model(path, arch="deepseek2", **SMALL)
    return path


def _logits(model, out, *extra):
    """Run pybmoe-logits on ``model``; return its log and the finite float32 logits it wrote."""
    run = engine.run_logits(model, out, list(extra), n_predict=8, timeout=120)
    a = np.frombuffer(run.logits, dtype=np.float32)
    assert a.size and np.isfinite(a).all()
    return run.log, a


@pytest.fixture(scope="module")
def base_logits(small, tmp_path_factory):
    """Logits of the plain CPU run of the small model."""
    return _logits(small, tmp_path_factory.mktemp("ds2-run") / "base.bin")[1]


def test_plan_and_metadata(small, tmp_path):
    spec = models.ModelSpec(arch="deepseek2", **SMALL)
    meta = models.read_metadata(small)
    n_vocab = len(meta.kvs["tokenizer.ggml.tokens"].value)
    assert [(t.name, t.shape, t.qtype) for t in meta.tensors] == models.tensor_plan(spec, n_vocab)
    hp = deepseek2.hparams(spec)
    assert (hp.kv_lora_rank, hp.n_rot, hp.q_lora_rank, hp.n_dense_lead, hp.n_expert_groups) == (64, 16, 32, 1, 4)

    kv = {k: v.value for k, v in meta.kvs.items()}
    a = "deepseek2."
    # MLA is MQA over the latent: one KV head of kv_lora_rank + n_rot, whatever the spec's n_head_kv
    assert kv[a + "attention.head_count_kv"] == 1
    assert kv[a + "attention.key_length"] == 64 + 16 and kv[a + "attention.value_length"] == 64
    assert kv[a + "attention.key_length_mla"] == 32 and kv[a + "attention.value_length_mla"] == 32
    assert kv[a + "attention.kv_lora_rank"] == 64 and kv[a + "attention.q_lora_rank"] == 32
    assert kv[a + "rope.dimension_count"] == 16
    assert kv[a + "leading_dense_block_count"] == 1 and kv[a + "expert_shared_count"] == 1
    assert kv[a + "expert_group_count"] == 4 and kv[a + "expert_group_used_count"] == 2
    assert kv[a + "expert_gating_func"] == 2 and kv[a + "expert_weights_norm"] is True
    assert kv[a + "expert_weights_scale"] == pytest.approx(2.5)
    assert kv[a + "feed_forward_length"] == 64 * 3 and kv[a + "expert_feed_forward_length"] == 64

    t = {t.name: t for t in meta.tensors}
    assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_inp.weight" not in t
    assert t["blk.1.ffn_gate_inp.weight"].qtype.name == "F32" and t["blk.2.ffn_up_exps.weight"].qtype.name == "Q8_0"
    b1 = np.asarray(models.read_tensor(small, t["blk.1.exp_probs_b.bias"]))
    b2 = np.asarray(models.read_tensor(small, t["blk.2.exp_probs_b.bias"]))
    assert len(set(b1.tolist())) == 8 and np.allclose(np.sort(b1), np.linspace(-0.25, 0.25, 8))
    assert not np.array_equal(b1, b2)

    # deterministic: the same spec gives the same bytes
    again = models.make_model(tmp_path / "again.gguf", arch="deepseek2", **SMALL)
    assert again.read_bytes() == small.read_bytes()


def test_derived_shapes_and_validation():
    with pytest.raises(ValueError, match="head_dim=2"):
        models.ModelSpec(arch="deepseek2", head_dim=2)
    # grouped top-k only where llama.cpp takes it
    for shape, groups in [(dict(n_expert=16, n_expert_used=4), 4), (dict(n_expert=6, n_expert_used=2), 0),
                          (dict(n_expert=4, n_expert_used=2), 0), (dict(n_expert=8, n_expert_used=5), 0)]:
        assert deepseek2.hparams(models.ModelSpec(arch="deepseek2", **shape)).n_expert_groups == groups
    # up to 2 layers all are MoE (the last one routes only output rows); 26/27 layers use the lite
    # layout (plain attn_q) llama.cpp expects there
    for n_layer in (1, 2):
        names = [n for n, _, _ in models.tensor_plan(models.ModelSpec(arch="deepseek2", n_layer=n_layer), 1000)]
        assert "blk.0.ffn_gate_exps.weight" in names and "blk.0.ffn_gate.weight" not in names
    lite = [n for n, _, _ in models.tensor_plan(models.ModelSpec(arch="deepseek2", n_layer=27), 1000)]
    assert "blk.5.attn_q.weight" in lite and "blk.5.attn_q_a.weight" not in lite
    # Q4_K falls back where a row does not fill 256-element blocks
    q4 = {n: q.name for n, _, q in models.tensor_plan(models.ModelSpec(arch="deepseek2", ftype="Q4_K"), 1000)}
    assert q4["blk.1.ffn_down_exps.weight"] == "Q4_K" and q4["blk.1.attn_q_b.weight"] == "Q8_0"


def test_generates_and_the_bias_routes(small, base_logits, tmp_path):
    # zero every exp_probs_b: the expert choice, hence the logits, must change
    nob = models.copy_with_tensor_values(small, tmp_path / "nobias.gguf", ".exp_probs_b.bias", 0.0)
    _, unbiased = _logits(nob, tmp_path / "nobias.bin")
    assert unbiased.shape == base_logits.shape and not np.array_equal(unbiased, base_logits)


def test_expert_cache_on_rpc_split_is_exact(small, base_logits, rpc, tmp_path):
    log, cached = _logits(small, tmp_path / "cache.bin", *engine.host_experts_args(rpc.endpoint),
                          "--moe-expert-cache", "4")
    assert "2 of 2 MoE layers cached" in log
    assert np.array_equal(cached, base_logits)
