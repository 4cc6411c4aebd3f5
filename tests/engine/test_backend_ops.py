"""Duplicate expert ids: test-backend-ops' dup cases through `pybmoe backend-ops`, and the parser."""
from __future__ import annotations

import subprocess
import sys

from pybmoe.engine import backend_ops


def test_dup_cases_pass_on_every_backend_of_the_build():
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "backend-ops"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "backend CPU" in r.stdout
    for t in ("f16", "bf16", "q8_0", "q4_0", "q4_K", "q6_K"):
        row = next(l for l in r.stdout.splitlines() if l.split()[:1] == [t])
        assert row.split()[1:3] == ["16", "0"], row  # 8 token counts x 2 modes, none failed
    assert "96 passed, 0 failed" in r.stdout


def test_a_failure_is_reported_and_fails_the_run():
    out = ("Backend 1/2: CUDA0\n"
           "[MUL_MAT_ID] ERR = 0.037664017 > 0.000500000   "  # a failed case, as test-backend-ops prints it
           "MUL_MAT_ID(type_a=q4_K,type_b=f32,n_mats=16,n_used=8,b=0,m=128,n=7,k=256,amax=1.000000,m_v=0,dup=pair): "
           "\x1b[1;31mFAIL\x1b[0m\n"
           "  MUL_MAT_ID(type_a=q4_K,type_b=f32,n_mats=16,n_used=8,b=0,m=128,n=8,k=256,amax=1.000000,m_v=0,dup=pair): "
           "\x1b[1;32mOK\x1b[0m\n"
           "  MUL_MAT_ID(type_a=f16,type_b=f32,n_mats=4,n_used=4,b=0,m=512,n=1,k=256,amax=1.000000,m_v=0): OK\n")
    res = backend_ops.parse(out)
    assert [(r.backend, r.type_a, r.n, r.dup, r.result) for r in res] == [
        ("CUDA0", "q4_K", 7, "pair", "FAIL"), ("CUDA0", "q4_K", 8, "pair", "OK")]  # non-dup cases are not counted
    t = backend_ops.table(res)
    assert "backend CUDA0" in t and "7/pair" in t


def test_sycl_reorder_skip_matches_the_slot_names():
    """SYCL reorders weights in place on first use; patch 0011 skips tensors named "*.cache", which
    must be exactly the names the cache gives its slots, each layer's or a pool bank's (no SYCL compiler
    here: a contract check)."""
    from pathlib import Path
    import re
    root = Path(__file__).resolve().parents[2]
    sycl = next((root / "patches").glob("*ggml-sycl-never-reorder*.patch")).read_text()
    assert 'strcmp(t->name + n - 6, ".cache") == 0' in sycl
    assert sycl.count("ggml_sycl_tensor_is_rewritten(src0)") == 2  # MUL_MAT and MUL_MAT_ID entry points
    ext = "".join(p.read_text() for p in sorted((root / "ggml-ext").glob("llama-moe*.cpp")))
    slot_names = re.findall(r'ggml_format_name\((?:l|ba)\.slots\[p\], "([^"]+)"', ext)
    assert len(slot_names) == 2 and all(n.endswith(".cache") for n in slot_names)
    others = re.findall(r'ggml_format_name\([^,]+, "([^"]+)"', ext)
    assert [n for n in others if n.endswith(".cache")] == slot_names  # nothing else is skipped by accident
