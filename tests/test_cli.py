"""The `pybmoe` command line as a new user meets it (issue 17): the help lists every verb, and
`pybmoe serve --rpc` waits for its device instead of aborting."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pybmoe import cli, engine
from pybmoe.cli import serve, size

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_every_verb_with_one_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":mod:" not in out  # no raw docstring markup
    verbs = set(cli._MODULES) | {"serve", "bin"}
    assert verbs == set(cli.VERBS), "a verb without a help line, or a help line without a verb"
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    for v in verbs:
        assert v in lines and len(lines[v].split()) > 3, v
    assert "synth" in lines["trace"] and "backend-ops" in lines


def test_no_verb_or_an_unknown_one_prints_the_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "verbs:" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown verb 'frobnicate'" in err and "bench-stream" in err


def test_every_verb_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for v in cli.VERBS:
        assert f"`{v}`" in readme, v


def test_size_help_says_what_it_computes(capsys):
    with pytest.raises(SystemExit):
        size.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert ".py" not in out and "replayed with the engine's own policy" in out and "no hit rate" in out


def test_serve_finds_the_rpc_endpoints_as_llama_server_parses_them():
    assert serve.rpc_endpoints(["-m", "x", "--rpc", "127.0.0.1:1,h:2"], env={}) == ["127.0.0.1:1", "h:2"]
    assert serve.rpc_endpoints(["--rpc=a:1", "--rpc", "b:2"], env={}) == ["b:2"]  # the last one wins
    assert serve.rpc_endpoints(["-m", "x"], env={"LLAMA_ARG_RPC": "c:3"}) == ["c:3"]
    assert serve.rpc_endpoints(["-m", "x"], env={}) == []


def test_serve_waits_for_an_rpc_server_that_starts_late(capsys):
    """The README's loopback block starts ggml-rpc-server with & and pybmoe serve right after it; stock
    llama-server then aborts with `Failed to connect` and a backtrace. pybmoe serve waits."""
    port = engine.free_port()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_late():
        time.sleep(0.8)
        srv.bind(("127.0.0.1", port))
        srv.listen()

    t = threading.Thread(target=listen_late)
    t.start()
    try:
        t0 = time.monotonic()
        assert serve.wait_for_rpc([f"127.0.0.1:{port}"], 20) is None
        assert 0.5 < time.monotonic() - t0 < 15
        assert f"waiting for the ggml-rpc-server at 127.0.0.1:{port}" in capsys.readouterr().err
    finally:
        t.join()
        srv.close()


def test_serve_fails_with_one_line_when_no_rpc_server_comes(tmp_path):
    port = engine.free_port()
    env = dict(os.environ, PYBMOE_RPC_WAIT_S="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "serve", "-m", "nothing.gguf", "--rpc",
                        f"127.0.0.1:{port}"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"pybmoe serve: error: nothing accepts connections at 127.0.0.1:{port} after 1 s; start the device first "
        f"(ggml-rpc-server -p {port} &) or fix --rpc")
    assert len(r.stderr.strip().splitlines()) == 2  # the waiting line and the error: no backtrace
    assert serve.wait_for_rpc(["nohostport"], 1) == "rpc server 'nohostport' must be host:port"


def test_serve_memory_limit_is_parsed_and_bad_values_are_refused(capsys):
    assert serve.memory_limit_arg(["-m", "x", "--memory-limit-mb", "1300", "--port", "1"]) == (1300, ["-m", "x", "--port", "1"])
    assert serve.memory_limit_arg(["--memory-limit-mb=64"]) == (64, [])
    assert serve.memory_limit_arg(["-m", "x"]) == (None, ["-m", "x"])
    for bad in (["--memory-limit-mb", "lots"], ["--memory-limit-mb", "8"], ["--memory-limit-mb"]):
        assert serve.serve_main(bad) == 2
        assert "--memory-limit-mb" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_serve_help_lists_its_own_option_then_llama_servers(flag):
    """Issue 43, item 11: `pybmoe serve --help` printed only llama-server's help, without its own
    --memory-limit-mb or the --rpc wait."""
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "serve", flag], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(serve.serve_usage()), r.stdout[:2000]
    assert "--memory-limit-mb N" in r.stdout and "PYBMOE_RPC_WAIT_S" in r.stdout
    upstream = r.stdout[len(serve.serve_usage()):]
    assert "--moe-expert-cache" in upstream and "--moe-stream-cache-mb" in upstream, upstream[:2000]


def test_serve_runs_llama_server_inside_the_memory_limit():
    """`pybmoe serve --memory-limit-mb N` runs the server in a cgroup of N MiB (page cache included), forwards
    SIGTERM to it, and removes the cgroup when it exits."""
    import signal
    from pybmoe import models
    from pybmoe.engine import memlimit
    ok, why = memlimit.limit_available()
    if not ok:
        pytest.skip(why)
    port = engine.free_port()
    p = subprocess.Popen([sys.executable, "-m", "pybmoe.cli", "serve", "--memory-limit-mb", "1500", "-m",
                          str(models.default_model_path()), "--port", str(port), "-ngl", "0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert engine.wait_for_endpoint(f"127.0.0.1:{port}", 60)
        pids = subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True).stdout.split()
        server = [q for q in pids if "llama-server" in Path(f"/proc/{q}/cmdline").read_bytes().decode(errors="replace")]
        assert server, pids
        groups = Path(f"/proc/{server[0]}/cgroup").read_text()
        name = next(ln.split(":")[-1].strip() for ln in groups.splitlines() if "pybmoe-" in ln)
        folder = (memlimit.V1_ROOT if memlimit.V1_ROOT.is_dir() else memlimit.V2_ROOT) / name.lstrip("/")
        limit = folder / ("memory.limit_in_bytes" if memlimit.V1_ROOT.is_dir() else "memory.max")
        assert int(limit.read_text()) == 1500 * 2**20
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
    assert rc in (0, 128 + signal.SIGTERM, -signal.SIGTERM) and "under a 1500 MiB memory limit" in p.stderr.read()
    assert not folder.exists()


@pytest.mark.parametrize("args,says", [
    (["--disk-limit-mb", "-5"], "--disk-limit-mb -5: accepted: an integer >= 16 (MiB)"),
    (["--slots", "-1"], "--slots -1: accepted: an integer >= 0"),
    (["--inserts", "-2"], "--inserts -2: accepted: an integer >= 0"),
    (["-n", "1"], "-n/--n-predict 1: accepted: an integer >= 2"),
    (["-p", ""], "-p/--prompt is empty"),
    (["-m", "nothing.gguf"], "-m/--model nothing.gguf: no such file"),
    (["--route-replay", "nothing.csv"], "--route-replay nothing.csv: no such file"),
])
def test_demo_checks_every_argument_before_any_work(args, says, tmp_path):
    """Issue 26, finding 6: `pybmoe demo --disk-limit-mb -5` ran the whole first part (a model generated,
    an RPC server and two llama-servers started, 5.7 s) before it refused the limit. Every argument is
    checked first: one line on stderr, exit 2, nothing of part one printed, no model written."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYBMOE_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "demo", *args], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "", r.stdout  # no "device: ..." line: part one never started
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pybmoe demo: error: {says}"), r.stderr
    assert not (tmp_path / "cache").exists()


