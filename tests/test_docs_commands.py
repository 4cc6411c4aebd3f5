"""The installed tools as the README and docs/ show them (issue 26): every command line of
``pybmoe-make-synth``, ``pybmoe-bw``, ``pybmoe-logits``, ``pybmoe bin``, ``pybmoe make-model`` and
``pybmoe --help`` in README.md and docs/ (every page, each run's README under docs/benchmarks/ too; fenced
shell blocks and inline code) is found here and run as written, by the console scripts ``pip install .``
makes from ``pyproject.toml``.

The console scripts are made the way pip makes them (import the entry point's module, call its
function) into a folder first on PATH, over this checkout (``PYTHONPATH``), so a command runs what
an installed pybmoe runs; the engine's binaries come from the installed package
(:func:`pybmoe.engine.find_binary`). A command that writes gigabytes runs as written in the slow
set; the fast set runs it with ``--dry-run`` added and holds the sizes the docs quote beside it to
the sizes it prints.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pybmoe import engine, models

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/benchmarks/<run>/README.md too
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

#: What a command starts with to be one of the installed tools' (this file's scope).
TOOLS = ("pybmoe-make-synth", "pybmoe-bw", "pybmoe-logits", "pybmoe bin", "pybmoe make-model", "pybmoe --help")
#: A tool named in prose, not a command to run (the bare name of a tool that needs arguments).
REFERENCES = {"pybmoe-make-synth", "pybmoe-bw", "pybmoe-logits", "pybmoe make-model"}
#: Options quoted from a run whose model is named elsewhere in the text (no -m): not a command line.
FRAGMENTS = {
    'pybmoe-logits -p "The quick brown fox" -n 24 -c 512 -t 2 --fit off -ngl 99 --cpu-moe --no-repack':
        "docs/backends.md: the Vulkan identity run's flags; the models are the table's",
    "pybmoe-logits -p Hello -n 1":
        "docs/benchmarks/stream-defaults-2026-12-03/README.md: a heading naming the load run of models A-C",
}
#: The model writers: a command of theirs that writes a model (an OUT, no --dry-run) runs as written in the
#: slow set; the fast set adds --dry-run (the big ones write gigabytes).
BIG = ("pybmoe-make-synth", "pybmoe make-model")


def _writes(cmd: str) -> bool:
    return cmd.startswith(BIG) and "--dry-run" not in cmd and any(w.endswith(".gguf") for w in cmd.split())


def _heavy(cmd: str) -> bool:
    """A command of seconds that only the slow set runs: the bandwidth probe over gigabytes."""
    m = re.search(r"--host-mib (\d+)", cmd)
    return cmd.startswith("pybmoe-bw") and "--help" not in cmd and (m is None or int(m.group(1)) >= 1024)


def _is_synopsis(cmd: str) -> bool:
    """A usage line, not a command: a placeholder (OUT, NAME, N), alternatives or optional parts."""
    return bool(re.search(r"\b[A-Z][A-Z_]+\b|[|\[\]…]|\.\.\.", cmd.split(" #")[0]))


def doc_commands() -> list[tuple[str, str]]:
    """``(file, command)`` of every command line of :data:`TOOLS` in the docs, in order: fenced
    ``sh`` lines (with their continuation lines, without a trailing ``# comment``) and inline code
    (a span may wrap onto the next line)."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        rel = doc.relative_to(ROOT).as_posix()
        fenced = list(re.finditer(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```[ \t]*$", text, re.M | re.S))
        for m in fenced:
            if m.group(1) not in ("sh", "bash"):
                continue
            for ln in m.group(2).replace("\\\n", " ").splitlines():
                ln = re.sub(r"\s+#\s.*$", "", ln).strip()
                if ln.startswith(TOOLS):
                    found.append((rel, " ".join(ln.split())))
        prose = text
        for m in reversed(fenced):
            prose = prose[:m.start()] + prose[m.end():]
        for m in re.finditer(r"`([^`]+)`", prose):
            span = " ".join(m.group(1).split())
            if span.startswith(TOOLS):
                found.append((rel, span))
    return found


def runnable() -> list[tuple[str, str]]:
    """The commands to run: every one that is not a reference, a fragment or a synopsis."""
    return [(f, c) for f, c in doc_commands() if c not in REFERENCES and c not in FRAGMENTS and not _is_synopsis(c)]


FAST_RUNS = [(d, c) for d, c in runnable() if not _heavy(c)]


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict:
    """A user's shell after `pip install .`: every [project.scripts] command on PATH, over this checkout."""
    bindir = tmp_path_factory.mktemp("bin")
    for name, target in SCRIPTS.items():
        mod, func = target.split(":")
        p = bindir / name
        p.write_text(f"#!{sys.executable}\nimport sys\nfrom {mod} import {func}\nsys.exit({func}())\n")
        p.chmod(0o755)
    return dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(ROOT))


def _run(cmd: str, env: dict, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- the scripts table

def test_pyproject_installs_every_tool_the_readme_names_as_a_command():
    """Finding 1: `pybmoe-make-synth`, `pybmoe-bw` and `pybmoe-logits` gave `command not found` after
    `pip install .`: only the upstream names were console scripts."""
    import importlib
    readme = (ROOT / "README.md").read_text()
    for name in ("pybmoe-make-synth", "pybmoe-bw", "pybmoe-logits"):
        assert f"`{name}`" in readme, name
        assert name in SCRIPTS, f"{name} is not in pyproject.toml's [project.scripts]"
    for name, target in SCRIPTS.items():
        mod, func = target.split(":")
        assert callable(getattr(importlib.import_module(mod), func)), target


def test_the_installed_environment_has_every_script():
    """Where pybmoe is installed (not a checkout on sys.path alone), its console scripts are the table's:
    a stale install says to reinstall."""
    from importlib import metadata
    try:
        dist = metadata.distribution("pybmoe")
    except metadata.PackageNotFoundError:
        pytest.skip("pybmoe is not installed in this environment")
    installed = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert installed == SCRIPTS, "the installed pybmoe predates pyproject.toml's [project.scripts]: pip install ."
    bindir = Path(sys.executable).parent
    missing = [n for n in SCRIPTS if not (bindir / n).is_file()]
    assert not missing, f"not in {bindir}: {missing}"


# --------------------------------------------------------------------------- the docs' commands

def test_the_docs_commands_are_found():
    """The extractor finds the commands this file is about, and nothing it does not classify."""
    cmds = [c for _, c in doc_commands()]
    assert "pybmoe --help" in cmds and "pybmoe bin" in cmds
    synth = [c for c in cmds if c.startswith("pybmoe-make-synth ") and not _is_synopsis(c)]
    assert len(synth) >= 2 and all(c.split()[1].endswith(".gguf") for c in synth), synth  # each with its OUT
    assert any(c.startswith("pybmoe-bw ") for c in cmds)
    assert any("--like" in c and "--experts" in c for c in cmds)  # a preset field overridden
    assert set(FRAGMENTS) <= set(cmds), set(FRAGMENTS) - set(cmds)  # a stale fragment entry


def _quoted_gib(doc: str, cmd: str) -> float:
    """The size in GiB the docs give right after a command (``(2.63 GiB: ...``)."""
    text = " ".join((ROOT / doc).read_text().split())
    i = text.index(cmd) + len(cmd)
    return float(re.match(r"`? \(([\d.]+) GiB", text[i:i + 40]).group(1))


@pytest.mark.parametrize("doc,cmd", FAST_RUNS, ids=[c[:60] for _, c in FAST_RUNS])
def test_each_docs_command_runs_as_written(doc, cmd, shell_env, tmp_path):
    """Each command of the docs runs (exit 0) in an empty folder; one that would write gigabytes runs
    with --dry-run, and the sizes it prints are the ones the docs quote."""
    run = cmd + " --dry-run" if _writes(cmd) else cmd
    r = _run(run, shell_env, tmp_path)
    assert r.returncode == 0, f"{doc}: {run}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr
    if cmd.startswith("pybmoe-make-synth"):
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("pybmoe-make-synth: "))
        kv = dict(w.split("=") for w in line.split()[2:])
        assert round(int(kv["bytes"]) / 2**30, 2) == pytest.approx(_quoted_gib(doc, cmd), abs=0.011), line
    elif cmd.startswith("pybmoe make-model") and "--dry-run" in run:
        assert "GiB" in r.stdout and not list(tmp_path.iterdir())
        words = shlex.split(cmd)
        if "--experts" in words:  # a preset's field, overridden
            assert f"-E{words[words.index('--experts') + 1]}-" in r.stdout, r.stdout
    elif cmd.startswith("pybmoe-bw") and "--help" not in cmd:
        assert re.match(r"pybmoe-bw: host_read_gbs=[\d.]+ ", r.stdout), r.stdout
    elif cmd == "pybmoe bin":
        names = [ln.split("\t")[0] for ln in r.stdout.splitlines()]
        assert {"pybmoe-make-synth", "pybmoe-bw", "pybmoe-logits", "llama-server"} <= set(names), r.stdout


BIG_RUNS = [(d, c) for d, c in runnable() if _writes(c) or _heavy(c)]


@pytest.mark.parametrize("doc,cmd", BIG_RUNS, ids=[c[:60] for _, c in BIG_RUNS])
def test_each_big_docs_command_writes_its_model_as_written(doc, cmd, shell_env, tmp_path):
    """The commands that write gigabytes, as written: the model they write is the shape they name."""
    r = _run(cmd, shell_env, tmp_path, timeout=600)
    assert r.returncode == 0, f"{doc}: {cmd}\n{r.stdout}\n{r.stderr[-3000:]}"
    if cmd.startswith("pybmoe-bw"):
        assert re.match(r"pybmoe-bw: host_read_gbs=[\d.]+ ", r.stdout), r.stdout
        return
    out = tmp_path / shlex.split(cmd)[1 if cmd.startswith("pybmoe-") else 2]
    try:
        models.check_complete(out)
        spec = models.read_spec(out)
        words = shlex.split(cmd)
        if "--n-expert" in words:
            assert spec.n_expert == int(words[words.index("--n-expert") + 1])
            assert spec.n_layer == int(words[words.index("--n-layer") + 1])
    finally:
        out.unlink(missing_ok=True)  # gigabytes: pytest keeps its last three temporary folders


# --------------------------------------------------------------------------- pybmoe-make-synth's own checks

def _entry(name: str, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The console entry point ``name`` called as pip's script calls it, with ``args``."""
    mod, func = SCRIPTS[name].split(":")
    code = f"import sys; sys.argv = [{name!r}, *sys.argv[1:]]; from {mod} import {func}; sys.exit({func}())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env=env or dict(os.environ, PYTHONPATH=str(ROOT)), cwd=cwd or ROOT)


def test_make_synth_names_the_missing_output_path():
    """Finding 1: the docs' example without an output path printed only the usage and exit 2."""
    r = _entry("pybmoe-make-synth", "--n-layer", "24", "--n-expert", "64", "--type", "q8_0")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0].startswith("pybmoe-make-synth: error: missing OUT, the .gguf to write"), r.stderr
    assert "usage:" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,says", [
    (["m.gguf", "--type"], "--type needs a value"),
    (["m.gguf", "--experts", "8"], "unknown argument '--experts'; accepted: OUT, --vocab"),
    (["a.gguf", "b.gguf"], "a second output path 'b.gguf'"),
])
def test_make_synth_names_each_bad_argument(args, says, tmp_path):
    r = _entry("pybmoe-make-synth", *args, cwd=tmp_path)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["pybmoe-make-synth", "pybmoe make-model"])
@pytest.mark.parametrize("case", ["missing folder", "a file as the folder", "a folder as OUT"])
def test_the_writers_create_no_folder_and_refuse_one_as_out(name, case, tmp_path):
    """Issue 43, item 3: `pybmoe make-model /nonexistent/dir/x.gguf` exited 0 and created the folders
    (as root, at /); now both writers refuse an OUT whose folder does not exist in one line, exit 2,
    and leave nothing behind."""
    out = {"missing folder": tmp_path / "no" / "such" / "x.gguf", "a file as the folder": tmp_path / "f" / "x.gguf",
           "a folder as OUT": tmp_path / "d"}[case]
    if case == "a file as the folder":
        out.parent.write_text("")
    if case == "a folder as OUT":
        out.mkdir()
    before = sorted(tmp_path.rglob("*"))
    if name == "pybmoe-make-synth":
        r = _entry(name, str(out), "--n-layer", "2", cwd=tmp_path)
    else:
        r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "make-model", str(out), "--layers", "1"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    says = {"missing folder": f"{out}: the folder {out.parent} does not exist; create it first "
                              f"(mkdir -p {out.parent})",
            "a file as the folder": f"{out}: {out.parent} is not a folder",
            "a folder as OUT": f"{out} is a folder; accepted: the path of the .gguf file to write"}[case]
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines()[0] == f"{name}: error: {says}", r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(tmp_path.rglob("*")) == before


def test_make_synth_defaults_the_vocab_to_the_pinned_one(tmp_path):
    """Finding 1: --vocab was required; now the pinned Qwen2 vocab that `pybmoe make-model` embeds."""
    from pybmoe.cli import tools
    assert tools.make_synth_args(["x.gguf", "--n-layer", "2"]) == [
        "x.gguf", "--n-layer", "2", "--vocab", str(models.default_vocab_path())]
    assert tools.make_synth_args(["--vocab", "v.gguf", "x.gguf"]) == ["--vocab", "v.gguf", "x.gguf"]
    engine.find_binary("pybmoe-make-synth")
    r = _entry("pybmoe-make-synth", "m.gguf", "--n-layer", "2", "--n-expert", "4", "--top-k", "2", "--n-embd", "64",
               "--n-ff-exp", "64", "--n-head", "2", "--n-head-kv", "1", "--head-dim", "32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    spec = models.read_spec(tmp_path / "m.gguf")
    assert (spec.n_layer, spec.n_expert, spec.n_expert_used, spec.n_embd) == (2, 4, 2, 64)
    written = models.read_metadata(tmp_path / "m.gguf").kvs["tokenizer.ggml.tokens"].value
    pinned = next(kv.value for kv in models.tokenizer_kvs(models.default_vocab_path()) if kv.key == "tokenizer.ggml.tokens")
    assert written == pinned


@pytest.mark.parametrize("name", ["pybmoe-make-synth", "pybmoe-bw"])
def test_the_tools_help_exits_zero_with_units(name):
    """`pybmoe-bw --help` printed a bare usage line and exited 2."""
    r = _entry(name, "--help")
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {name} ") and r.stdout.endswith("\n"), r.stdout + r.stderr
    units = ("MiB", "GB/s") if name == "pybmoe-bw" else ("elements", "bytes", "default: the pinned Qwen2 vocab")
    assert all(u in r.stdout for u in units), r.stdout


# --------------------------------------------------------------------------- the docs' other claims

def test_rebasing_states_no_stale_count_of_the_series():
    """Finding 7: docs/rebasing.md said "all 14 replay clean" of a series of 27. A count of the patches
    that replay is the series' own, and the test it cites for the whole series exists."""
    text = " ".join((ROOT / "docs" / "rebasing.md").read_text().split())
    n = len([ln for ln in (ROOT / "patches" / "series").read_text().splitlines() if ln.strip() and not ln.startswith("#")])
    for m in re.finditer(r"\ball (\d+) (?:patches )?replay", text):
        assert int(m.group(1)) == n, f"docs/rebasing.md: {m.group(0)!r}, but patches/series has {n}"
    cited = re.search(r"tests/build/test_patches\.py::(\w+)", text)
    assert cited and f"def {cited.group(1)}(" in (ROOT / "tests" / "build" / "test_patches.py").read_text()


def test_rebasing_names_the_engines_version_as_the_pin_itself():
    """Issue 43, item 10: docs/rebasing.md said that onto the pin itself every patch replays clean with
    `--onto 0.3.36`; since the engine comes from its own sdist that gives 5 clean and 28 fuzzy (the
    bindings' sdist vendors the old llama.cpp). The pin itself is the engine's version, and the test
    the page cites for it rebases onto that version."""
    from pybmoe.build import vendor
    pin = vendor.load_pin(ROOT)
    text = " ".join((ROOT / "docs" / "rebasing.md").read_text().split())
    said = re.search(r"the pin itself is the engine's version: `pybmoe patches rebase --onto ([^`]+)`", text)
    assert said and said.group(1) == pin.engine.version, said
    cited = (ROOT / "tests" / "build" / "test_patches.py").read_text()
    body = cited.split("def test_rebase_onto_the_pinned_version_is_all_clean(", 1)[1].split("\ndef ", 1)[0]
    assert "onto = pin.engine.version if pin.engine else pin.version" in body
    assert f"`--onto {pin.version}` now takes the llama.cpp vendored in llama-cpp-python {pin.version}" in text
    # the README's one line on the tool names both kinds of version
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"--onto {pin.engine.version}" in readme


def test_the_loopback_page_quotes_the_readmes_demo_ratio():
    """Issue 43, item 14: docs/loopback.md quoted 10.2x and said "the README shows that run", while the
    README's demo output shows 12.62x. The ratio it gives as the README's is the README's."""
    readme = (ROOT / "README.md").read_text()
    ratio = re.search(r"^ratio\s+: ([0-9.]+)x$", readme, re.M).group(1)
    text = " ".join((ROOT / "docs" / "loopback.md").read_text().split())
    quoted = re.search(r"prints the ratio: ([0-9.]+)× mmap's decode in the README's run \((\d{4}-\d\d-\d\d)", text)
    assert quoted and quoted.group(1) == ratio, (quoted and quoted.group(0), ratio)
    assert quoted.group(2) in readme  # the README dates that run


def _minutes(text: str) -> float:
    m = re.search(r"(\d+) min (\d+) s of pytest", text)
    return int(m.group(1)) + int(m.group(2)) / 60


def test_the_readmes_test_times_are_the_measured_ones():
    """Finding 3: the README said the fast subset takes about 3 minutes and everything 20-25; each is
    "about N minutes on 2 cores", N the figure docs/build.md measured, rounded."""
    readme = (ROOT / "README.md").read_text()
    table = {ln.split("`")[1]: ln for ln in (ROOT / "docs" / "build.md").read_text().splitlines()
             if ln.startswith("| `tools/test.sh")}
    for cmd in ("tools/test.sh", 'tools/test.sh -m "not slow"'):
        line = next(ln for ln in readme.splitlines() if re.match(re.escape(cmd) + r"\s+#", ln))
        said = re.search(r"about (\d+) minutes on 2 cores", line)
        assert said, line
        assert int(said.group(1)) == round(_minutes(table[cmd])), (line, table[cmd])
        assert f"about {said.group(1)} minutes" in table[cmd], table[cmd]
