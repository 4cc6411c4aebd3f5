"""Tests of pybmoe.models: the tiny qwen3moe GGUF generator (CPU only, ~10 s)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from pybmoe import models
from pybmoe.cli import make_model
from pybmoe.models import ModelSpec


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def vocab() -> Path:
    try:
        return models.default_vocab_path()
    except FileNotFoundError as e:  # pragma: no cover - tree not materialised
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def default_models(vocab: Path, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    return {ft: models.make_model(d / f"{ft}.gguf", ftype=ft, vocab_path=vocab) for ft in models.FTYPES}


def expected_plan(spec: ModelSpec, n_vocab: int) -> dict[str, tuple[tuple[int, ...], QT]]:
    q = spec.qtype
    E, F, X, hd = spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.head_dim
    nq, nkv = spec.n_head * hd, spec.n_head_kv * hd
    out = {"token_embd.weight": ((E, n_vocab), QT.Q8_0), "output_norm.weight": ((E,), QT.F32)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": ((E,), QT.F32),
            p + "attn_q.weight": ((E, nq), q),
            p + "attn_k.weight": ((E, nkv), q),
            p + "attn_v.weight": ((E, nkv), q),
            p + "attn_output.weight": ((nq, E), q),
            p + "attn_q_norm.weight": ((hd,), QT.F32),
            p + "attn_k_norm.weight": ((hd,), QT.F32),
            p + "ffn_norm.weight": ((E,), QT.F32),
            p + "ffn_gate_inp.weight": ((E, X), QT.F32),
            p + "ffn_gate_exps.weight": ((E, F, X), q),
            p + "ffn_up_exps.weight": ((E, F, X), q),
            p + "ffn_down_exps.weight": ((F, E, X), q),
        }
    return out


# ---------------------------------------------------------------- file contents

@pytest.mark.parametrize("ftype", models.FTYPES)
def test_tensors_and_hparams(default_models, vocab, ftype):
    path = default_models[ftype]
    meta = models.read_metadata(path)
    spec = ModelSpec(ftype=ftype)
    n_vocab = len(models.read_metadata(vocab).kvs["tokenizer.ggml.tokens"].value)
    assert n_vocab == 151936

    got = {t.name: (t.shape, t.qtype) for t in meta.tensors}
    assert got == expected_plan(spec, n_vocab)
    assert not any(n.endswith("_exps_s.weight") or n.endswith(".bias") or n == "output.weight" for n in got)

    kv = {k: v.value for k, v in meta.kvs.items()}
    assert kv["general.architecture"] == b"qwen3moe"
    assert kv["general.name"] == f"pybmoe-{spec.name}".encode()
    assert kv["qwen3moe.block_count"] == 4
    assert kv["qwen3moe.expert_count"] == 16
    assert kv["qwen3moe.expert_used_count"] == 4
    assert kv["qwen3moe.expert_feed_forward_length"] == 256
    assert kv["qwen3moe.embedding_length"] == 256
    assert kv["qwen3moe.context_length"] == 4096
    assert kv["qwen3moe.attention.head_count"] == 4
    assert kv["qwen3moe.attention.head_count_kv"] == 2
    assert kv["qwen3moe.attention.key_length"] == kv["qwen3moe.attention.value_length"] == 64
    assert kv["qwen3moe.rope.freq_base"] == 1e6
    assert kv["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert path.stat().st_size < 100 * 2**20

    # one expert's slices add up to expert_bytes()
    by_name = {t.name: t for t in meta.tensors}
    per_expert = sum(models.read_tensor(path, by_name[f"blk.0.ffn_{w}_exps.weight"]).nbytes
                     for w in ("gate", "up", "down")) // spec.n_expert
    assert per_expert == models.expert_bytes(spec)


def test_tokenizer_copied_verbatim(default_models, vocab):
    src = models.read_metadata(vocab).kvs
    tok = {k: v for k, v in src.items() if k.startswith("tokenizer.")}
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.ggml.model", "tokenizer.ggml.pre"} <= set(tok)
    for path in default_models.values():
        dst = models.read_metadata(path).kvs
        assert {k: v for k, v in dst.items() if k.startswith("tokenizer.")} == tok
        assert not any(k.startswith("qwen2.") for k in dst)


def test_weights_are_sane_and_routing_not_degenerate(default_models):
    path = default_models["Q8_0"]
    spec = ModelSpec()
    t = {i.name: i for i in models.read_metadata(path).tensors}
    np.testing.assert_array_equal(models.read_tensor(path, t["blk.0.ffn_norm.weight"]), 1.0)

    ids = np.random.default_rng(123).choice(151936, 512, replace=False)
    emb = gguf.quants.dequantize(np.asarray(models.read_tensor(path, t["token_embd.weight"]))[ids], QT.Q8_0)
    x = emb / np.sqrt((emb ** 2).mean(axis=-1, keepdims=True) + 1e-6)          # rms norm
    for i in range(spec.n_layer):
        router = np.asarray(models.read_tensor(path, t[f"blk.{i}.ffn_gate_inp.weight"]))  # (n_expert, n_embd)
        logits = x @ router.T
        assert 0.5 < logits.std() < 5
        top1 = logits.argmax(axis=-1)
        counts = np.bincount(top1, minlength=spec.n_expert)
        assert (counts > 0).all(), counts                        # every expert is someone's first choice
        assert counts.max() < 0.25 * len(ids), counts             # none dominates
        topk = {tuple(sorted(r)) for r in np.argsort(-logits, axis=-1)[:, : spec.n_expert_used]}
        assert len(topk) > 100

    up = gguf.quants.dequantize(np.asarray(models.read_tensor(path, t["blk.0.ffn_up_exps.weight"])), QT.Q8_0)
    assert up.shape == (16, 256, 256)
    assert up.std() == pytest.approx(1 / 16, rel=0.05)


# ---------------------------------------------------------------- determinism

def test_deterministic(default_models, vocab, tmp_path):
    again = models.make_model(tmp_path / "again.gguf", ftype="Q8_0", vocab_path=vocab)
    assert sha256(again) == sha256(default_models["Q8_0"])
    other = models.make_model(tmp_path / "other.gguf", ftype="Q8_0", seed=1, vocab_path=vocab)
    assert sha256(other) != sha256(default_models["Q8_0"])
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_fast_paths_write_ggufs_own_bytes(vocab, tmp_path):
    """Issue 43, item 12: the writer packs the vocab's arrays once per process and quantizes in large row
    chunks (the default model: 4.1 s to 1.6 s on the busy project machine); the bytes are gguf's own."""
    from pybmoe.models import writer
    rng = np.random.default_rng(3)
    for qtype, shape in ((QT.Q8_0, (3, 5000, 64)), (QT.Q8_0, (7, 96)), (QT.F16, (4, 33))):
        x = rng.standard_normal(shape, dtype=np.float32)
        want = gguf.quants.quantize(x, qtype)
        assert np.array_equal(models.quantize(x, qtype), want) and models.quantize(x, qtype).shape == want.shape
    tokens = next(kv for kv in models.tokenizer_kvs(vocab) if kv.key == "tokenizer.ggml.tokens")
    plain, ours = gguf.GGUFWriter(tmp_path / "a.gguf", "x"), writer._Writer(tmp_path / "b.gguf", "x")
    want = plain._pack_val(tokens.value, tokens.vtype, True, sub_type=tokens.sub_type)
    assert ours._pack_val(tokens.value, tokens.vtype, True, sub_type=tokens.sub_type) == want
    assert ours._pack_val(tokens.value, tokens.vtype, True, sub_type=tokens.sub_type) == want  # from the memo
    assert ours._pack_val(list(tokens.value), tokens.vtype, True, sub_type=tokens.sub_type) == want  # another list


