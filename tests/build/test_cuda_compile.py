"""CUDA compile check: every CUDA translation unit that the patch series or a candidate patch
(``patches/candidates/*.patch``) touches, and ``ggml-cuda.cu`` always, compiles with nvcc for sm_90
with FlashAttention off, as ``tools/device-check.sh`` builds the backend on the device machine. It
is a full compile (front end, device code, ptxas for sm_90); nothing runs: there is no GPU here.

The tree compiled is a copy of ``ggml/`` from the patched tree the build made
(``vendor.llama_cpp_dir()``, ``patches/series`` applied), with the candidates applied to the copy by
``git apply`` from its llama.cpp root, as device-check.sh does. The vendor tree is never changed.
:func:`nvcc_command` is the command the real CMake build of ggml-cuda gives nvcc
(``ggml/src/ggml-cuda/CMakeLists.txt`` and ``ggml/src/CMakeLists.txt`` with pybmoe's settings:
shared libraries, Release, ``CMAKE_CUDA_ARCHITECTURES=90``, ``GGML_CUDA_FA=OFF``): the same include
dirs, defines and nvcc flags. A ``.cu`` is compiled as it is; a ``.cuh`` through a one-line ``.cu``
that includes it and, since that instantiates none of its templates, through the first of
upstream's ``template-instances/*.cu`` that includes it (for ``mmf.cuh``: ``mmf-instance-ncols_1.cu``,
which instantiates ``mul_mat_f`` with and without ids and ``mul_mat_f_ids``).
:func:`test_a_broken_unit_fails_to_compile` runs the same command on a copy of ``mmid.cu`` with
an error added, so a check that compiles nothing cannot pass.

cuBLAS: ``ggml-cuda/vendors/cuda.h`` includes ``cublas_v2.h``, which the nvcc wheels lack. It is
looked for in ``$PYBMOE_CUBLAS_INCLUDE``, in nvcc's toolkit, then in an installed ``nvidia-cublas``
wheel (``nvidia/cu13/include`` for the 13.x wheels, ``nvidia/cublas/include`` for older ones) on
``sys.path``. Without nvcc the tests skip. With nvcc and no cuBLAS headers they skip with how to
get them (``pip install nvidia-cublas==13.0.2.14``, the one of CUDA 13.0, into the venv or with
``--target DIR`` and ``PYBMOE_CUBLAS_INCLUDE=DIR/nvidia/cu13/include``: 568 MB, too much to put
in every user's test extra), unless ``PYBMOE_REQUIRE_CUDA_COMPILE=1``: then they FAIL. ``.ci/run``
sets it where nvcc exists, after installing the wheel, so CI runs the check wherever nvcc is and
cannot skip it by accident. About a minute on 2 cores (docs/backends.md): marked slow.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = "ggml/src/ggml-cuda"
ALWAYS = f"{CUDA_DIR}/ggml-cuda.cu"


def candidate_patches() -> list[Path]:
    return sorted((ROOT / "patches" / "candidates").glob("*.patch"))


def touched_cuda_files() -> tuple[list[str], list[str]]:
    """The .cu/.cuh files (paths relative to the llama.cpp tree) that the patches of
    ``patches/series`` change, and those that ``patches/candidates/*.patch`` change. The series'
    paths start with ``vendor/llama.cpp/``; the candidates' are relative to the llama.cpp root."""
    series: set[str] = set()
    for name in (ROOT / "patches" / "series").read_text().split():
        text = (ROOT / "patches" / name).read_text()
        series.update(re.findall(r"^diff --git a/vendor/llama\.cpp/(\S+\.cuh?) ", text, re.M))
    candidates: set[str] = set()
    for patch in candidate_patches():
        candidates.update(re.findall(r"^diff --git a/(\S+\.cuh?) ", patch.read_text(), re.M))
    return sorted(series), sorted(candidates)


def compile_units() -> list[str]:
    """What the compile test compiles: ggml-cuda.cu, each touched .cu, and for each touched .cuh
    the header alone (``X.cuh``) and a unit that instantiates it (``X.cuh:instance``)."""
    series, candidates = touched_cuda_files()
    units = {ALWAYS}
    for path in series + candidates:
        units.add(path)
        if path.endswith(".cuh"):
            units.add(f"{path}:instance")
    return sorted(units)


# --------------------------------------------------------------------------- the toolchain

def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    return nvcc


def find_cublas_include(nvcc: str) -> Path | None:
    """The directory holding cublas_v2.h: $PYBMOE_CUBLAS_INCLUDE, nvcc's toolkit, or an installed
    nvidia-cublas wheel; None if there is none."""
    env = os.environ.get("PYBMOE_CUBLAS_INCLUDE")
    if env:
        return Path(env) if (Path(env) / "cublas_v2.h").is_file() else None
    top = Path(nvcc).resolve().parent.parent  # the toolkit (/usr/local/bin/nvcc may be a wrapper)
    dirs = [top / "include", top / "targets" / "x86_64-linux" / "include", Path("/usr/local/cuda/include")]
    dirs += [Path(p) / "nvidia" / sub / "include" for p in sys.path if p for sub in ("cu13", "cublas")]
    return next((d for d in dirs if (d / "cublas_v2.h").is_file()), None)


@pytest.fixture(scope="module")
def toolchain() -> tuple[str, Path]:
    nvcc = _nvcc()
    inc = find_cublas_include(nvcc)
    if inc is None:
        where = os.environ.get("PYBMOE_CUBLAS_INCLUDE")
        why = ((f"PYBMOE_CUBLAS_INCLUDE={where} holds no cublas_v2.h" if where else
                "nvcc is installed but cublas_v2.h is not: not in nvcc's toolkit, not in an nvidia-cublas wheel on sys.path")
               + ". Get the headers with `pip install nvidia-cublas==13.0.2.14` (cuBLAS of CUDA 13.0; any 13.x "
                 "has them) into this venv, or `pip install --target DIR nvidia-cublas==13.0.2.14` and "
                 "PYBMOE_CUBLAS_INCLUDE=DIR/nvidia/cu13/include")
        if os.environ.get("PYBMOE_REQUIRE_CUDA_COMPILE") == "1":
            pytest.fail(why + " (PYBMOE_REQUIRE_CUDA_COMPILE=1: the check must run here)", pytrace=False)
        pytest.skip(why)
    return nvcc, inc


@pytest.fixture(scope="module")
def cuda_tree(tmp_path_factory) -> Path:
    """A copy of the patched tree's ggml/ with patches/candidates/*.patch applied (its llama.cpp root)."""
    from pybmoe.build import vendor
    src = vendor.llama_cpp_dir(ROOT)
    if not (src / ALWAYS).is_file():
        pytest.skip(f"no patched tree: {src / ALWAYS} is absent (run `pybmoe vendor` or a build)")
    dst = tmp_path_factory.mktemp("cuda") / "llama.cpp"
    shutil.copytree(src / "ggml", dst / "ggml", symlinks=True)
    # a repository of its own, so that `git apply` patches paths from here even when the temporary
    # folder lies inside another work tree (there it would skip paths outside the current folder)
    subprocess.run(["git", "init", "-q", str(dst)], check=True)
    for patch in candidate_patches():
        r = subprocess.run(["git", "apply", str(patch)], cwd=dst, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.fail(f"candidate {patch.name} does not apply to the patched tree:\n{r.stderr}", pytrace=False)
    return dst


# --------------------------------------------------------------------------- the command

#: ggml/cmake/common.cmake (ggml_cuda_fattn_vec_instances) with GGML_CUDA_FA_QUANTS' default: defines
#: that every unit of ggml-cuda gets (ggml-cuda.cu reads GGML_CUDA_FA_QUANTS, fattn.cu the pairs)
FA_TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "bf16", "f16"]
FA_QUANTS = ["q4_0-q4_0", "q8_0-q8_0", "f16-f16", "bf16-bf16"]
#: GGML_ALL_WARNINGS (on by default) with GCC as nvcc's host compiler, then ggml-cuda's -Wno-pedantic:
#: warnings only, kept so that the host compiler sees what it sees in the real build
HOST_FLAGS = ("-Wmissing-declarations -Wmissing-noreturn -Wall -Wextra -Wpedantic -Wcast-qual -Wno-unused-function"
              " -Wno-array-bounds -Wextra-semi -Wno-pedantic")


def nvcc_command(nvcc: str, tree: Path, cublas_include: Path, src: Path, obj: Path) -> list[str]:
    """nvcc's command for one unit of ggml-cuda, as the CMake build makes it (see the module doc;
    checked against CMake's compile_commands.json of a real configure, 2026-12-05)."""
    fa = [f'-DGGML_CUDA_FA_QUANTS="{",".join(FA_QUANTS)}"'] + [
        f"-DGGML_CUDA_FA_{k.upper()}_{v.upper()}={int(f'{k}-{v}' in FA_QUANTS)}" for v in FA_TYPES for k in FA_TYPES]
    return [
        nvcc, "-forward-unknown-to-host-compiler",
        # ggml/src/CMakeLists.txt: GGML_SCHED_MAX_COPIES (default 4), _XOPEN_SOURCE, _GNU_SOURCE (Linux);
        # GGML_BACKEND_BUILD/GGML_BACKEND_SHARED (a backend of a shared build), GGML_SHARED (from ggml-base);
        # ggml-cuda/CMakeLists.txt: GGML_CUDA_NO_FA (GGML_CUDA_FA=OFF), GGML_CUDA_USE_GRAPHS (llama.cpp's
        # default GGML_CUDA_GRAPHS=ON); ggml_cuda_EXPORTS (CMake, for a shared library)
        "-DGGML_BACKEND_BUILD", "-DGGML_BACKEND_SHARED", *fa, "-DGGML_CUDA_NO_FA", "-DGGML_CUDA_USE_GRAPHS",
        "-DGGML_SCHED_MAX_COPIES=4", "-DGGML_SHARED", "-D_GNU_SOURCE", "-D_XOPEN_SOURCE=600", "-Dggml_cuda_EXPORTS",
        # ggml_add_backend_library: ggml/src (`..` of ggml-cuda); ggml-base: ggml/include; CUDA::cublas: cuBLAS
        "-I", str(tree / "ggml/src"), "-I", str(tree / "ggml/include"), "-isystem", str(cublas_include),
        # Release; CMAKE_CUDA_ARCHITECTURES=90; ggml-cuda's CUDA_FLAGS (compress-mode: GGML_CUDA_COMPRESSION_MODE)
        "-O3", "-DNDEBUG", "-std=c++17", "--generate-code=arch=compute_90,code=[compute_90,sm_90]",
        "-Xcompiler=-fPIC", "-use_fast_math", "-extended-lambda", "-compress-mode=size", "-Xcompiler", HOST_FLAGS,
        "-x", "cu", "-c", str(src), "-o", str(obj),
    ]


def compile_cuda(nvcc: str, tree: Path, cublas_include: Path, src: Path, obj: Path) -> subprocess.CompletedProcess:
    return subprocess.run(nvcc_command(nvcc, tree, cublas_include, src, obj), capture_output=True, text=True, timeout=3600)


def unit_source(tree: Path, unit: str) -> Path:
    """The .cu that compiles ``unit`` (see compile_units); wrappers are written next to the header,
    where a unit of ggml-cuda would be."""
    if unit.endswith(".cu"):
        return tree / unit
    header = tree / unit.removesuffix(":instance")
    if unit.endswith(":instance"):
        users = [p for p in sorted((header.parent / "template-instances").glob("*.cu"))
                 if f'#include "../{header.name}"' in p.read_text()]
        if not users:
            pytest.skip(f"no unit of template-instances/ includes {header.name}: the header alone is compiled")
        return min(users, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
    wrapper = header.parent / f"pybmoe-wrap-{header.stem}.cu"
    wrapper.write_text(f'#include "{header.name}"\n')
    return wrapper


def _fail_text(r: subprocess.CompletedProcess) -> str:
    return f"nvcc exited {r.returncode}:\n{(r.stdout + r.stderr)[-6000:]}"


# --------------------------------------------------------------------------- the tests

def test_the_cuda_files_the_series_and_the_candidates_touch_today():
    # a change to either list is on purpose: promoting the candidate moves its files to the series
    series, candidates = touched_cuda_files()
    assert series == []
    assert candidates == [f"{CUDA_DIR}/ggml-cuda.cu", f"{CUDA_DIR}/mmf.cuh", f"{CUDA_DIR}/mmid.cu", f"{CUDA_DIR}/mmq.cu"]
    assert compile_units() == [f"{CUDA_DIR}/ggml-cuda.cu", f"{CUDA_DIR}/mmf.cuh", f"{CUDA_DIR}/mmf.cuh:instance",
                               f"{CUDA_DIR}/mmid.cu", f"{CUDA_DIR}/mmq.cu"]


@pytest.mark.slow
@pytest.mark.parametrize("unit", compile_units())
def test_cuda_unit_compiles_for_sm90(unit, toolchain, cuda_tree, tmp_path):
    nvcc, cublas = toolchain
    src = unit_source(cuda_tree, unit)
    r = compile_cuda(nvcc, cuda_tree, cublas, src, tmp_path / "unit.o")
    assert r.returncode == 0, f"{src.relative_to(cuda_tree)}: {_fail_text(r)}"
    assert (tmp_path / "unit.o").stat().st_size > 0


#: errors added to a copy of mmid.cu, each with what nvcc must say: one the host front end finds,
#: one only the device (sm_90) compilation finds, one only ptxas finds (so sm_90 code is generated)
BROKEN = {
    "undeclared": ("void pybmoe_broken() { pybmoe_no_such_function(1); }\n",
                   [r'identifier "pybmoe_no_such_function" is undefined']),
    "host-from-device": ("static int pybmoe_host_only() { return 1; }\n"
                         "__global__ void pybmoe_broken_kernel(int * y) { y[0] = pybmoe_host_only(); }\n",
                         [r'calling a __host__ function\("pybmoe_host_only\(\)"\) from a __global__ function'
                          r'\("pybmoe_broken_kernel"\) is not allowed']),
    "ptx": ('__global__ void pybmoe_broken_kernel(int * y) { asm volatile("pybmoe_no_such_instruction;"); }\n',
            [r"ptxas", r"pybmoe_no_such_instruction"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_unit_fails_to_compile(kind, toolchain, cuda_tree, tmp_path):
    nvcc, cublas = toolchain
    code, expected = BROKEN[kind]
    good = cuda_tree / CUDA_DIR / "mmid.cu"
    broken = good.with_name(f"pybmoe-broken-{kind}-mmid.cu")  # beside it, for its relative includes
    broken.write_text(good.read_text() + "\n// pybmoe: broken on purpose\n" + code)
    try:
        r = compile_cuda(nvcc, cuda_tree, cublas, broken, tmp_path / "unit.o")
    finally:
        broken.unlink()
    assert r.returncode != 0, f"nvcc compiled the broken copy ({kind}):\n{r.stdout + r.stderr}"
    for pattern in expected:
        assert re.search(pattern, r.stdout + r.stderr), f"nvcc failed, but not naming {pattern!r}: {_fail_text(r)}"
