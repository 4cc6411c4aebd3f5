"""The engine's own files (ggml-ext/), read from the source: the tiers meet only through their owner,
and no file or function grows past what a reader can hold.

- **Tiers:** the stream tier (``llama-moe-stream*``) and the VRAM tier (``llama-moe-vram*``) never include
  each other's headers nor name each other's types or members. What one lends the other goes through
  the interfaces of ``llama-moe-links.h``, which the owner (``llama_moe_tiers``, ``llama-moe-model.h``)
  wires together (docs/architecture.md, "The call graph").
- **Sizes:** no ``ggml-ext/`` source over 650 lines; no function over 150 lines, counted with Universal
  Ctags' ``line``/``end`` fields (skipped without Universal Ctags, unless ``PYBMOE_REQUIRE_CTAGS=1``,
  which CI sets after installing it).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

EXT = Path(__file__).resolve().parent.parent / "ggml-ext"
MAX_FILE_LINES = 650
MAX_FUNCTION_LINES = 150

#: each tier's files (by prefix), and its names, which the other tier's files must never use
TIERS = {
    "stream": ("llama-moe-stream", ("llama-moe-stream", "llama_moe_stream", ".stream", "->stream")),
    "vram": ("llama-moe-vram", ("llama-moe-vram", "llama_moe_vram", "llama_moe_vram_layer", "llama_moe_cache_layer", ".vram", "->vram")),
}


def code_of(path: Path) -> str:
    """The file without its comments (// and /* */) and string literals."""
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return re.sub(r"//[^\n]*", "", text)


def tier_files(prefix: str) -> list[Path]:
    return sorted(p for p in EXT.iterdir() if p.name.startswith(prefix) and p.suffix in (".h", ".cpp"))


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_tier_never_names_the_other(tier):
    prefix, _ = TIERS[tier]
    files = tier_files(prefix)
    assert len(files) >= 2, files
    others = [names for t, (_, names) in TIERS.items() if t != tier]
    found = []
    for f in files:
        includes = re.findall(r'#include\s+"([^"]+)"', f.read_text())
        code = code_of(f)
        for names in others:
            for name in names:
                if name.startswith("llama-moe-"):
                    found += [f"{f.name}: #include \"{i}\"" for i in includes if i.startswith(name)]
                elif name.startswith((".", "->")):
                    found += [f"{f.name}: {name}" for _ in re.finditer(re.escape(name) + r"\b", code)]
                else:
                    found += [f"{f.name}: {name}" for _ in re.finditer(r"\b" + re.escape(name) + r"\b", code)]
    assert found == [], found


def test_the_owner_wires_the_links():
    owner = code_of(EXT / "llama-moe-model.h")
    assert "stream.devices = &vram;" in owner and "vram.ram       = &stream;" in owner
    assert re.search(r"struct llama_moe_stream : llama_moe_ram_copies", code_of(EXT / "llama-moe-stream.h"))
    assert re.search(r"struct llama_moe_vram : llama_moe_device_residents", code_of(EXT / "llama-moe-vram.h"))


def test_no_source_over_650_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in EXT.iterdir() if p.suffix in (".h", ".cpp", ".c")}
    assert len(sizes) > 20
    over = {n: s for n, s in sizes.items() if s > MAX_FILE_LINES}
    assert over == {}, over


def universal_ctags() -> str | None:
    exe = shutil.which("ctags")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return exe if "Universal Ctags" in out.stdout else None


def test_no_function_over_150_lines():
    exe = universal_ctags()
    if exe is None:
        if os.environ.get("PYBMOE_REQUIRE_CTAGS") == "1":
            pytest.fail("PYBMOE_REQUIRE_CTAGS=1 but Universal Ctags is not installed")
        pytest.skip("Universal Ctags is not installed")
    srcs = sorted(str(p) for p in EXT.iterdir() if p.suffix in (".h", ".cpp"))
    out = subprocess.run([exe, "--fields=+ne", "--kinds-c++=f", "-f", "-", *srcs], capture_output=True, text=True,
                         check=True).stdout
    lengths = {}
    for row in out.splitlines():
        cols = row.split("\t")
        fields = dict(c.split(":", 1) for c in cols[3:] if ":" in c)
        if "line" in fields and "end" in fields:
            lengths[f"{Path(cols[1]).name}:{cols[0]}"] = int(fields["end"]) - int(fields["line"]) + 1
    assert len(lengths) > 100 and max(lengths.values()) > 50  # ctags read the files
    over = {k: v for k, v in lengths.items() if v > MAX_FUNCTION_LINES}
    assert over == {}, over


#: the steps of the after-load sequence, which only the apply entry (ggml-ext/llama-moe-apply.cpp) calls
AFTER_LOAD_STEPS = ("llama_model_moe_cache_set_max_batch", "llama_model_moe_cache_init", "llama_model_moe_cache_set_sync",
                    "llama_model_moe_cache_set_admit_window", "llama_model_moe_cache_set_warmup",
                    "llama_model_moe_cache_set_upload_budget_mib", "llama_model_moe_stream_init",
                    "llama_model_moe_stream_fit", "llama_model_moe_dense_weights", "llama_model_moe_trace_open",
                    "llama_model_moe_route_replay_open")


def _added_lines(prefix: str) -> str:
    """Every `+` line the patch series adds to the upstream files under ``prefix`` (common/, tools/)."""
    root = EXT.parent / "patches"
    out, cur = [], None
    for name in (root / "series").read_text().split():
        for line in (root / name).read_text(errors="replace").splitlines():
            if line.startswith("+++ b/"):
                cur = line[6:]
            elif line.startswith("+") and cur and f"/llama.cpp/{prefix}" in cur:
                out.append(line[1:])
    return "\n".join(out)


@pytest.mark.parametrize("caller", ["common/", "tools/", "bindings"])
def test_the_after_load_sequence_is_written_once(caller):
    """common (llama-server, llama-cli), llama-bench and the bindings call none of the apply entry's steps:
    the sequence and its order live in llama_model_moe_apply alone (issue 41; before it, patch 0030 and its
    siblings wrote it in common.cpp and llama-bench.cpp, and bindings.py a third time). Read from every
    patch's added lines, so no patch of the series writes a step either."""
    if caller == "bindings":
        code = re.sub(r"#[^\n]*", "", (EXT.parent / "pybmoe" / "engine" / "bindings.py").read_text())
        calls = re.findall(r"\.(llama_model_moe_\w+)\(", code)
    else:
        calls = re.findall(r"\b(llama_model_moe_\w+)\s*\(", re.sub(r"//[^\n]*", "", _added_lines(caller)))
    assert "llama_model_moe_apply" in calls, calls
    assert [c for c in calls if c in AFTER_LOAD_STEPS] == [], calls


@pytest.mark.parametrize("path", ["common/common.cpp", "tools/llama-bench/llama-bench.cpp"])
def test_each_tool_calls_the_apply_entry_once(path):
    """In the patched tree (skipped without one): one call of llama_model_moe_apply per tool."""
    from pybmoe.build import vendor
    root = EXT.parent
    lc = vendor.tree_dir(root, vendor.load_pin(root)) / vendor.load_pin(root).subdir
    if not (lc / path).is_file():
        pytest.skip(f"no patched tree: {lc / path} is absent (run `pybmoe vendor` or a build)")
    code = re.sub(r"//[^\n]*", "", (lc / path).read_text())
    assert len(re.findall(r"\bllama_model_moe_apply\s*\(", code)) == 1
