"""qwen35moe (Qwen3.5/3.6 hybrid MoE with an MTP block): plan, metadata, determinism, generation.

A small shape (3 GGUF blocks = gated-delta-net + full attention + the MTP block) is written, read
back against the tensor plan, run with pybmoe-logits (the MTP tensors are skipped there) and with
llama-server's draft-mtp speculation (the MTP block drafts; greedy output must not change).
"""
from __future__ import annotations


import numpy as np
import pytest

from pybmoe import engine, models
from pybmoe.models.archs import qwen35moe

SMALL = dict(n_layer=3, n_expert=8, n_expert_used=2, n_embd=64, n_ff_exp=64, n_head=2, n_head_kv=1, head_dim=32)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return models.make_model(tmp_path_factory.mktemp("q35") / "q35.gguf", arch="qwen35moe", **SMALL)


def test_tensors_and_keys_match_the_plan(small):
    meta = models.read_metadata(small)
    spec = models.ModelSpec(arch="qwen35moe", **SMALL)
    n_vocab = len(meta.kvs["tokenizer.ggml.tokens"].value)
    plan = models.tensor_plan(spec, n_vocab)
    assert [(t.name, t.shape, t.qtype) for t in meta.tensors] == plan
    names = {t.name for t in meta.tensors}
    # block 0 is a gated-delta-net block, block 1 full attention, block 2 the MTP block
    assert "blk.0.ssm_conv1d.weight" in names and "blk.0.attn_q.weight" not in names
    assert "blk.1.attn_q.weight" in names and "blk.1.ssm_a" not in names
    assert {"blk.2.nextn.eh_proj.weight", "blk.2.ffn_gate_exps.weight", "blk.2.ffn_gate_inp.weight"} <= names
    assert not any(".nextn." in n for n in names if not n.startswith("blk.2."))
    types = {t.name: t.qtype.name for t in meta.tensors}
    assert types["blk.2.ffn_gate_inp.weight"] == "F32" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.2.ffn_down_exps.weight"] == "Q8_0"

    kv = {k: v.value for k, v in meta.kvs.items()}
    assert kv["general.architecture"] == b"qwen35moe"
    assert kv["qwen35moe.block_count"] == 3            # the MTP block is inside block_count
    assert kv["qwen35moe.nextn_predict_layers"] == 1
    assert kv["qwen35moe.full_attention_interval"] == 2
    assert kv["qwen35moe.rope.dimension_count"] == 8
    assert list(kv["qwen35moe.rope.dimension_sections"]) == [2, 2, 0, 0]
    assert (kv["qwen35moe.ssm.state_size"], kv["qwen35moe.ssm.group_count"], kv["qwen35moe.ssm.time_step_rank"],
            kv["qwen35moe.ssm.inner_size"], kv["qwen35moe.ssm.conv_kernel"]) == (32, 1, 2, 64, 4)
    assert kv["qwen35moe.expert_shared_feed_forward_length"] == 64
    assert models.read_spec(small) == models.MoeShape("qwen35moe", 3, 8, 2, 64)

    # the decay is negative, norms are ones
    ssm_a = models.read_tensor(small, next(t for t in meta.tensors if t.name == "blk.0.ssm_a"))
    assert (ssm_a < 0).all()
    norm = models.read_tensor(small, next(t for t in meta.tensors if t.name == "blk.2.nextn.hnorm.weight"))
    assert (norm == 1.0).all()


def test_bytes_follow_the_seed(tmp_path, small):
    again = models.make_model(tmp_path / "a.gguf", arch="qwen35moe", **SMALL)
    other = models.make_model(tmp_path / "b.gguf", arch="qwen35moe", seed=1, **SMALL)
    assert again.read_bytes() == small.read_bytes()
    assert other.read_bytes() != small.read_bytes()


@pytest.mark.parametrize("shape, word", [(dict(n_layer=2), "n_layer=2"), (dict(head_dim=48), "head_dim=48")])
def test_rejects_shapes_it_cannot_take(shape, word):
    with pytest.raises(ValueError, match=word):
        models.ModelSpec(arch="qwen35moe", **dict(SMALL, **shape))


def test_derived_defaults():
    d = qwen35moe.derived(models.ModelSpec(arch="qwen35moe"))
    assert (d.n_trunk, d.full_attention_interval, d.recurrent) == (3, 3, (True, True, False, False))
    assert (d.rope_dim, d.rope_sections, d.linear_head_dim, d.linear_k_heads, d.linear_v_heads) == (16, (3, 3, 2, 0), 64, 2, 4)


@pytest.fixture(scope="module")
def greedy(small, tmp_path_factory):
    """pybmoe-logits on the small model: (greedy token ids, logits as float32, stdout)."""
    run = engine.run_logits(small, tmp_path_factory.mktemp("q35logits") / "logits.bin", [], n_predict=8, timeout=120)
    return run.tokens, np.frombuffer(run.logits, dtype=np.float32), run.log


def test_generates(small, greedy):
    tokens, logits, log = greedy
    assert len(tokens) == 8
    n_vocab = len(models.read_metadata(small).kvs["tokenizer.ggml.tokens"].value)
    assert logits.size and logits.size % n_vocab == 0
    assert np.isfinite(logits).all() and logits.std() > 0
    assert "unused tensor blk.2.nextn.eh_proj.weight" in log   # MTP tensors load only for draft-mtp


def test_draft_mtp_drafts_and_keeps_greedy_output(small, greedy):
    args = ["-m", str(small), "-c", "256", "-t", "2", "--fit", "off", "--temp", "0",
            "--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    with engine.LlamaServer(args) as s:
        r = s.completion("Hello there", n_predict=8, return_tokens=True)
    assert r["timings"]["draft_n"] > 0                      # the MTP block drafted
    assert r["tokens"] == greedy[0]                         # and speculation kept the greedy tokens
