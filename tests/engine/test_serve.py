"""The user-facing pieces: `pybmoe serve` as a drop-in server, the demo, the bindings."""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pybmoe import engine
from pybmoe.engine import demo


def test_serve_answers_openai_chat_with_the_cache(model_q8, rpc, tmp_path):
    openai = pytest.importorskip("openai")
    port = engine.free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "pybmoe.cli", "serve", "-m", str(model_q8), "--host", "127.0.0.1",
           "--port", str(port), *engine.host_experts_args(rpc.endpoint), "--moe-expert-cache", "8",
           "-c", "1024", "-np", "1", "-t", "2"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() - t0 < 120, "server did not become healthy"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.chat.completions.create(
            model="pybmoe", temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "Name three colours."}])
        assert r.choices[0].message.content
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens > 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    text = log.read_text(errors="replace")
    assert "moe-cache: 4 of 4 MoE layers cached" in text
    sums = engine.parse_cache_summaries(text)
    assert sums and sums[-1].hit_pct > 0


def test_demo_reports_identical_output(model_q8):
    lines = []
    off, on = demo.run_demo(model_q8, slots=8, inserts=2, n_predict=32, out=lines.append)
    assert off.text == on.text
    assert any("IDENTICAL" in l for l in lines)
    assert on.summary is not None and on.summary.hit_pct > 0 and on.summary.uploads > 0


def test_bindings_load_the_patched_library():
    llama_cpp = pytest.importorskip("llama_cpp")
    from llama_cpp import llama_cpp as lib
    # the symbol exists only in the patched libllama
    fn = getattr(lib._lib, "llama_model_moe_cache_init")
    assert isinstance(fn, ctypes._CFuncPtr)
    # and it is the same library the binaries use
    ldd = subprocess.run(["ldd", str(engine.find_binary("llama-server"))], capture_output=True, text=True).stdout
    server_lib = next(line.split("=>")[1].split("(")[0].strip() for line in ldd.splitlines()
                      if line.strip().startswith("libllama.so"))
    assert Path(server_lib).resolve() == Path(lib._lib._name).resolve()


@pytest.mark.parametrize("name", engine.BINARIES)
def test_binaries_resolve_all_libraries(name):
    ldd = subprocess.run(["ldd", str(engine.find_binary(name))], capture_output=True, text=True).stdout
    assert "not found" not in ldd, ldd


def test_installed_package_makes_models_without_a_checkout(tmp_path):
    """A new user's first `pybmoe demo`: an empty model cache, run outside any checkout."""
    import os
    env = dict(os.environ, PYBMOE_CACHE=str(tmp_path / "cache"))
    env.pop("PYBMOE_ROOT", None)
    env.pop("PYTHONPATH", None)
    where = subprocess.run([sys.executable, "-c", "import pybmoe, sys; print(pybmoe.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, env=env)
    if "site-packages" not in where.stdout:
        pytest.skip(f"pybmoe is not installed in this environment ({where.stdout.strip()})")
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "make-model", str(tmp_path / "m.gguf"), "--ftype", "Q4_K"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-c", "from pybmoe import models; print(models.default_vocab_path())"],
                       cwd=tmp_path, capture_output=True, text=True, env=env)
    assert "site-packages" in r.stdout and r.stdout.strip().endswith("pybmoe/data/ggml-vocab-qwen2.gguf")


def test_demo_rejects_bad_values_before_starting_anything(model_q8):
    with pytest.raises(ValueError, match="slots"):
        demo.run_demo(model_q8, slots=-3, out=lambda *_: pytest.fail("started"))


def test_the_readme_server_command_without_a_device_names_the_cause(model_q8):
    """README, "Using the cache": `llama-server -m model.gguf -ngl 99 --cpu-moe --moe-expert-cache N` on a
    machine without a GPU runs with the cache off. The WARN must name the cause (no device to hold the
    slots) and the way out (--rpc, or a GPU build), not the flags the user already gave."""
    bindings = pytest.importorskip("pybmoe.engine.bindings")
    if any(d.type in (bindings.GGML_BACKEND_DEVICE_TYPE_GPU, bindings.GGML_BACKEND_DEVICE_TYPE_IGPU)
           and d.backend != "RPC" for d in bindings.registry_devices()):
        pytest.skip("this build has a local device")
    srv = engine.LlamaServer(["-m", str(model_q8), "-ngl", "99", "--cpu-moe", "--moe-expert-cache", "8", "-c", "256",
                              "-np", "1", "-t", "2", "--no-warmup"])
    with srv:
        pass
    warns = [ln for ln in srv.stop().splitlines() if "moe-cache: WARNING" in ln]
    assert warns and any("no device" in w and "--rpc" in w for w in warns), "\n".join(warns)
    assert not any("offload layers with -ngl" in w or "keep it on the device" in w for w in warns), "\n".join(warns)