def test_demo_refuses_a_model_that_is_not_a_moe_gguf(tmp_path, capsys):
    from pybmoe.cli import demo as demo_cli
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    assert demo_cli.main(["-m", str(tmp_path / "x.gguf")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "is not a GGUF file" in cap.err


def test_bin_help_prints_a_help_and_exits_zero(capsys):
    """Issue 26, finding 7: `pybmoe bin --help` printed `--help (missing: --help not found in ...` and exited 2."""
    assert cli.main(["bin", "--help"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("usage: pybmoe bin [NAME...]\n") and cap.out.endswith("\n") and cap.err == ""
    for name in engine.BINARIES:
        assert name in cap.out
    assert cli.main(["bin", "frobnicate"]) == 2
    assert "'frobnicate' is not one of pybmoe's binaries; accepted: llama-server" in capsys.readouterr().err


def test_bin_help_says_what_every_binary_is_and_which_are_test_programs(capsys):
    """`pybmoe bin` lists pybmoe-test-skip and pybmoe-test-residency, which no user doc named: its --help
    gives every binary one line, and says those two are the test suite's programs."""
    from pybmoe.engine import binaries
    assert cli.main(["bin", "--help"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    assert set(lines) == set(engine.BINARIES) == set(binaries.BINARY_DOCS)
    for name in binaries.TEST_BINARIES:
        assert "a test program of the test suite" in lines[name], lines[name]
    assert "pybmoe-test-skip and pybmoe-test-residency are test programs" in out
    assert "not tools to run by hand" in out
    assert "pybmoe bin --help" in (ROOT / "README.md").read_text()  # where the README points for them


def test_bin_lists_the_tools_the_readme_names(capsys):
    """Issue 26, finding 1: `pybmoe bin` did not list pybmoe-make-synth or pybmoe-bw."""
    rc = cli.main(["bin"])
    cap = capsys.readouterr()
    listed = {ln.split("\t")[0] for ln in (cap.out + cap.err).splitlines()}
    assert {"pybmoe-make-synth", "pybmoe-bw", "pybmoe-logits"} <= listed
    assert rc == 0, cap.err  # every one found in an installed pybmoe


def _cut(src: Path, dst: Path, n: int) -> Path:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(n))
    return dst


def test_size_refuses_a_truncated_model(model_q8, tmp_path, capsys):
    """Issue 26, finding 7: `pybmoe size -m <truncated.gguf>` exited 0 with a recommendation; llama.cpp
    refuses the file at load. A copy cut in its tensor data, or in its header, is refused: exit 2, one line."""
    full = model_q8.stat().st_size
    half = _cut(model_q8, tmp_path / "half.gguf", full // 2)
    assert size.main(["-m", str(half)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "recommended" not in cap.err
    assert cap.err.startswith(f"pybmoe size: error: {half} is truncated: the data of tensor '"), cap.err
    assert f"past the end of the file ({full // 2} bytes" in cap.err
    head = _cut(model_q8, tmp_path / "head.gguf", 4096)  # inside the vocab's strings
    assert size.main(["-m", str(head)]) == 2
    cap = capsys.readouterr()
    assert "the GGUF header is cut off" in cap.err and "Traceback" not in cap.err and cap.out == ""
    last = _cut(model_q8, tmp_path / "last.gguf", full - 1)  # one byte short
    assert size.main(["-m", str(last)]) == 2
    err = capsys.readouterr().err
    assert "1 missing" in err
    # the oracle: the engine refuses the same file, naming the same tensor
    r = subprocess.run([str(engine.find_binary("pybmoe-logits")), "-m", str(last), "-p", "Hi", "-n", "1",
                        "--logits-out", str(tmp_path / "l.bin")], capture_output=True, text=True, timeout=60)
    named = re.search(r"tensor '([^']+)' data is not within the file bounds", r.stdout + r.stderr)
    assert r.returncode != 0 and named, r.stderr[-2000:]
    assert f"the data of tensor '{named.group(1)}' ends at byte {full}," in err, err
    assert size.main(["-m", str(model_q8)]) == 0  # the whole file still sizes


def test_demo_help_says_what_both_parts_do_and_helps_every_option(capsys):
    """`pybmoe demo --help` said only "The main job on the embedded default model, on any machine." and
    -p had no help: the description names both parts and their times, and every option has a help text."""
    from pybmoe.cli import demo as demo_cli
    with pytest.raises(SystemExit) as e:
        demo_cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "The main job" not in text
    assert "1. The expert cache (about 6 s" in text and "2. The disk tier (about 30 s): a 915 MiB model" in text
    assert "cache off and on" in text and "--moe-stream-cache-mb auto" in text and "Exit status: 0" in text
    options = [a for a in demo_cli.parser()._actions if a.option_strings]
    assert len(options) == 9  # -h and the eight options
    for a in options:
        assert a.help and len(a.help.split()) > 3, a.option_strings
        assert " ".join(a.help.split()[:3]) in text, a.option_strings  # shown by --help
    assert "the first part's prompt" in text
