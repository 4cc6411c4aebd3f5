"""The bundled trace by its short name, from any directory: `pybmoe trace stats granite` failed (only
`pybmoe/data/granite-3.0-1b-a400m-routing.json`, from the checkout's root, worked) while
`pybmoe demo --route-replay granite` took the name. Every verb that reads a trace takes it now, and a
trace that is not there is refused with the short names in the message."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pybmoe import cli, models
from pybmoe.routing import granite, trace

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory outside the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_read_trace_takes_the_short_name(elsewhere):
    assert trace.trace_path("granite") == granite.GRANITE_TRACE and granite.GRANITE_TRACE.is_file()
    t = trace.read_trace("granite")
    assert (t.meta.n_layer, t.meta.n_expert, t.meta.n_expert_used) == (24, 32, 8)
    with pytest.raises(FileNotFoundError, match=r"trace nothing\.csv not found; accepted: .*short name: granite \("):
        trace.read_trace("nothing.csv")


@pytest.mark.parametrize("argv,says", [
    (["trace", "stats", "granite"], "english_prose"),
    (["trace", "convert", "granite", "-o", "g.csv"], "g.csv: "),
    (["trace", "granite", "-o", "g2.csv"], "g2.csv: "),
    (["trace", "synth", "--from", "granite", "--steps", "8", "--out", "s.csv"], "(from granite, seed 0)"),
    (["simulate", "granite", "--slots-per-layer", "8"], "layer-lru"),
])
def test_every_trace_verb_takes_the_short_name_from_any_directory(argv, says, elsewhere, capsys):
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert says in capsys.readouterr().out


@pytest.mark.parametrize("argv,prefix", [
    (["trace", "stats", "nothing.json"], "pybmoe trace stats: error: "),
    (["trace", "convert", "nothing.json", "-o", "x.csv"], "pybmoe trace: error: "),
    (["trace", "synth", "--from", "nothing.json", "--steps", "8", "--out", "s.csv"], "pybmoe trace synth: error: "),
    (["simulate", "nothing.json", "--slots-per-layer", "8"], "pybmoe simulate: error: "),
])
def test_a_missing_trace_is_refused_naming_the_short_names(argv, prefix, elsewhere, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prefix}trace nothing.json not found; accepted: a trace file"), err
    assert "short name: granite (the bundled granite-3.0-1b-a400m routing trace" in err[0]


def test_size_reads_the_short_name(model_q8, elsewhere, capsys):
    """The trace is found (and refused for this model's shape, which is not granite's), and a missing
    one names the short names."""
    assert cli.main(["size", "-m", str(model_q8), "--trace", "granite"]) == 2
    assert "the trace has 32 experts, top-8; the model has 16, top-4" in capsys.readouterr().err
    assert cli.main(["size", "-m", str(model_q8), "--trace", "nothing.csv"]) == 2
    assert "short name: granite" in capsys.readouterr().err


def test_bench_stream_replays_the_short_name_as_the_engines_csv(elsewhere, monkeypatch, tmp_path):
    from pybmoe.cli import bench_stream
    monkeypatch.setenv("PYBMOE_CACHE", str(tmp_path / "cache"))
    csv = bench_stream.route_replay_file(Path("granite"))
    assert csv == models.cache_dir() / "granite-routing-english_prose.csv"
    t = trace.read_trace(csv)  # the engine's format, the trace's shape
    assert (t.meta.n_layer, t.meta.n_expert, t.meta.n_expert_used) == (24, 32, 8)
    with pytest.raises(FileNotFoundError, match="accepted: a --moe-trace CSV, or granite"):
        bench_stream.route_replay_file(Path("nothing.csv"))
    assert bench_stream.route_replay_file(None) is None


def _first_block_commands() -> list[str]:
    text = (ROOT / "docs" / "traces.md").read_text()
    block = re.search(r"^```sh\n(.*?)^```$", text, re.M | re.S).group(1).replace("\\\n", " ")
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip()]


def test_the_docs_first_commands_run_as_written_from_any_directory(tmp_path):
    """docs/traces.md's first block (not its `pybmoe size -m model.gguf`, a placeholder model), run as a
    user types it, in an empty folder: each exits 0 (about 4 s: the simulator's full sweep)."""
    cmds = [c for c in _first_block_commands() if "model.gguf" not in c]
    assert [c.split()[:3] for c in cmds] == [["pybmoe", "trace", "stats"], ["pybmoe", "simulate", "granite"]]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for c in cmds:
        words = shlex.split(c)
        r = subprocess.run([sys.executable, "-m", "pybmoe.cli", *words[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{c}\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "granite-hit-rate.png").is_file()
