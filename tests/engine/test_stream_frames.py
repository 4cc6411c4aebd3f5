"""The stream tier's page frames (ggml-ext/llama-moe-frames.h): an evicted expert's pages go to the next
miss instead of back to the kernel.

The oracles: the frames change no hit, no token and no logit (against the same run with
PYBMOE_MOE_STREAM_FRAMES=0, and against no tier at all); the memory they hold, read from the memfd
itself through /proc/self/fd (not from the engine's counters), stays within the budget while the misses
read many times the budget, and drops with a shrink.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.engine import bindings

SHAPE = dict(n_layer=3, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320)
MIB = 2**20
PROMPT = " ".join(f"word{i}" for i in range(60))


@pytest.fixture(scope="module")
def model():
    return models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))


def frames_bytes() -> int:
    """Bytes the memfd page frames of this process hold (``PYBMOE_MOE_STREAM_FRAMES=memfd``: allocated
    pages, not their file size)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:pybmoe-moe-frames"):
                total += os.fstat(int(fd)).st_blocks * 512
        except OSError:
            continue
    return total


def rss_anon() -> int:
    """This process's resident anonymous memory, bytes (/proc/self/status RssAnon): the moved frames'
    pages are anonymous, the memfd frames' are not (RssShmem)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("ubatch", [1, 16])
def test_page_frames_change_no_hit_and_no_logit(model, tmp_path, ubatch):
    """Decode-like steps (ubatch 1) and prefill steps with the prefetch (ubatch 16), at a budget of a
    fifth of the experts: the hits per layer, the tokens and the logits with frames (moved, the default,
    and memfd) are those without them, and the logits are those of a run without the tier."""
    args = ["-ngl", "0", "--no-repack", "-ub", str(ubatch), "-b", "256"]
    env = {k: v for k, v in os.environ.items() if k != "PYBMOE_MOE_STREAM_FRAMES"}
    base = engine.run_logits(model, tmp_path / "base.bin", args, prompt=PROMPT, n_predict=6, ctx=256, env=env)
    on = engine.run_logits(model, tmp_path / "on.bin", [*args, "--moe-stream-cache-mb", "10"], prompt=PROMPT,
                           n_predict=6, ctx=256, env=env)
    off = engine.run_logits(model, tmp_path / "off.bin", [*args, "--moe-stream-cache-mb", "10"], prompt=PROMPT,
                            n_predict=6, ctx=256, env={**env, "PYBMOE_MOE_STREAM_FRAMES": "0"})
    mfd = engine.run_logits(model, tmp_path / "memfd.bin", [*args, "--moe-stream-cache-mb", "10"], prompt=PROMPT,
                            n_predict=6, ctx=256, env={**env, "PYBMOE_MOE_STREAM_FRAMES": "memfd"})
    assert "go to a later miss (moved)" in on.log and "page frames off (PYBMOE_MOE_STREAM_FRAMES=0)" in off.log
    assert "go to a later miss (memfd, PYBMOE_MOE_STREAM_FRAMES=memfd)" in mfd.log
    assert sum(m for _, m in on.stream_layers.values()) > 20  # many misses: the frames were handed on
    assert on.stream_layers == off.stream_layers == mfd.stream_layers
    assert on.tokens == off.tokens == mfd.tokens == base.tokens
    assert on.logits == off.logits == mfd.logits == base.logits


def test_page_frames_hold_at_most_the_budget_and_drop_with_a_shrink(model, monkeypatch):
    """At 4 MiB (8 experts of 0.50 MiB; ubatch 1, so no prefetch window) the misses read several times
    the budget, while the frames hold at most the budget; a shrink to 2 MiB gives the rest back. Both
    ways of placing a frame's pages: memfd (its pages read from the memfd itself), then moved (the
    default: anonymous pages, read from the process's anonymous memory: the shrink to 2 MiB drops it by
    2 MiB, and reading 200x the new budget again grows it by less than 4 MiB)."""
    kw = dict(moe_stream_cache_mb=4, n_gpu_layers=0, n_ubatch=1, n_batch=512, verbose=False, seed=0)
    monkeypatch.setenv("PYBMOE_MOE_STREAM_FRAMES", "memfd")
    llm = bindings.Llama(model, **kw)
    llm(PROMPT, max_tokens=8, temperature=0)
    st = llm.moe_stream_stats()
    held = frames_bytes()
    assert st.read_mib > 4 * 4 and 0 < held <= 4 * MIB, (st, held)
    assert llm.set_moe_stream_budget_mb(2) == 2
    assert frames_bytes() <= 2 * MIB < held
    llm.reset()
    llm(PROMPT, max_tokens=4, temperature=0)
    assert 0 < frames_bytes() <= 2 * MIB
    llm.close()

    monkeypatch.delenv("PYBMOE_MOE_STREAM_FRAMES")
    llm = bindings.Llama(model, **kw)
    llm(PROMPT, max_tokens=8, temperature=0)  # the frames fill the budget; the compute buffers are touched
    a1, read1 = rss_anon(), llm.moe_stream_stats().read_mib
    assert read1 > 4 * 4 and frames_bytes() == 0
    assert llm.set_moe_stream_budget_mb(2) == 2
    a2 = rss_anon()
    assert 1.5 * MIB < a1 - a2 <= 2.5 * MIB, (a1 - a2) / MIB  # the shrink gave 2 MiB of frames back
    llm.reset()
    llm(PROMPT, max_tokens=8, temperature=0)
    read2 = llm.moe_stream_stats().read_mib - read1
    # reading 200 times the budget again grows the anonymous memory by no more than the generation's own
    # Python-side arrays (under 2 MiB here): the frames keep no page they read
    assert read2 > 100 and rss_anon() - a2 <= 4 * MIB, (read2, (rss_anon() - a2) / MIB)


def test_moved_frames_hand_their_pages_on_without_faults(model, monkeypatch):
    """The moved frames (the default) give a miss an evicted expert's pages, already there: a run that reads
    many times its budget faults in a small part of the pages it reads, where without frames every page read
    is faulted in and zeroed first. Minor faults of this process (getrusage) during a generation after a
    first one (which touches the buffers, the frames and the experts' end pages)."""
    import resource

    def faults_per_page_read(frames: str | None) -> float:
        if frames is None:
            monkeypatch.delenv("PYBMOE_MOE_STREAM_FRAMES", raising=False)
        else:
            monkeypatch.setenv("PYBMOE_MOE_STREAM_FRAMES", frames)
        llm = bindings.Llama(model, moe_stream_cache_mb=4, n_gpu_layers=0, n_ubatch=1, n_batch=512, verbose=False, seed=0)
        llm(PROMPT, max_tokens=2, temperature=0)  # first touches: buffers, frames, every expert's end pages
        llm.reset()
        f0, r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, llm.moe_stream_stats().read_mib
        llm(PROMPT, max_tokens=8, temperature=0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        read = llm.moe_stream_stats().read_mib - r0
        llm.close()
        assert read > 100, read
        return faults / (read * MIB / 4096)

    moved, off = faults_per_page_read(None), faults_per_page_read("0")
    assert off > 0.5 and moved < 0.05, (moved, off)


def test_moved_frames_leave_no_hole_in_the_park_or_an_experts_range(tmp_path):
    """A frame moved out of the park, or back, leaves its source mapped (MREMAP_DONTUNMAP): at no point is
    a page of the park or of the experts' reservation unmapped, where any other mapping of the process
    (a malloc of 128 KiB or more, a thread stack) could land and a later move or munmap would destroy it:
    the segmentation fault docs/stream-tier.md tells of. And the pages move, not copied or zeroed.
    tests/engine/frames_holes.cpp, built here against ggml-ext/llama-moe-frames.cpp, asks the kernel for
    every page with mmap(MAP_FIXED_NOREPLACE) after each step."""
    repo = Path(__file__).resolve().parents[2]
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "frames_holes"
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(repo / "ggml-ext"), "-o", str(exe),
                    str(repo / "tests" / "engine" / "frames_holes.cpp"), str(repo / "ggml-ext" / "llama-moe-frames.cpp")],
                   check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    if out.returncode == 3:
        pytest.skip(f"this kernel gives no moved frames (Linux < 5.7: memfd frames instead): {out.stdout.strip()}")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok", out.stdout + out.stderr
    assert out.stdout.count("holes 0") == 4, out.stdout
