"""The stream tier's page frames (ggml-ext/llama-moe-frames.h): an evicted expert's pages go to the next
miss instead of back to the kernel.

The oracles: the frames change no hit, no token and no logit (against the same run with
PYBMOE_MOE_STREAM_FRAMES=0, and against no tier at all); the memory they hold, read from the memfd
itself through /proc/self/fd (not from the engine's counters), stays within the budget while the misses
read many times the budget, and drops with a shrink.
"""
from __future__ import annotations

import os

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
    """Bytes the page-frame memfds of this process hold (allocated pages, not their file size)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:pybmoe-moe-frames"):
                total += os.fstat(int(fd)).st_blocks * 512
        except OSError:
            continue
    return total


@pytest.mark.parametrize("ubatch", [1, 16])
def test_page_frames_change_no_hit_and_no_logit(model, tmp_path, ubatch):
    """Decode-like steps (ubatch 1) and prefill steps with the prefetch (ubatch 16), at a budget of a
    fifth of the experts: the hits per layer, the tokens and the logits with frames are those without
    them, and the logits are those of a run without the tier."""
    args = ["-ngl", "0", "--no-repack", "-ub", str(ubatch), "-b", "256"]
    env = {k: v for k, v in os.environ.items() if k != "PYBMOE_MOE_STREAM_FRAMES"}
    base = engine.run_logits(model, tmp_path / "base.bin", args, prompt=PROMPT, n_predict=6, ctx=256, env=env)
    on = engine.run_logits(model, tmp_path / "on.bin", [*args, "--moe-stream-cache-mb", "10"], prompt=PROMPT,
                           n_predict=6, ctx=256, env=env)
    off = engine.run_logits(model, tmp_path / "off.bin", [*args, "--moe-stream-cache-mb", "10"], prompt=PROMPT,
                            n_predict=6, ctx=256, env={**env, "PYBMOE_MOE_STREAM_FRAMES": "0"})
    assert "moe-stream: page frames: " in on.log and "page frames off (PYBMOE_MOE_STREAM_FRAMES=0)" in off.log
    assert sum(m for _, m in on.stream_layers.values()) > 20  # many misses: the frames were handed on
    assert on.stream_layers == off.stream_layers
    assert on.tokens == off.tokens == base.tokens and on.logits == off.logits == base.logits


def test_page_frames_hold_at_most_the_budget_and_drop_with_a_shrink(model):
    """At 4 MiB (8 experts of 0.50 MiB; ubatch 1, so no prefetch window) the misses read several times
    the budget, while the frames hold at most the budget; a shrink to 2 MiB gives the rest back."""
    llm = bindings.Llama(model, moe_stream_cache_mb=4, n_gpu_layers=0, n_ubatch=1, n_batch=512, verbose=False, seed=0)
    llm(PROMPT, max_tokens=8, temperature=0)
    st = llm.moe_stream_stats()
    held = frames_bytes()
    assert st.read_mib > 4 * 4 and 0 < held <= 4 * MIB, (st, held)
    assert llm.set_moe_stream_budget_mb(2) == 2
    assert frames_bytes() <= 2 * MIB < held
    llm.reset()
    llm(PROMPT, max_tokens=4, temperature=0)
    assert 0 < frames_bytes() <= 2 * MIB
