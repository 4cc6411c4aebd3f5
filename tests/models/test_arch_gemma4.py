"""The gemma4 architecture of `pybmoe make-model` (pybmoe/models/archs/gemma4.py): the tensors written are
the plan, the per-expert down scales hold 1 + expert_id, and stock llama.cpp loads the file,
applies those scales and generates finite logits, alone and split with the experts on the host.
"""
from __future__ import annotations


import numpy as np
import pytest

from pybmoe import engine, models
from pybmoe.models.archs import gemma4

# small: 3 blocks (sliding, sliding, full), 8 experts, top-2, a 64-wide model
SHAPE = dict(n_layer=3, n_expert=8, n_expert_used=2, n_embd=64, n_ff_exp=64, n_head=2, n_head_kv=1, head_dim=32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.make_model(tmp_path_factory.mktemp("g4") / "g4.gguf", arch="gemma4", **SHAPE)


def _logits(model, tmp_path, name, extra=()):
    run = engine.run_logits(model, tmp_path / f"{name}.bin", list(extra), n_predict=4, timeout=120)
    assert len(run.tokens) == 4, run.log[-3000:]
    return np.frombuffer(run.logits, dtype=np.float32), run.log


def test_tensors_and_keys_are_the_plan(model):
    meta = models.read_metadata(model)
    spec = models.ModelSpec(arch="gemma4", **SHAPE)
    n_vocab = len(meta.kvs["tokenizer.ggml.tokens"].value)
    assert [(t.name, t.shape, t.qtype) for t in meta.tensors] == models.tensor_plan(spec, n_vocab)
    names = {t.name for t in meta.tensors}
    for i in range(SHAPE["n_layer"]):  # every layer is MoE, with the fused experts and a shared expert
        for t in ("ffn_gate_up_exps.weight", "ffn_down_exps.weight", "ffn_down_exps.scale", "ffn_gate_inp.weight",
                  "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            assert f"blk.{i}.{t}" in names
        assert f"blk.{i}.ffn_gate_exps.weight" not in names and f"blk.{i}.ffn_up_exps.weight" not in names
    shapes = {t.name: t for t in meta.tensors}
    assert shapes["blk.0.ffn_gate_up_exps.weight"].shape == (64, 128, 8)
    assert shapes["blk.0.ffn_gate_up_exps.weight"].qtype.name == "Q8_0"
    assert shapes["blk.0.ffn_gate_inp.weight"].qtype.name == "F32"
    kv = {k: v.value for k, v in meta.kvs.items()}
    assert kv["general.architecture"] == b"gemma4"
    assert kv["gemma4.attention.sliding_window_pattern"] == [True, True, False]
    assert kv["gemma4.expert_feed_forward_length"] == kv["gemma4.feed_forward_length"] == 64
    assert kv["gemma4.embedding_length_per_layer_input"] == 0
    assert models.read_spec(model) == models.MoeShape("gemma4", 3, 8, 2, 64)


def test_down_scales_are_one_plus_expert_id(model):
    meta = models.read_metadata(model)
    scales = [t for t in meta.tensors if t.name.endswith("ffn_down_exps.scale")]
    assert len(scales) == SHAPE["n_layer"]
    for t in scales:
        assert t.shape == (8,) and t.qtype.name == "F32"
        assert models.read_tensor(model, t).tolist() == [1.0 + e for e in range(8)]


def test_same_spec_same_bytes(model, tmp_path):
    again = models.make_model(tmp_path / "again.gguf", arch="gemma4", **SHAPE)
    assert again.read_bytes() == model.read_bytes()


def test_one_layer_is_refused():
    with pytest.raises(ValueError, match=r"n_layer=1 .*gemma4.*>= 2"):
        models.ModelSpec(arch="gemma4", n_layer=1)
    assert gemma4.sliding_window_pattern(8) == [True] * 5 + [False, True, False]


def test_generates_and_applies_the_down_scales(model, tmp_path):
    logits, _ = _logits(model, tmp_path, "cpu")
    n_vocab = len(models.read_metadata(model).kvs["tokenizer.ggml.tokens"].value)
    assert logits.size and logits.size % n_vocab == 0  # n_vocab float32 per decode step
    assert np.isfinite(logits).all() and logits.std() > 0
    # the same file with every down scale 1: llama.cpp loads ffn_down_exps.scale (an optional tensor,
    # so a wrong name would be silently ignored) and applies it, so the logits change
    ones = models.copy_with_tensor_values(model, tmp_path / "ones.gguf", "ffn_down_exps.scale", 1.0)
    unscaled, _ = _logits(ones, tmp_path, "ones")
    assert np.isfinite(unscaled).all() and not np.array_equal(unscaled, logits)


def test_generates_split_with_host_experts(model, rpc, tmp_path):
    """Every layer on the (loopback RPC) device, the experts on the host: cache-off and cache-on
    logits are identical and finite."""
    off, _ = _logits(model, tmp_path, "off", engine.host_experts_args(rpc.endpoint))
    on, log = _logits(model, tmp_path, "on", [*engine.host_experts_args(rpc.endpoint), "--moe-expert-cache", "4"])
    assert np.isfinite(off).all()
    assert np.array_equal(on, off), log[-3000:]
