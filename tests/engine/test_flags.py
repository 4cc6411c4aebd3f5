"""Bad cache flag values stop every tool early with a message naming the flag and the value."""
from __future__ import annotations

import os
import subprocess

import pytest

from pybmoe import engine


def _run(binary: str, args: list[str], env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(engine.find_binary(binary)), *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})), stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("binary", ["llama-server", "llama-cli", "llama-bench"])
@pytest.mark.parametrize("flag", ["--moe-expert-cache", "--moe-expert-cache-inserts", "--moe-expert-cache-max-batch"])
@pytest.mark.parametrize("value", ["-1", "abc", "4x", "1.5", "2147483648", "99999999999999999999"])
def test_bad_value_is_refused(binary, flag, value, model_q8):
    r = _run(binary, ["-m", str(model_q8), flag, value])
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert flag in out and f"'{value}'" in out, out[-2000:]
    assert "expects an integer in 0 .. 2147483647" in out  # the real range, also for 10 digits and more


@pytest.mark.parametrize("binary", ["llama-server", "llama-bench"])
def test_bad_env_twin_is_refused(binary, model_q8):
    r = _run(binary, ["-m", str(model_q8)], env={"LLAMA_ARG_MOE_EXPERT_CACHE": "-3"})
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "LLAMA_ARG_MOE_EXPERT_CACHE" in out and "'-3'" in out, out[-2000:]


@pytest.mark.parametrize("binary", ["llama-server", "llama-cli", "llama-bench"])
def test_flags_are_documented(binary):
    r = _run(binary, ["--help"])
    assert "--moe-expert-cache" in r.stdout + r.stderr
    assert "--moe-expert-cache-inserts" in r.stdout + r.stderr
    assert "--moe-route-replay" in r.stdout + r.stderr
    assert "--moe-expert-cache-max-batch" in r.stdout + r.stderr


def test_llama_bench_refuses_a_max_batch_out_of_range(model_q8):
    r = _run("llama-bench", ["-m", str(model_q8), "-p", "0", "-n", "1", "-r", "1",
                             "--moe-expert-cache", "4", "--moe-expert-cache-max-batch", "5000"])
    assert r.returncode != 0
    assert "--moe-expert-cache-max-batch 5000 is out of range (1 .. 4096)" in r.stdout + r.stderr


def test_python_side_validates():
    with pytest.raises(ValueError, match="slots"):
        engine.cache_args(-1)
    with pytest.raises(ValueError, match="inserts"):
        engine.cache_args(4, "2")


@pytest.mark.parametrize("binary", ["llama-server", "llama-cli"])
@pytest.mark.parametrize("value", ["sometimes", "second-miss:0", "second-miss:x", "second-miss:1025"])
def test_bad_admission_is_refused(binary, value, model_q8):
    r = _run(binary, ["-m", str(model_q8), "--moe-expert-cache-admit", value])
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "--moe-expert-cache-admit" in out and value.split(":")[-1] in out, out[-2000:]


def test_admission_parses_like_the_engine():
    assert engine.flags.parse_admit("always") == 0
    assert engine.flags.parse_admit("second-miss") == 4
    assert engine.flags.parse_admit("second-miss:16") == 16
    for bad in ("second-miss:0", "second-miss:1025", "second-miss:-1", "Always", "", None):
        with pytest.raises(ValueError, match="expected 'always', 'second-miss' or 'second-miss:W'"):
            engine.flags.parse_admit(bad)
    assert engine.cache_args(4, admit="second-miss") == ["--moe-expert-cache", "4", "--moe-expert-cache-inserts", "0",
                                                        "--moe-expert-cache-admit", "second-miss:4"]