def test_default_model_path_caches(monkeypatch, tmp_path):
    try:
        models.default_vocab_path()
    except FileNotFoundError as e:  # pragma: no cover
        pytest.skip(str(e))
    monkeypatch.setenv("PYBMOE_CACHE", str(tmp_path))
    p = models.default_model_path("Q4_K")
    assert p.parent == tmp_path / "models" and p.is_file() and "Q4_K" in p.name
    st = p.stat()
    assert models.default_model_path("Q4_K") == p
    assert p.stat().st_mtime_ns == st.st_mtime_ns           # not regenerated


# ---------------------------------------------------------------- non-default shapes

def test_small_shape_and_attn_output_fallback(vocab, tmp_path):
    # n_head * head_dim = 192 is not a multiple of 256: attn_output falls back to Q8_0
    p = models.make_model(tmp_path / "s.gguf", ftype="Q4_K", vocab_path=vocab, n_layer=1, n_expert=2,
                          n_expert_used=2, n_embd=256, n_ff_exp=512, n_head=3, n_head_kv=1)
    t = {i.name: (i.shape, i.qtype) for i in models.read_metadata(p).tensors}
    assert t["blk.0.attn_output.weight"] == ((192, 256), QT.Q8_0)
    assert t["blk.0.attn_q.weight"] == ((256, 192), QT.Q4_K)
    assert t["blk.0.ffn_down_exps.weight"] == ((512, 256, 2), QT.Q4_K)
    assert "blk.1.attn_norm.weight" not in t


