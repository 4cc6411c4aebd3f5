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

import numpy as np
import pytest

from pybmoe import cli, engine, models
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


def test_serve_fails_with_one_line_when_no_rpc_server_comes(tmp_path, model_q8):
    port = engine.free_port()
    env = dict(os.environ, PYBMOE_RPC_WAIT_S="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "serve", "-m", str(model_q8), "--rpc",
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
    err = p.stderr.read()
    assert rc in (0, 128 + signal.SIGTERM, -signal.SIGTERM) and "under a 1500 MiB memory limit" in err
    assert not folder.exists()
    # issue 52, item 8: the model's cached pages were dropped before the server started, and it said so
    assert f"MiB of {models.default_model_path()} from the page cache, so that the limit counts" in err, err


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


# --------------------------------------------------------------------------- issue 52, item 6: one clear line

def _one_line(err: str) -> str:
    """The one line a refused command printed on stderr (asserts there is exactly one, and no raw errno)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "[Errno" not in err, err
    return lines[0]


def _paths(tmp_path: Path, model_q8: Path) -> dict[str, Path]:
    """A missing model, a folder, an empty file, a file that is not GGUF and a copy cut in half."""
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "text.gguf").write_text("not a model\n" * 10)
    (tmp_path / "dir.gguf").mkdir()
    return {"missing": Path("/nonexistent.gguf"), "folder": tmp_path / "dir.gguf", "empty": tmp_path / "empty.gguf",
            "not GGUF": tmp_path / "text.gguf",
            "truncated": _cut(model_q8, tmp_path / "half.gguf", model_q8.stat().st_size // 2)}


#: What the one line says of each bad model file (models.check_gguf).
MODEL_SAYS = {"missing": ": no such file; accepted: a GGUF file", "folder": " is a directory; accepted: a GGUF file",
              "empty": " is empty (0 bytes", "not GGUF": " is not a GGUF file", "truncated": " is truncated: the data of tensor"}


def test_load_and_size_name_a_bad_model_in_one_line(model_q8, tmp_path, capsys):
    """`pybmoe load --out o -m /nonexistent.gguf` printed a FileNotFoundError traceback, and `pybmoe size -m
    /nonexistent.gguf` or `-m DIR` the raw errno text: one line naming the path and what is wrong, exit 2,
    nothing started and no output folder made."""
    from pybmoe.cli import load
    for case, path in _paths(tmp_path, model_q8).items():
        assert load.main(["--out", str(tmp_path / "o"), "-m", str(path)]) == 2, case
        cap = capsys.readouterr()
        line = _one_line(cap.err)
        assert line.startswith(f"pybmoe load: error: {path}") and MODEL_SAYS[case] in line, line
        assert cap.out == "" and not (tmp_path / "o").exists()
        assert size.main(["-m", str(path)]) == 2, case
        cap = capsys.readouterr()
        line = _one_line(cap.err)
        assert line.startswith(f"pybmoe size: error: {path}") and MODEL_SAYS[case] in line, line
        assert cap.out == ""


@pytest.mark.parametrize("args,says", [
    (["--stream-mb", "-4"], "--stream-mb -4: accepted: a number > 0 (MiB)"),
    (["--stream-mb", "300", "--stream-mb", "0"], "--stream-mb 0: accepted: a number > 0 (MiB)"),
    (["--disk-mib-s", "-5"], "--disk-mib-s -5: accepted: a number > 0 (MiB/s)"),
    (["--disk-mib-s", "nan"], "--disk-mib-s nan: accepted: a number > 0 (MiB/s)"),
    (["--free-mb", "-1"], "--free-mb -1: accepted: a number >= 0 (MiB)"),
    (["--inserts", "-2"], "--inserts -2: accepted: an integer >= 0"),
    (["--n-gen", "0"], "--n-gen 0: accepted: an integer >= 1 (tokens)"),
    (["--resident-tok-s", "0"], "--resident-tok-s 0: accepted: a number > 0 (tok/s)"),
    (["--step-overhead-ms", "-1"], "--step-overhead-ms -1: accepted: a number >= 0 (ms)"),
    (["--stream-mb", "300"], "--stream-mb 300 needs --trace and --disk-mib-s or --probe-disk and --resident-tok-s "
                             "or --ram-mib-s"),
    (["--stream-mb", "300", "--trace", "granite", "--disk-mib-s", "900"], "--stream-mb 300 needs --resident-tok-s "
                                                                         "or --ram-mib-s"),
])
def test_size_checks_every_number_before_any_work(model_q8, args, says, capsys):
    """`pybmoe size -m M --stream-mb -4` printed the recommendation and then an error that never mentioned -4;
    `--disk-mib-s -5` was accepted. Each value is checked first: one line naming it and the range, exit 2,
    nothing printed on stdout."""
    assert size.main(["-m", str(model_q8), *args]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert _one_line(cap.err).startswith(f"pybmoe size: error: {says}"), cap.err


def test_an_output_folder_that_cannot_be_made_is_one_line(model_q8, tmp_path, capsys):
    """`pybmoe sweep --out /proc/...` printed raw errno text: the folder is made (or refused) before any run,
    in one line naming it and why."""
    from pybmoe.cli import bench_stream, sweep
    from pybmoe.cli import load as load_cli
    (tmp_path / "file").write_text("x")
    for out, why in (("/proc/pybmoe-nothing/out", "cannot create the folder"),
                     (str(tmp_path / "file"), "it is a file; accepted: a folder"),
                     (str(tmp_path / "file" / "sub"), "a part of the path is not a folder")):
        for verb, main in (("sweep", sweep.main), ("bench-stream", bench_stream.main), ("load", load_cli.main)):
            assert main(["-m", str(model_q8), "--out", out]) == 2, (verb, out)
            cap = capsys.readouterr()
            line = _one_line(cap.err)
            assert line.startswith(f"pybmoe {verb}: error: --out {out}: ") and why in line, line
            assert cap.out == ""


def test_backend_ops_names_an_unknown_backend_and_the_real_ones(capsys):
    """`pybmoe backend-ops -b NOSUCH` said `no duplicate-id case ran (is test-backend-ops from the patched
    tree?)`: test-backend-ops skipped every backend. The name is refused with the build's backends."""
    assert cli.main(["backend-ops", "-b", "NOSUCH"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("pybmoe backend-ops: error: -b NOSUCH: this build has no such backend; accepted: CPU"), line
    assert "patched tree" not in line


def test_bench_stream_refuses_a_replay_of_another_shape_first(model_q8, tmp_path, capsys):
    """`pybmoe bench-stream --route-replay granite` on a model of another shape printed 73 lines, the reason
    on line 71: the engine's checks are made first, in one line, before any run."""
    from pybmoe.cli import bench_stream
    rc = bench_stream.main(["-m", str(model_q8), "--out", str(tmp_path / "o"), "--route-replay", "granite"])
    assert rc == 2
    cap = capsys.readouterr()
    line = _one_line(cap.err)
    spec = models.read_spec(model_q8)
    assert line.startswith("pybmoe bench-stream: error: --route-replay granite: "), line
    assert "the trace is of another shape (24 layers, 32 experts, top-8)" in line
    assert f"({spec.n_layer} MoE layers, {spec.n_expert} experts, top-{spec.n_expert_used})" in line
    assert "--layers 24 --experts 32 --top-k 8" in line and cap.out == ""
    assert not list((tmp_path / "o").glob("*.csv"))


def test_the_replay_check_agrees_with_the_engine(model_q8, tmp_path):
    """The oracle: the engine refuses the granite trace on this model (llama-bench --moe-route-replay), and
    accepts a trace of the model's own shape; trace.replay_mismatch says the same of both."""
    from pybmoe.routing import granite as granite_mod
    from pybmoe.routing import trace as tr
    csv, _ = granite_mod.granite_replay_csv()
    spec = models.read_spec(model_q8)
    rng = np.random.default_rng(0)
    routing = np.array([[rng.choice(spec.n_expert, spec.n_expert_used, replace=False) for _ in range(spec.n_layer)]
                        for _ in range(8)])
    own = tr.write_trace(tr.make_trace(routing, n_expert=spec.n_expert), tmp_path / "own.csv")
    for path, refused in ((csv, True), (own, False)):
        r = subprocess.run([str(engine.find_binary("llama-bench")), "-m", str(model_q8), "-p", "0", "-n", "2", "-r", "1",
                            "--moe-route-replay", str(path)], capture_output=True, text=True, timeout=300)
        assert (r.returncode != 0) == refused, r.stderr[-2000:]
        assert (tr.replay_mismatch(tr.read_trace(path), model_q8) is not None) == refused


@pytest.mark.parametrize("case", list(MODEL_SAYS))
def test_serve_refuses_a_bad_model_in_one_line_before_llama_server(case, model_q8, tmp_path):
    """`pybmoe serve -m` with a missing, empty, non-GGUF or truncated file buried its one clear line among
    13-15 lines of upstream log: the file is checked first, and its line is the only one."""
    path = _paths(tmp_path, model_q8)[case]
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "serve", "-m", str(path), "--port", str(engine.free_port())],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2
    line = _one_line(r.stderr)
    assert line.startswith(f"pybmoe serve: error: {path}") and MODEL_SAYS[case] in line, line
    assert r.stdout == ""


def test_serve_finds_the_model_as_llama_server_parses_it():
    assert serve.model_arg(["-m", "a.gguf", "--port", "1"], env={}) == "a.gguf"
    assert serve.model_arg(["--model=a.gguf", "--model", "b.gguf"], env={}) == "b.gguf"  # the last one wins
    assert serve.model_arg(["--port", "1"], env={"LLAMA_ARG_MODEL": "c.gguf"}) == "c.gguf"
    assert serve.model_arg(["-hf", "org/repo"], env={}) is None


def test_serve_drops_the_models_cached_pages(model_q8, tmp_path):
    """Issue 52, item 8: `pybmoe serve --memory-limit-mb N` right after `make-model` wrote the model found
    its pages cached and charged to the writer's cgroup, so the limit did not count the server's reads.
    serve drops them first (posix_fadvise, no root needed); the kernel's own count (mincore) is the oracle."""
    import io
    from pybmoe.engine import memlimit
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model_q8.read_bytes())  # written just now: every page cached (and dirty)
    assert memlimit.cached_bytes(copy) == copy.stat().st_size
    err = io.StringIO()
    serve.drop_model_cache(str(copy), err=err)
    assert memlimit.cached_bytes(copy) == 0
    mib = copy.stat().st_size / 2**20
    assert err.getvalue() == (f"pybmoe serve: dropped {mib:.0f} MiB of {copy} from the page cache, so that the limit "
                              "counts the server's reads of it\n")
    err = io.StringIO()
    serve.drop_model_cache(str(tmp_path / "gone.gguf"), err=err)  # cannot: says why, in one line
    assert err.getvalue().startswith("pybmoe serve: note: the model's cached pages were not dropped (")
    assert len(err.getvalue().splitlines()) == 1
