"""The gpt-oss architecture of `pybmoe make-model` (pybmoe/models/archs/gpt_oss.py): the tensors written are
the plan, the per-expert biases hold their distinctive values, and stock llama.cpp loads the file,
applies those biases and generates finite logits, alone and split with the experts on the host.
"""
from __future__ import annotations


import numpy as np
import pytest

from pybmoe import engine, models
from pybmoe.models.archs import gpt_oss

# small: 2 blocks (sliding, full), 8 experts, top-2, a 64-wide model
SHAPE = dict(n_layer=2, n_expert=8, n_expert_used=2, n_embd=64, n_ff_exp=64, n_head=2, n_head_kv=1, head_dim=32)
N_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.make_model(tmp_path_factory.mktemp("gptoss") / "gptoss.gguf", arch="gpt-oss", **SHAPE)


def _logits(model, tmp_path, name, extra=()):
    run = engine.run_logits(model, tmp_path / f"{name}.bin", list(extra), n_predict=N_TOKENS, timeout=120)
    assert len(run.tokens) == N_TOKENS, run.log[-3000:]
    return np.frombuffer(run.logits, dtype=np.float32), run.log


def test_tensors_and_keys_are_the_plan(model):
    meta = models.read_metadata(model)
    spec = models.ModelSpec(arch="gpt-oss", **SHAPE)
    n_vocab = len(meta.kvs["tokenizer.ggml.tokens"].value)
    assert [(t.name, t.shape, t.qtype) for t in meta.tensors] == models.tensor_plan(spec, n_vocab)
    t = {t.name: t for t in meta.tensors}
    assert "output.weight" in t  # gpt-oss has an untied head (required by llama.cpp)
    for i in range(SHAPE["n_layer"]):
        p = f"blk.{i}."
        for kind, shape in (("gate", (64, 8)), ("up", (64, 8)), ("down", (64, 8))):
            assert t[p + f"ffn_{kind}_exps.weight"].qtype.name == "Q8_0"
            assert (t[p + f"ffn_{kind}_exps.bias"].shape, t[p + f"ffn_{kind}_exps.bias"].qtype.name) == (shape, "F32")
        assert (t[p + "ffn_gate_inp.weight"].qtype.name, t[p + "ffn_gate_inp.bias"].qtype.name) == ("F32", "F32")
        assert t[p + "ffn_gate_inp.bias"].shape == (8,)
        assert t[p + "attn_sinks.weight"].shape == (2,)
        assert p + "post_attention_norm.weight" in t and p + "attn_output.bias" in t
        assert p + "attn_q_norm.weight" not in t and p + "ffn_gate_up_exps.weight" not in t
    kv = {k: v.value for k, v in meta.kvs.items()}
    assert kv["general.architecture"] == b"gpt-oss"
    assert kv["gpt-oss.expert_feed_forward_length"] == 64
    assert kv["gpt-oss.attention.sliding_window"] == 128
    assert "gpt-oss.attention.sliding_window_pattern" not in kv  # llama.cpp's default: every 2nd layer full
    assert models.read_spec(model) == models.MoeShape("gpt-oss", 2, 8, 2, 64)


def test_expert_biases_are_distinct_per_expert(model):
    meta = models.read_metadata(model)
    seen = {}
    for t in meta.tensors:
        if not t.name.endswith("_exps.bias"):
            continue
        kind = t.name.split(".")[2][len("ffn_"):-len("_exps")]
        b = np.array(models.read_tensor(model, t))          # (n_expert, n)
        assert b.shape == (8, 64)
        np.testing.assert_array_equal(b, gpt_oss.expert_bias(kind, 8, 64))
        # every expert's row is its own: row means step by 0.1 per expert id, none is zero
        np.testing.assert_allclose(np.diff(b.mean(axis=1)), 0.1, atol=1e-6)
        assert len({r.tobytes() for r in b}) == 8 and 0.05 - 1e-6 < b.min() and b.max() < 1.0
        seen[kind] = b
    assert set(seen) == {"gate", "up", "down"}
    assert not np.array_equal(seen["gate"], seen["up"]) and not np.array_equal(seen["up"], seen["down"])
    sinks = next(t for t in meta.tensors if t.name == "blk.1.attn_sinks.weight")
    assert models.read_tensor(model, sinks).tolist() == [-1.0, 1.0]
    router_b = next(t for t in meta.tensors if t.name == "blk.0.ffn_gate_inp.bias")
    assert 0.1 < float(np.std(models.read_tensor(model, router_b))) < 2.0
    # many experts: the step shrinks so the largest bias (even doubled) stays below swiglu_oai's clamp at 7
    big = gpt_oss.expert_bias("up", 128, 16)
    assert big.min() > 0 and big.max() < 3.35 and len({r.tobytes() for r in big}) == 128


def test_same_spec_same_bytes(model, tmp_path):
    again = models.make_model(tmp_path / "again.gguf", arch="gpt-oss", **SHAPE)
    assert again.read_bytes() == model.read_bytes()


def test_a_zero_sliding_window_is_refused():
    with pytest.raises(ValueError, match=r"n_ctx_train=0 .*gpt-oss.*sliding window.*>= 1"):
        models.ModelSpec(arch="gpt-oss", n_ctx_train=0)
    assert gpt_oss.sliding_window(models.ModelSpec(arch="gpt-oss", n_ctx_train=16)) == 16


def test_generates_and_applies_the_expert_biases(model, tmp_path):
    logits, _ = _logits(model, tmp_path, "cpu")
    n_vocab = len(models.read_metadata(model).kvs["tokenizer.ggml.tokens"].value)
    assert logits.size and logits.size % n_vocab == 0  # n_vocab float32 per decode step
    assert np.isfinite(logits).all() and logits.std() > 0
    # the same file with every expert bias 0: llama.cpp adds them (ggml_add_id), so the logits change
    zero = models.copy_with_tensor_values(model, tmp_path / "zero.gguf", "_exps.bias", 0.0)
    unbiased, _ = _logits(zero, tmp_path, "zero")
    assert np.isfinite(unbiased).all() and not np.array_equal(unbiased, logits)


def test_generates_split_with_host_experts(model, rpc, tmp_path):
    """Every layer on the (loopback RPC) device, the experts on the host: cache-off and cache-on
    logits are identical and finite."""
    off, _ = _logits(model, tmp_path, "off", engine.host_experts_args(rpc.endpoint))
    on, log = _logits(model, tmp_path, "on", [*engine.host_experts_args(rpc.endpoint), "--moe-expert-cache", "4"])
    assert np.isfinite(off).all()
    assert np.array_equal(on, off), log[-3000:]
