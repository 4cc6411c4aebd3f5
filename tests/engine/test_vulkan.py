"""The cache on a Vulkan device: lavapipe (Mesa's CPU Vulkan driver) stands in for a GPU.

Needs a Vulkan build of the engine (`.ci/run` makes one; see docs/backends.md): the binaries in
``$PYBMOE_VULKAN_BIN_DIR``, else ``build/vulkan/bin``. Skipped when there is none.

- duplicate expert ids: every `MUL_MAT_ID` dup case of patch 0010 passes on Vulkan0 (patch 0013);
- end to end: the device chain runs on Vulkan and the host chain on the CPU, so the kernels differ
  and logits are close, not bit-identical: greedy tokens equal to the cache off, logits NMSE
  <= 5e-4 (measured 7.4e-5, docs/backends.md), with top-k fusion on and off
  (`GGML_VK_DISABLE_FUSION`), and prompt ubatches served through the cache; on qwen3moe, gemma4
  and gpt-oss.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pybmoe import engine, models
from pybmoe.engine import backend_ops

ROOT = Path(__file__).resolve().parents[2]
VK_BIN = Path(os.environ.get("PYBMOE_VULKAN_BIN_DIR") or ROOT / "build" / "vulkan" / "bin")
# lavapipe is a CPU-type device, which ggml-vulkan skips unless it is named
ENV = {**os.environ, "GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}

pytestmark = pytest.mark.skipif(not (VK_BIN / "pybmoe-logits").is_file() or not (VK_BIN / "test-backend-ops").is_file(),
                                reason=f"no Vulkan build in {VK_BIN} (.ci/run builds one; docs/backends.md)")

PROMPT = ("The expert cache keeps the experts that were used most recently on the device, and the "
          "host computes the rest; a verify batch checks several drafted tokens at once.")
N_PREDICT = 16


def test_duplicate_expert_ids_pass_on_vulkan():
    """Every dup-id case passes. lavapipe's process sometimes dies mid-run (heap corruption: SIGSEGV
    or a malloc abort, also without patch 0013: 1 run in 4 on the stock dispatch, 3 in 4 with it on
    2026-12-01; docs/backends.md), so up to 5 runs are made and their completed cases pooled: a case
    that FAILs anywhere fails the test, and every case must have passed in some run."""
    seen: dict[tuple[str, int, str], str] = {}
    outputs = []
    for _ in range(5):
        r = subprocess.run([str(VK_BIN / "test-backend-ops"), "-b", "Vulkan0", "-o", "MUL_MAT_ID", "-p", "dup="],
                           capture_output=True, text=True, timeout=1200, env=ENV)
        outputs.append(f"rc={r.returncode}")
        for x in backend_ops.parse(r.stdout + r.stderr):
            if x.backend == "Vulkan0":
                key = (x.type_a, x.n, x.dup)
                seen[key] = "FAIL" if "FAIL" in (seen.get(key), x.result) else x.result
        if r.returncode == 0 or len(seen) == 96:
            break
    assert not [k for k, v in seen.items() if v != "OK"], seen
    assert len(seen) == 96, f"{len(seen)} of 96 cases completed in {len(outputs)} runs: {outputs}"


def _run(model: Path, slots: int, fusion: bool, tmp: Path) -> tuple[list[int], np.ndarray, str]:
    out = tmp / f"vk-{slots}-{int(fusion)}.bin"
    env = dict(ENV)
    if not fusion:
        env["GGML_VK_DISABLE_FUSION"] = "1"
    else:
        env.pop("GGML_VK_DISABLE_FUSION", None)
    run = engine.run_logits(model, out, ["-ub", "16", "-ngl", "99", "--cpu-moe", "--no-repack", "--moe-expert-cache",
                                         str(slots), "--moe-expert-cache-max-batch", "32"],
                            prompt=PROMPT, n_predict=N_PREDICT, ctx=512, timeout=900, bin_dir=VK_BIN, env=env)
    return run.tokens, np.frombuffer(run.logits, dtype=np.float32), run.log


def _nmse(ref: np.ndarray, x: np.ndarray) -> float:
    """Normalised mean squared error of ``x`` against ``ref`` (float32 logits)."""
    return float(((ref - x) ** 2).sum() / (ref ** 2).sum())


@pytest.fixture(scope="module")
def f16_model() -> Path:
    return models.default_model_path("F16")


@pytest.mark.parametrize("fusion", [True, False], ids=["fusion", "no-fusion"])
def test_cache_on_vulkan_matches_cache_off(f16_model, tmp_path, fusion):
    tok_off, off, _ = _run(f16_model, 0, fusion, tmp_path)
    tok_on, on, log = _run(f16_model, 8, fusion, tmp_path)
    assert "Vulkan0" in log and "moe-cache-preamble" in log
    # the cap: cached ubatches of at most 16 tokens on Vulkan, said at WARN
    assert "the cache serves ubatches of at most 16 tokens on Vulkan (asked: 32" in log
    assert "max_batch=16" in log
    assert tok_on == tok_off and len(tok_on) == N_PREDICT
    assert off.shape == on.shape
    nmse = _nmse(off, on)
    assert nmse <= 5e-4, nmse
    hits = [int(l.split()[2]) for l in log.splitlines() if l.startswith("moe-cache-layer")]
    assert sum(hits) > 0
    steps = engine.parse_cache_summaries(log)[-1].steps
    assert steps > N_PREDICT - 1  # prompt ubatches of 16 tokens went through the cache too


def test_fusion_does_not_change_the_cached_output(f16_model, tmp_path):
    tok_a, _, _ = _run(f16_model, 8, True, tmp_path)
    tok_b, _, _ = _run(f16_model, 8, False, tmp_path)
    assert tok_a == tok_b


@pytest.mark.parametrize("arch", ["gemma4", "gpt-oss"])
@pytest.mark.parametrize("fusion", [True, False], ids=["fusion", "no-fusion"])
def test_variants_on_vulkan(arch, fusion, tmp_path):
    """The cloned device chain on Vulkan: gemma4 (fused gate_up views, GEGLU, down scale) and gpt-oss
    (add_id biases from the cache's copies, swiglu_oai). Measured: tokens equal, NMSE 5e-6 to 9e-6."""
    model = models.cached_model_path(models.ModelSpec(arch=arch, n_layer=2, n_expert=8, n_expert_used=3, ftype="F16"))
    tok_off, off, _ = _run(model, 0, fusion, tmp_path)
    tok_on, on, log = _run(model, 4, fusion, tmp_path)
    assert "not cached" not in log and "cannot split" not in log
    assert tok_on == tok_off
    nmse = _nmse(off, on)
    assert nmse <= 5e-4, nmse
    assert sum(int(l.split()[2]) for l in log.splitlines() if l.startswith("moe-cache-layer")) > 0


def _pinned_run(model: Path, slots: int, extra: list[str], tmp: Path) -> engine.LogitsRun:
    return engine.run_logits(model, tmp / f"pinned-{slots}-{len(extra)}.bin",
                             ["-v", "-ngl", "99", "--cpu-moe", "--no-repack", "--load-mode", "none",
                              "--moe-expert-cache", str(slots), *extra],
                             prompt=PROMPT, n_predict=8, ctx=512, timeout=900, bin_dir=VK_BIN, env=ENV)


PINNED_WARN = "are in buffer type Vulkan_Host, the pinned host memory of Vulkan0"


def test_experts_in_the_devices_pinned_host_buffer_warn(f16_model, tmp_path):
    """Without mmap, llama.cpp's CPU buffer list puts --cpu-moe experts in the first GPU's pinned host
    buffer (Vulkan_Host here, CUDA_Host on CUDA), not a CPU buffer: one WARN names the buffer type and
    the layers, the cache still serves them (tokens equal to the cache off, logits close), and
    --no-host keeps them in a CPU buffer without the WARN."""
    spec = models.read_spec(f16_model)
    off = _pinned_run(f16_model, 0, [], tmp_path)
    assert "Vulkan_Host model buffer size" in off.log  # where llama.cpp really put the experts
    on = _pinned_run(f16_model, 8, [], tmp_path)
    lines = [l for l in on.log.splitlines() if PINNED_WARN in l]
    layers = ",".join(str(i) for i in range(spec.n_layer))
    assert len(lines) == 1 and f"{spec.n_layer} MoE layer(s) ({layers})" in lines[0], lines
    assert "--no-host keeps them in a CPU buffer" in lines[0]
    assert "not cached" not in on.log and "moe-cache-preamble" in on.log
    assert on.tokens == off.tokens
    nmse = _nmse(np.frombuffer(off.logits, dtype=np.float32), np.frombuffer(on.logits, dtype=np.float32))
    assert nmse <= 5e-4, nmse
    assert sum(h for h, _ in on.layers.values()) > 0

    nohost = _pinned_run(f16_model, 8, ["--no-host"], tmp_path)
    assert "Vulkan_Host model buffer size" not in nohost.log
    assert PINNED_WARN not in nohost.log and "moe-cache-preamble" in nohost.log
