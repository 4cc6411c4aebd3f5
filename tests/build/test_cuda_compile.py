"""CUDA compile check: every CUDA translation unit the patch series touches compiles with nvcc for
sm_90 (no CUDA code runs here). The series touches none today; the check keeps that list honest
and compiles whatever a later patch adds."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def touched_cuda_files() -> list[str]:
    """Paths (relative to the llama.cpp tree) of .cu/.cuh files any patch in patches/series changes."""
    series = (ROOT / "patches" / "series").read_text().split()
    out: set[str] = set()
    for name in series:
        for m in re.finditer(r"^diff --git a/vendor/llama\.cpp/(\S+\.cuh?) ", (ROOT / "patches" / name).read_text(), re.M):
            out.add(m.group(1))
    return sorted(out)


def test_the_series_touches_no_cuda_source_today():
    # the duplicate-id cases (patch 0010) are how CUDA is checked; if a patch changes ggml-cuda,
    # the next test compiles it, and this list must be updated on purpose
    assert touched_cuda_files() == []


@pytest.mark.parametrize("path", touched_cuda_files() or [pytest.param(None, marks=pytest.mark.skip(
    reason="the series touches no CUDA translation unit"))])
def test_touched_cuda_units_compile_for_sm90(path, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    from pybmoe.build import vendor
    tree = vendor.llama_cpp_dir()
    if path.endswith(".cuh"):
        src = tmp_path / "unit.cu"
        src.write_text(f'#include "{tree / path}"\n')
    else:
        src = tree / path
    cmd = [nvcc, "-std=c++17", "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "unit.o"),
           "-I", str(tree / "ggml/include"), "-I", str(tree / "ggml/src"), "-I", str(tree / "ggml/src/ggml-cuda"),
           "-DGGML_USE_CUDA", "-DGGML_CUDA_NO_FA"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
