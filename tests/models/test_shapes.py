"""Shape presets: make-model --like writes the preset's MoE shape (reduced for CI)."""
from __future__ import annotations

import pytest

from pybmoe import cli, models
from pybmoe.models import shapes


def test_presets_cite_their_config():
    for name, s in shapes.PRESETS.items():
        assert s.name == name
        assert s.source.startswith("https://huggingface.co/") and s.source.endswith("/config.json")
        assert 1 <= s.top_k <= s.n_expert
    q = shapes.preset("qwen3-30b-a3b")
    assert (q.n_layer, q.n_expert, q.top_k, q.n_embd, q.n_ff_exp) == (48, 128, 8, 2048, 768)
    g = shapes.preset("granite-3.0-1b-a400m")
    assert (g.n_layer, g.n_expert, g.top_k) == (24, 32, 8)       # the shape of shared/data's routing trace


def test_estimate_full_size_without_writing():
    spec = shapes.preset("qwen3-30b-a3b").spec(ftype="Q4_K")
    total, experts = shapes.estimate_bytes(spec)
    # 48 layers x 128 experts x (2 x 768 rows of 2048 + 2048 rows of 768) Q4_K (144 bytes / 256 values)
    assert experts == 48 * 128 * (2 * 768 * 2048 + 2048 * 768) // 256 * 144
    assert experts < total < experts * 1.1


def test_like_reduced_writes_the_preset_shape(tmp_path, capsys):
    out = tmp_path / "q30.gguf"
    rc = cli.main(["make-model", str(out), "--like", "qwen3-30b-a3b", "--layers", "2", "--embd", "256", "--ff", "256"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "GiB" in printed and "Qwen3-30B-A3B/blob/main/config.json" in printed
    spec = models.read_spec(out)
    assert (spec.arch, spec.n_layer, spec.n_expert, spec.n_expert_used, spec.n_embd) == ("qwen3moe", 2, 128, 8, 256)


def test_like_q4k_rejects_a_shape_it_cannot_store(tmp_path, capsys):
    rc = cli.main(["make-model", str(tmp_path / "g.gguf"), "--like", "gpt-oss-20b", "--layers", "1", "--ftype", "Q4_K"])
    assert rc == 2
    assert "not a multiple of 256" in capsys.readouterr().err
    assert not (tmp_path / "g.gguf").exists()


def test_dry_run_and_unknown_preset(tmp_path, capsys):
    assert cli.main(["make-model", str(tmp_path / "x.gguf"), "--like", "qwen3-235b-a22b", "--dry-run"]) == 0
    assert "GiB" in capsys.readouterr().out and not (tmp_path / "x.gguf").exists()
    with pytest.raises(ValueError, match="accepted: qwen3-30b-a3b"):
        shapes.preset("mixtral")
    # without --like, make-model is the plain generator
    assert cli.main(["make-model", str(tmp_path / "d.gguf"), "--layers", "1", "--experts", "4", "--top-k", "2"]) == 0
    assert models.read_spec(tmp_path / "d.gguf").n_expert == 4
