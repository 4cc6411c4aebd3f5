"""``llama-server`` under a real memory limit (issue 40): a cgroup made by ``pybmoe serve
--memory-limit-mb`` (root; skipped elsewhere, with the reason).

- a default context that would take the experts' room is shrunk before it is allocated, and the
  server answers, with the tokens of an unlimited server at the same context;
- a server the kernel's OOM killer takes is named in one line by ``pybmoe serve``;
- a model file that shrinks under a running server stops it with the file and the offset named
  (its mapped pages: SIGBUS), not a silent exit 135.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.bench import load
from pybmoe.cli import serve
from pybmoe.engine import memlimit

ROOT = Path(__file__).resolve().parents[2]

# 2 layers, 16 experts (top-3), a 65536-token trained context of 4 KiB a token: the default context's KV
# cache (256 MiB) is larger than the room a 300 MiB limit leaves beside the dense weights and the floor
SPEC = models.ModelSpec(arch="qwen3moe", n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320,
                        n_head=8, n_head_kv=4, head_dim=128, n_ctx_train=65536)


def needs_cgroup() -> None:
    ok, why = memlimit.limit_available()
    if not ok:
        pytest.skip(why)


def start_serve(args: list[str], port: int, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "pybmoe.cli", "serve", *args, "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_healthy(p: subprocess.Popen, port: int, log: Path, timeout_s: float = 120) -> None:
    t0 = time.monotonic()
    while not engine.wait_for_endpoint(f"127.0.0.1:{port}", 1):
        assert p.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() - t0 < timeout_s, log.read_text(errors="replace")[-3000:]
    # the port opens before the model is loaded: /health answers 200 once it is
    req = load.Request("health", "completion", False, (1000, 1001), 1)
    while True:
        try:
            load.send(f"http://127.0.0.1:{port}", req, timeout_s=5)
            return
        except load.LoadError:
            assert p.poll() is None and time.monotonic() - t0 < timeout_s, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)


def test_the_server_fits_a_default_context_under_a_real_limit_and_answers(tmp_path):
    needs_cgroup()
    model = models.cached_model_path(SPEC)
    port, log = engine.free_port(), tmp_path / "limited.log"
    p = start_serve(["--memory-limit-mb", "300", "-m", str(model), "--moe-stream-cache-mb", "auto", "-t", "2"], port, log)
    req = load.Request("p", "completion", True, tuple(range(2000, 2040)), 12)
    try:
        wait_healthy(p, port, log)
        got = load.send(f"http://127.0.0.1:{port}", req, timeout_s=300)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    text = log.read_text(errors="replace")
    fit = [ln for ln in text.splitlines() if "-> fit:" in ln]
    assert len(fit) == 1 and "the default context (65536 tokens, 4 slots sharing them)" in fit[0], text[-3000:]
    # elastic: the context keeps its full size where that fits beside the tier's minimum, else shrinks so far
    shrunk = re.search(r"shrunk to (\d+) tokens", fit[0])
    n = int(shrunk.group(1)) if shrunk else 65536
    assert (": kept" in fit[0]) != bool(shrunk), fit[0]
    assert 4096 <= n <= 65536 and f"n_ctx_slot = {n}" in text
    assert "killed" not in text
    # the same request on an unlimited server with that context, the tier off: the same tokens
    with engine.LlamaServer(["-m", str(model), "-c", str(n), "-t", "2"], log_dir=tmp_path) as ref_srv:
        ref = load.send(ref_srv.url, req, timeout_s=300)
    assert got.text == ref.text and got.predicted_n == ref.predicted_n == 12


def test_an_oom_kill_of_the_server_is_named_in_one_line(tmp_path):
    """``--load-mode none`` reads the 59 MiB model into anonymous memory, which a 40 MiB limit cannot hold."""
    needs_cgroup()
    port, log = engine.free_port(), tmp_path / "oom.log"
    p = start_serve(["--memory-limit-mb", "40", "-m", str(models.default_model_path()), "--load-mode", "none", "-ngl", "0"], port, log)
    rc = p.wait(timeout=120)
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "OOM killer" in ln]
    assert rc == 128 + signal.SIGKILL and len(lines) == 1, text[-3000:]
    assert lines[0].startswith("pybmoe serve: error: llama-server was killed by the kernel's OOM killer under the 40 MiB")
    assert "--moe-stream-cache-mb auto" in lines[0] and "-c or -np" in lines[0]


def test_the_oom_line_is_for_oom_kills_only():
    assert serve.oom_line(-9, 1, 700, 699.5).startswith("pybmoe serve: error: llama-server was killed")
    assert "peak use 700 MiB" in serve.oom_line(137, 2, 700, 699.5)
    assert serve.oom_line(-9, 0, 700) is None    # a SIGKILL from elsewhere
    assert serve.oom_line(0, 1, 700) is None     # an earlier kill, then a clean exit
    assert serve.oom_line(-9, None, 700) is None  # a kernel that does not count them


def test_the_exit_line_names_a_model_file_that_changed():
    for rc in (74, -signal.SIGBUS, 128 + signal.SIGBUS):
        line = serve.exit_line(rc)
        assert line.startswith("pybmoe serve: error: llama-server stopped: a model file changed on disk under it"), rc
    assert "status 74" in serve.exit_line(74) and "SIGBUS" in serve.exit_line(-signal.SIGBUS)
    for rc in (0, 1, 2, -9, 137, 134):
        assert serve.exit_line(rc) is None, rc


def test_a_model_file_cut_under_the_tier_stops_the_server_in_one_line(tmp_path):
    """The tier reads the experts with pread, the dense weights are in anonymous memory (``--dense-weights
    anon``) and the budget is the least (3 MiB), so the next request misses experts past the file's new end: a short
    read. The server stops with one line naming the file and the offset, status 74, no backtrace."""
    model = tmp_path / "copy.gguf"
    shutil.copyfile(models.default_model_path(), model)
    args = ["-m", str(model), "-t", "2", "--moe-stream-cache-mb", "3", "--dense-weights", "anon"]
    with engine.LlamaServer(args, log_dir=tmp_path) as srv:
        load.send(srv.url, load.Request("p", "completion", False, tuple(range(2000, 2010)), 4), timeout_s=120)
        size = model.stat().st_size
        os.truncate(model, size // 3)
        with pytest.raises(load.LoadError):
            load.send(srv.url, load.Request("q", "completion", False, tuple(range(5000, 5064)), 8), timeout_s=120)
        rc = srv.proc.wait(timeout=60)
    text = srv.log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "llama_moe_read: error:" in ln]
    assert rc == serve.EXIT_READ == 74 and len(lines) == 1, (rc, text[-3000:])
    m = re.search(r"short read: (\d+) of (\d+) bytes at offset (\d+) of (\S+) ", lines[0])
    assert m and m.group(4) == str(model) and int(m.group(1)) < int(m.group(2)), lines[0]
    assert int(m.group(3)) + int(m.group(1)) >= size // 3
    assert "status 74" in lines[0]
    assert "gdb" not in text and "backtrace" not in text.lower() and "GGML_ABORT" not in text


def test_a_model_file_that_shrinks_under_the_server_is_named(tmp_path):
    """The weights stay memory-mapped (no tier: stock mmap, every tensor read through the map): after the
    file is cut to a third, the next request reads a page past its end. The server stops with one line that
    names the file and the offset (SIGBUS, status 135 kept), and no debugger backtrace."""
    model = tmp_path / "copy.gguf"
    shutil.copyfile(models.default_model_path(), model)
    with engine.LlamaServer(["-m", str(model), "-t", "2", "--no-repack"], log_dir=tmp_path) as srv:
        req = load.Request("p", "completion", False, tuple(range(2000, 2010)), 4)
        load.send(srv.url, req, timeout_s=120)
        size = model.stat().st_size
        os.truncate(model, size // 3)
        with pytest.raises(load.LoadError):
            load.send(srv.url, req, timeout_s=120)
        rc = srv.proc.wait(timeout=60)
    text = srv.log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "llama_moe_sigbus" in ln]
    assert rc == -signal.SIGBUS and len(lines) == 1, (rc, text[-3000:])
    m = re.search(r"the model file (\S+) changed while it was mapped: reading its byte at offset (\d+) faulted "
                  r"\(SIGBUS\), the file is (\d+) bytes long now", lines[0])
    assert m and m.group(1) == str(model) and int(m.group(3)) == size // 3, lines[0]
    assert size // 3 <= int(m.group(2)) < size
    assert "gdb" not in text and "backtrace" not in text.lower()