# ---------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("kwargs, match", [
    (dict(n_expert_used=17), r"n_expert_used=17.*\[1, 16\]"),
    (dict(n_expert_used=0), r"n_expert_used=0.*\[1, 16\]"),
    (dict(n_expert=1, n_expert_used=1), r"n_expert=1.*\[2, 1024\]"),
    (dict(n_layer=0), r"n_layer=0.*\[1, 512\]"),
    (dict(ftype="Q4_K", n_embd=96), r"n_embd=96.*256"),
    (dict(ftype="Q4_K", n_ff_exp=128), r"n_ff_exp=128.*256"),
    (dict(ftype="Q8_0", n_embd=100), r"n_embd=100.*32"),
    (dict(ftype="Q5_K"), r"ftype='Q5_K'.*F16, Q8_0, Q4_K"),
    (dict(arch="llama"), r"arch='llama'.*qwen3moe"),
    (dict(n_head=4, n_head_kv=3), r"n_head_kv=3"),
    (dict(n_head_kv=5), r"n_head_kv=5.*\[1, 4\]"),
    (dict(head_dim=63), r"head_dim=63"),
    (dict(n_layer=2.5), r"n_layer=2.5.*integer"),
])
def test_bad_inputs(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        ModelSpec(**kwargs)
    with pytest.raises(ValueError, match=match):
        models.make_model(tmp_path / "x.gguf", vocab_path=tmp_path / "unused.gguf", **kwargs)
    assert not list(tmp_path.iterdir())


def test_f16_accepts_any_row_length():
    assert ModelSpec(ftype="F16", n_embd=96, n_ff_exp=40).n_embd == 96


def test_unknown_shape_keyword(tmp_path):
    with pytest.raises(TypeError, match="n_experts"):
        models.make_model(tmp_path / "x.gguf", n_experts=8)


def test_missing_vocab(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        models.make_model(tmp_path / "x.gguf", vocab_path=tmp_path / "nope.gguf")


def test_cli(vocab, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert make_model.main([str(out), "--ftype", "F16", "--layers", "1", "--experts", "4", "--top-k", "2",
                        "--embd", "64", "--ff", "64", "--seed", "3", "--vocab", str(vocab)]) == 0
    kv = models.read_metadata(out).kvs
    assert kv["qwen3moe.expert_count"].value == 4 and kv["qwen3moe.expert_used_count"].value == 2
    assert "MiB" in capsys.readouterr().out
    assert make_model.main([str(out), "--experts", "4", "--top-k", "5", "--vocab", str(vocab)]) == 2
    assert "n_expert_used=5" in capsys.readouterr().err


def test_expert_bytes():
    assert models.expert_bytes(ModelSpec(ftype="Q8_0")) == 3 * 256 * (256 // 32 * 34)
    assert models.expert_bytes(ModelSpec(ftype="Q4_K")) == 3 * 256 * 144
    assert models.expert_bytes(ModelSpec(ftype="F16", n_embd=512, n_ff_exp=128)) == 3 * 512 * 128 * 2


# ---------------------------------------------------------------- Q4_K quantizer

def test_q4_k_round_trip():
    rng = np.random.default_rng(0)
    cases = [
        rng.standard_normal((16, 4, 512), dtype=np.float32) * 0.05,
        rng.random((8, 256), dtype=np.float32) + 0.5,      # all positive: min clamps to 0
        -rng.random((8, 256), dtype=np.float32) - 0.5,     # all negative
        np.zeros((2, 256), np.float32),
    ]
    for x in cases:
        q = models.quantize_q4_k(x)
        assert q.dtype == np.uint8 and q.shape == x.shape[:-1] + (x.shape[-1] // 256 * 144,)
        y = gguf.quants.dequantize(q, QT.Q4_K)
        assert y.shape == x.shape
        rms = float(np.sqrt((x ** 2).mean())) or 1.0
        assert np.sqrt(((y - x) ** 2).mean()) / rms < 0.1
    # the 4-bit step bounds the error of each element of a normal tensor
    x = cases[0]
    y = gguf.quants.dequantize(models.quantize_q4_k(x), QT.Q4_K)
    assert np.abs(y - x).max() < (x.max() - x.min()) / 15


def test_q4_k_rejects_bad_row_length():
    with pytest.raises(ValueError, match="300.*256"):
        models.quantize_q4_k(np.zeros((2, 300), np.float32))


# ---------------------------------------------------------------- metadata reader

def test_read_metadata_matches_gguf_reader(tmp_path):
    p = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(p, "qwen3moe")
    w.add_uint32("a.u32", 7)
    w.add_int64("a.i64", -5)
    w.add_float32("a.f32", 0.5)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo")
    w.add_array("a.arr_s", ["x", "yz", "ü"])
    w.add_key_value("a.arr_i", [1, -2, 3], VT.ARRAY, sub_type=VT.INT32)
    w.add_tensor("t0", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("t1", gguf.quants.quantize(np.ones((3, 64), np.float32), QT.Q8_0), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    meta = models.read_metadata(p)
    r = gguf.GGUFReader(p)
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        kv = meta.kvs[key]
        assert kv.vtype == field.types[0]
        v = kv.value
        v = v.decode() if isinstance(v, bytes) else [s.decode() if isinstance(s, bytes) else s for s in v] \
            if isinstance(v, list) else v
        assert v == field.contents(), key
    assert [(t.name, t.shape, t.qtype, t.offset) for t in meta.tensors] == \
        [(t.name, tuple(int(n) for n in t.shape), t.tensor_type, t.data_offset) for t in r.tensors]
    np.testing.assert_array_equal(models.read_tensor(p, meta.tensors[0]), np.arange(6).reshape(2, 3))
    np.testing.assert_allclose(
        gguf.quants.dequantize(np.asarray(models.read_tensor(p, meta.tensors[1])), QT.Q8_0), 1.0, rtol=1e-3)


def test_read_metadata_rejects_non_gguf(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF"):
        models.read_metadata(p)
