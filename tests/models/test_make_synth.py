"""pybmoe-make-synth: the fast C++ writer of big synthetic qwen3moe models (for GPU benchmarks).

A small shape is written and checked against the Python generator's tensor plan, loaded, and run
with the expert cache on a loopback RPC device.
"""
from __future__ import annotations

import subprocess

import pytest

from pybmoe import engine, models

SMALL = dict(n_layer=3, n_expert=16, top_k=4, n_embd=256, n_ff_exp=128, n_head=4, n_head_kv=2, head_dim=64)


def _write(path, *, type_="q8_0", threads=None, seed=0, **shape):
    s = dict(SMALL, **shape)
    cmd = [str(engine.find_binary("pybmoe-make-synth")), str(path), "--vocab", str(models.default_vocab_path()),
           "--type", type_, "--seed", str(seed)]
    for k, v in s.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    if threads:
        cmd += ["--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("pybmoe-make-synth: "))
    return dict(kv.split("=") for kv in line.split()[2:])


def _logits(model, rpc, tmp_path, extra, name):
    out = tmp_path / name
    cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(out), "-m", str(model), "-p", "Hello there",
           "-n", "16", "-c", "256", "-t", "2", "--fit", "off", *engine.host_experts_args(rpc.endpoint), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout + r.stderr, out.read_bytes()


def test_small_shape_matches_the_python_plan(tmp_path):
    out = tmp_path / "s.gguf"
    info = _write(out)
    shape = models.read_spec(out)
    assert (shape.arch, shape.n_layer, shape.n_expert, shape.n_expert_used, shape.n_embd) == ("qwen3moe", 3, 16, 4, 256)
    meta = models.read_metadata(out)
    spec = models.ModelSpec(n_layer=3, n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=128, n_head=4, n_head_kv=2,
                            head_dim=64, ftype="Q8_0")
    n_vocab = len(meta.kvs["tokenizer.ggml.tokens"].value)
    assert [(t.name, t.shape, t.qtype) for t in meta.tensors] == models.tensor_plan(spec, n_vocab)
    assert int(info["expert_bytes"]) == models.expert_bytes(spec)
    assert int(info["bytes"]) == out.stat().st_size
    for key in ("qwen3moe.expert_feed_forward_length", "qwen3moe.attention.head_count_kv", "qwen3moe.attention.key_length"):
        assert key in meta.kvs
    assert meta.kvs["qwen3moe.expert_feed_forward_length"].value == 128
    # the tokenizer is the vocab file's
    vocab = models.read_metadata(models.default_vocab_path()).kvs
    assert meta.kvs["tokenizer.ggml.merges"].value == vocab["tokenizer.ggml.merges"].value
    assert not any(k.startswith("qwen2.") for k in meta.kvs)
    # norms are ones, the router is non-degenerate
    norm = models.read_tensor(out, next(t for t in meta.tensors if t.name == "blk.0.ffn_norm.weight"))
    assert (norm == 1.0).all()
    router = models.read_tensor(out, next(t for t in meta.tensors if t.name == "blk.1.ffn_gate_inp.weight"))
    assert 0.05 < float(router.std()) * 256 ** 0.5 / 2 < 2.0 and len(set(router.ravel().tolist())) > 1000


def test_bytes_do_not_depend_on_threads_and_follow_the_seed(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    _write(a, threads=1)
    _write(b, threads=3)
    _write(c, threads=3, seed=1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("type_, qtype", [("q4_0", "Q4_0"), ("q4_k", "Q4_K"), ("f16", "F16")])
def test_other_types(tmp_path, type_, qtype):
    out = tmp_path / f"{type_}.gguf"
    _write(out, type_=type_, n_layer=1, **({"n_ff_exp": 256} if type_ == "q4_k" else {}))  # Q4_K rows: 256
    t = {t.name: t.qtype.name for t in models.read_metadata(out).tensors}
    assert t["blk.0.ffn_down_exps.weight"] == qtype and t["blk.0.ffn_gate_inp.weight"] == "F32"


def test_bad_arguments_are_refused(tmp_path):
    exe = str(engine.find_binary("pybmoe-make-synth"))
    vocab = str(models.default_vocab_path())
    for extra, why in ((["--type", "q5_k"], "accepted: q8_0, q4_0, q4_k, f16"), (["--n-embd", "100"], "multiples of 32"),
                       (["--top-k", "0"], "--top-k=0")):
        r = subprocess.run([exe, str(tmp_path / "x.gguf"), "--vocab", vocab, *extra], capture_output=True, text=True)
        assert r.returncode == 2 and why in r.stderr, r.stderr
        assert not (tmp_path / "x.gguf").exists()
    r = subprocess.run([exe, str(tmp_path / "x.gguf"), "--vocab", vocab, "--dry-run"], capture_output=True, text=True)
    assert r.returncode == 0 and "bytes=" in r.stdout and not (tmp_path / "x.gguf").exists()


def test_generates_with_the_cache_on_a_loopback_device(rpc, tmp_path):
    """The written model loads and generates; cache on (8 of 16 slots) gives the cache-off logits
    bit for bit, with hits."""
    model = tmp_path / "m.gguf"
    _write(model)
    log_off, logits_off = _logits(model, rpc, tmp_path, engine.cache_args(0), "off.bin")
    log_on, logits_on = _logits(model, rpc, tmp_path, engine.cache_args(8), "on.bin")
    tokens = [ln for ln in log_off.splitlines() if ln.startswith("token ")]
    assert len(tokens) == 16 and len(set(tokens)) > 1
    assert logits_on == logits_off
    assert engine.parse_cache_summaries(log_on)[-1].hit_pct > 0
