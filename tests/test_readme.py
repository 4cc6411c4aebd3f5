"""The README as a new user pastes it (issue 17): its loopback-RPC blocks run as written, in order, and
its test commands say what they do.

The loopback section's shell and Python blocks are read from README.md itself, so the README and
this test cannot drift apart. They run in one bash, in order, the way a user pastes them into one
terminal with the venv active (a ``python`` block is what the user types into ``python`` started
there: ``python - <<EOF``); only the two fixed ports are swapped for free ones.
"""
from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pybmoe import engine

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LOOPBACK = "### Without a GPU: the loopback RPC device"


def section_blocks(heading: str, text: str | None = None) -> list[tuple[str, str]]:
    """``(language, code)`` of the fenced blocks under ``heading``, up to the next heading of the same
    or a higher level."""
    text = README.read_text() if text is None else text
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    assert heading in lines, f"README.md has no heading {heading!r}"
    start = lines.index(heading) + 1
    body = []
    for ln in lines[start:]:
        m = re.match(r"^(#+) ", ln)
        if m and len(m.group(1)) <= level:
            break
        body.append(ln)
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", "\n".join(body) + "\n",
                                                           re.M | re.S)]


def test_section_blocks_reads_fences_under_one_heading():
    text = "## A\n```sh\na\n```\n### B\n```python\nb\n```\ntext\n```sh\nc\n```\n## C\n```sh\nd\n```\n"
    assert section_blocks("### B", text) == [("python", "b\n"), ("sh", "c\n")]
    assert section_blocks("## A", text) == [("sh", "a\n"), ("python", "b\n"), ("sh", "c\n")]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_loopback_flow_runs_as_pasted(tmp_path):
    """rpc server, pybmoe serve, the openai client, curl /metrics, stop; then pybmoe.Llama on the same
    device; then stop the device. Servers start, answer, and nothing is left running."""
    pytest.importorskip("openai")
    blocks = section_blocks(LOOPBACK)
    assert [lang for lang, _ in blocks] == ["sh", "python", "sh"]
    rpc_port, http_port = engine.free_port(), engine.free_port()
    script = []
    for lang, code in blocks:
        code = re.sub(r"\b50052\b", str(rpc_port), re.sub(r"\b8080\b", str(http_port), code))
        script.append(code if lang == "sh" else f"python - <<'PYBMOE_README_PY'\n{code}PYBMOE_README_PY\n")
    (tmp_path / "pasted.sh").write_text("\n".join(script))
    # the user's shell: the venv active (its bin first on PATH); the checkout's package, as every test
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(["bash", "pasted.sh"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        left = _group_alive(proc.pid)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in tmp_path.glob("*.log"))
    why = f"stdout:\n{out}\nstderr:\n{err[-4000:]}{logs}"
    assert not left, "the README's blocks left a process running\n" + why
    assert not _listening(rpc_port) and not _listening(http_port), why
    assert proc.returncode == 0, why
    # the server became healthy, answered the client and counted its cache on /metrics
    assert '{"status":"ok"}' in out, why
    assert re.search(r"^llamacpp:moe_cache_hits_total\S* \d", out, re.M), why
    assert re.search(r"^[^\n]*moe-cache: [\d.]+% hit, resident", out, re.M), why  # grep of server.log
    # pybmoe.Llama answered on the same device, with its stats, and quietly (verbose=False)
    assert re.search(r"^MoeCacheStats\(hits=\d+, misses=\d+", out, re.M), why
    assert "Failed to connect" not in err + logs and "Traceback" not in err, why
    assert re.search(r"^freed$", out, re.M), why
    # verbose=False: not one engine line (the cache's load line, preamble and summary used to print)
    assert "moe-cache" not in err and "llama_" not in err, why


def test_the_test_commands_show_progress_by_file_and_have_a_fast_subset(tmp_path):
    """tools/test.sh runs pytest at its default verbosity (one line per test file, with its seconds:
    tests/conftest.py), not -q's bare dots; `-m "not slow"` is a registered marker expression."""
    sh = (ROOT / "tools" / "test.sh").read_text()
    line = next(ln for ln in sh.splitlines() if "-m pytest" in ln)
    assert not re.search(r"\s-q\b|\s-v\b", line), line
    readme = README.read_text()
    assert 'tools/test.sh -m "not slow"' in readme
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_cli.py",
                        "tests/test_readme.py", "-m", "not slow", "--strict-markers",
                        "-k", "not progress_by_file"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^tests/test_cli\.py \.+ \d+ s +\[ *\d+%\]$", r.stdout, re.M), r.stdout
    assert re.search(r"^tests/test_readme\.py \.+ \d+ s +\[100%\]$", r.stdout, re.M), r.stdout
    assert "deselected" in r.stdout  # the slow README flow is left out


def test_every_test_the_slow_table_names_exists():
    """tests/conftest.py marks slow tests by file and name: a renamed test must not drop out of it."""
    import ast

    import importlib.util
    # by path: tests/routing has a conftest.py of its own, which may hold the name `conftest` by now
    spec = importlib.util.spec_from_file_location("pybmoe_tests_conftest", ROOT / "tests" / "conftest.py")
    top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top)
    SLOW = top.SLOW
    for rel, names in SLOW.items():
        path = ROOT / rel
        assert path.is_file(), rel
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        assert names == "*" or not (set(names) - defined), (rel, set(names) - defined)


