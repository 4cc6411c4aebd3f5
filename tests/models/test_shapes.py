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


def test_make_model_help_shows_every_option(capsys):
    """Issue 26, finding 4: `pybmoe make-model --help` hid --like, --dry-run and --list-presets (they were
    parsed only on a second path, after the first parser had printed its help)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["make-model", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--like", "--dry-run", "--list-presets", "--experts", "--top-k", "--arch", "--vocab"):
        assert opt in out, opt
    assert "granite-3.0-1b-a400m" in out


def test_like_preset_fields_are_overridable(tmp_path, capsys):
    """Issue 26, finding 4: with --like, `--experts 64` was an unrecognized argument. Every field of the
    preset is overridable, in the size --dry-run prints and in the file written."""
    assert cli.main(["make-model", str(tmp_path / "x.gguf"), "--like", "granite-3.0-1b-a400m", "--experts", "64",
                     "--top-k", "4", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    spec = shapes.preset("granite-3.0-1b-a400m").spec(n_expert=64, top_k=4)
    total, experts = shapes.estimate_bytes(spec)
    assert "-L24-E64-K4-D1024-F512-" in printed and f"({experts / 2**30:.2f} GiB of experts" in printed, printed
    assert experts == 2 * shapes.estimate_bytes(shapes.preset("granite-3.0-1b-a400m").spec())[1]  # twice the experts
    assert not (tmp_path / "x.gguf").exists()
    out = tmp_path / "g.gguf"
    assert cli.main(["make-model", str(out), "--like", "granite-3.0-1b-a400m", "--layers", "1", "--experts", "4",
                     "--top-k", "2", "--embd", "64", "--ff", "64"]) == 0
    s = models.read_spec(out)
    assert (s.n_layer, s.n_expert, s.n_expert_used, s.n_embd) == (1, 4, 2, 64)
    # an override out of range is refused with the field's name, and nothing is written
    assert cli.main(["make-model", str(tmp_path / "bad.gguf"), "--like", "granite-3.0-1b-a400m", "--top-k", "40"]) == 2
    assert "n_expert_used=40" in capsys.readouterr().err and not (tmp_path / "bad.gguf").exists()
    assert cli.main(["make-model", str(tmp_path / "bad.gguf"), "--like", "granite-3.0-1b-a400m", "--arch", "gemma4"]) == 2
    assert "--like writes a qwen3moe model" in capsys.readouterr().err


def test_dry_run_without_a_preset_writes_nothing(tmp_path, capsys):
    assert cli.main(["make-model", str(tmp_path / "t.gguf"), "--experts", "8", "--top-k", "2", "--dry-run"]) == 0
    assert "-E8-K2-" in capsys.readouterr().out and not (tmp_path / "t.gguf").exists()
    with pytest.raises(SystemExit) as e:
        cli.main(["make-model"])
    assert e.value.code == 2 and "OUT (the .gguf path to write) is required" in capsys.readouterr().err


def test_dry_run_needs_no_output_path(capsys):
    """`pybmoe make-model --like granite-3.0-1b-a400m --experts 64 --dry-run` exited 2 asking for OUT."""
    assert cli.main(["make-model", "--like", "granite-3.0-1b-a400m", "--experts", "64", "--dry-run"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("qwen3moe-L24-E64-K8-D1024-F512-") and "about 2.63 GiB" in cap.out, cap.out
    assert cap.err == ""
    assert cli.main(["make-model", "--experts", "8", "--top-k", "2", "--dry-run"]) == 0
    assert "-E8-K2-" in capsys.readouterr().out


def test_a_large_model_is_announced_with_the_faster_writer(tmp_path, capsys, monkeypatch):
    """The 2.63 GiB granite shape with 64 experts was written in 54 s without a line. Above 256 MiB one line
    on stderr comes first: the size, the path, and pybmoe-make-synth's command for the same shape."""
    import shlex
    import subprocess

    from pybmoe import engine
    from pybmoe.cli import make_model, tools
    seen: list[str] = []

    def write(spec, out, **kw):
        seen.append(capsys.readouterr().err)  # what was printed before the write began
        out.write_bytes(b"")
        return out

    monkeypatch.setattr(models, "write_model", write)
    monkeypatch.setattr(models, "expert_bytes", lambda spec: 0)  # the summary line after the write
    out = tmp_path / "g.gguf"
    assert cli.main(["make-model", str(out), "--like", "granite-3.0-1b-a400m", "--experts", "64"]) == 0
    assert len(seen) == 1
    note = seen[0].strip().splitlines()[-1]
    assert note.startswith(f"pybmoe make-model: writing about 2.63 GiB to {out}, ") and "much faster" in note, note
    cmd = note.split("other random weights): ", 1)[1]
    assert cmd == make_model.make_synth_command(shapes.preset("granite-3.0-1b-a400m").spec(n_expert=64), out)
    args = tools.make_synth_args(shlex.split(cmd)[1:])  # options pybmoe-make-synth accepts
    try:
        exe = engine.find_binary("pybmoe-make-synth")
    except engine.EngineError:
        exe = None
    if exe is not None:  # and the same shape: the bytes it would write are the tensors' estimate plus the header
        r = subprocess.run([str(exe), *args, "--dry-run"], capture_output=True, text=True, timeout=60)
        kv = dict(w.split("=") for w in r.stdout.split()[2:])
        total, _ = shapes.estimate_bytes(shapes.preset("granite-3.0-1b-a400m").spec(n_expert=64))
        assert total < int(kv["bytes"]) < total + 32 * 2**20, r.stdout
    # a small model is written without the line
    seen.clear()
    assert cli.main(["make-model", str(tmp_path / "t.gguf"), "--experts", "8", "--top-k", "2"]) == 0
    assert seen == [""] and "pybmoe make-model: writing" not in capsys.readouterr().err