def _demo_sample() -> list[str]:
    """The demo output pasted under "## The two commands"."""
    blocks = [code for lang, code in section_blocks("## The two commands") if lang == ""]
    assert len(blocks) == 1, "one plain block: the demo's sample output"
    return blocks[0].splitlines()


def _labels(lines: list[str]) -> list[str]:
    return [ln.split(":", 1)[0].rstrip() + ":" if ln else "" for ln in lines]


def test_the_readme_demo_sample_is_what_the_demo_prints(model_q8):
    """The cache part of `pybmoe demo`, run here: the README's sample has its lines, in its order, with
    the same `why` line word for word (issue 17: the sample had lost `device:` and `text:`, and showed
    the cache faster than cache-off, which it never is on the loopback device)."""
    from pybmoe.engine import demo
    lines: list[str] = []
    off, on = demo.run_demo(model_q8, n_predict=16, out=lines.append)
    sample = _demo_sample()
    first = sample[:sample.index("")]
    assert _labels(first) == _labels(lines)
    assert next(ln for ln in first if ln.startswith("why")) == next(ln for ln in lines if ln.startswith("why"))
    cache = {ln.split(":", 1)[0].strip(): ln for ln in first}
    tok_s = [float(re.search(r"([\d.]+) tok/s", cache[k]).group(1)) for k in ("cache off", "cache on")]
    assert tok_s[1] < tok_s[0], "the sample is a run without a GPU: cache on is slower there"
    assert "IDENTICAL" in cache["output"] and off.text == on.text


def test_the_readme_demo_sample_has_the_disk_tier_part():
    """Its second part: the lines run_stream_demo prints, and the ratio the README quotes; after the ratio,
    word for word, the line that says a single run's ratio swings with the machine's load."""
    from pybmoe.engine import demo
    sample = _demo_sample()
    second = sample[sample.index("") + 1:]
    assert _labels(second) == ["disk tier:", "mmap:", "stream:", "ratio:", "note:", "output:"]
    assert second[4] == demo.RATIO_NOTE
    ratio = float(re.search(r"ratio +: ([\d.]+)x", "\n".join(second)).group(1))
    assert f"{ratio:.1f}×" in README.read_text()


def test_pybmoe_demo_prints_the_readme_samples_lines(capsys):
    """The whole `pybmoe demo`, both parts (about 40 s): the same lines as the README's sample on stdout;
    on stderr, a progress line before each run (and before a model is written), nothing else."""
    from pybmoe.cli import demo as demo_cli
    assert demo_cli.main([]) == 0
    cap = capsys.readouterr()
    printed = cap.out.splitlines()
    assert _labels(printed) == _labels(_demo_sample())
    said = cap.err.splitlines()
    assert all(ln.startswith("pybmoe demo: ") for ln in said), cap.err
    runs = [ln.split(": ", 1)[1].split(":")[0] for ln in said if ": run " in ln]
    assert runs == ["run 1 of 2", "run 2 of 2", "run 1 of 3", "run 2 of 3", "run 3 of 3"], cap.err


# --------------------------------------------------------------------------- issue 52, item 9: claims that hold

def test_the_readmes_times_name_their_conditions():
    """The build "7-15 minutes" took 19 on a busy machine and the fast tests' "about 4 minutes" 7.5 beside
    other work: every build or test time in the README says whether the cores were idle or busy and when.
    The test commands' times are in their comments (with the lines of comment under each); the build's in
    the prose, a sentence each."""
    lines = README.read_text().splitlines()
    notes = []
    for i, ln in enumerate(lines):
        if ln.startswith("tools/test.sh") and "#" in ln:
            block = [ln.split("#", 1)[1]]
            block += [c.split("#", 1)[1] for c in itertools.takewhile(lambda c: c.lstrip().startswith("#"),
                                                                      lines[i + 1:])]
            notes.append(" ".join(block))
    prose = " ".join(" ".join(ln for ln in lines if not ln.startswith(("tools/", " ", "`", "|"))).split())
    notes += [s for s in re.split(r"(?<=\.)\s+(?=[A-Z`])", prose)
              if re.search(r"\d+(–\d+)? minutes", s) and "build" in s]
    assert len(notes) >= 4, notes
    for n in notes:
        assert re.search(r"idle|busy|beside", n) and re.search(r"20\d\d-\d\d-\d\d", n), n
    text = " ".join(README.read_text().split())
    assert "19 minutes on a busy 2-core machine" in text and "7.5 min beside other work" in text


def test_the_four_clients_figure_says_it_is_one_replayed_stream():
    """README and docs/benchmarks.md gave four clients at 0.98-1.52x one client; a new user read 0.25x and
    0.29x. Every place that gives the figure says that the four requests replay one routing stream, so it
    is not a multi-user figure, and gives the other reading. The README now gives the figures measured with
    each slot's own stream instead, the new user's reading among them."""
    readme = " ".join(README.read_text().split())
    assert "0.98–1.52x one client" not in readme
    assert re.search(r"each slot replays its own stream of the trace.{0,200}0\.43–0\.45x one", readme), readme
    said = 0
    for path in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        text = " ".join(path.read_text().split())
        for m in re.finditer(r"0\.98–1\.52x one client", text):
            said += 1
            near = text[max(0, m.start() - 200):m.end() + 600]
            assert re.search(r"replayed single stream|not a multi-user figure|no multi-user figure", near), (path, near)
            assert "0.25x and 0.29x" in near, (path, near)
    assert said >= 1


def test_the_one_line_claim_is_not_made_for_every_input():
    """Items 2 and 5 of the same try were answered in more than one line, so no doc says every new user's
    input is answered or refused in one line."""
    for path in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        text = " ".join(path.read_text().split())
        assert not re.search(r"every (new user's )?input[^.]{0,80}answered or refused in one line", text), path


def test_no_doc_names_upstreams_removed_no_mmap_flag():
    """Upstream removed --no-mmap (--load-mode none took its place): no doc names it, but as pybmoe-make-synth's
    own option (write with pwrite)."""
    for path in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for ln in path.read_text().splitlines():
            if "--no-mmap" in ln:
                assert "pybmoe-make-synth" in ln, (path, ln)


def test_pips_still_running_lines_are_pips_and_the_docs_say_so():
    """pip without a terminal prints `still running...` every minute: it is pip's spinner, not pybmoe's (no
    source of ours prints it), and the README says when it appears."""
    ours = [p for p in [*(ROOT / "pybmoe").rglob("*.py"), *(ROOT / "tools").glob("*"), ROOT / "CMakeLists.txt"]
            if p.is_file() and "still running" in p.read_text(errors="replace")]
    assert ours == []
    readme = " ".join(README.read_text().split())
    assert "without a terminal, as in CI or piped to a file, pip's own spinner prints `still running...`" in readme
