"""`pybmoe patches check | rebase`: per-patch reports, exit codes, the conflict left for a hand resolution."""
from __future__ import annotations

import gzip
import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pybmoe.build import patches, vendor

ROOT = Path(__file__).resolve().parents[2]


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYBMOE_ROOT=str(root), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pybmoe.cli", "patches", *args], cwd=root,
                          capture_output=True, text=True, env=env, timeout=600)


def _rows(out: str) -> dict[str, str]:
    """``{patch: status}`` from the table printed by check / rebase."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+\.patch)\s+\|\s+(clean|fuzzy|conflicted|failed|not reached)\s+\|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def _touched(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch.read_text(errors="replace"), re.M)


def _victim(root: Path) -> Path:
    """A patch of the series whose files no other patch touches, not the last one if possible
    (so a replay continues after it)."""
    ser = vendor.series(root)
    for p in ser[:-1] + ser[-1:]:
        others = {f for q in ser if q != p for f in _touched(q)}
        if not set(_touched(p)) & others:
            return p
    return ser[-1]


def _conflicting_change(patch: Path) -> tuple[str, int]:
    """(file, 0-based line) in the pinned tree that the first hunk of ``patch`` removes, or the
    context line just before its first added line: changing it upstream makes a true conflict."""
    text = patch.read_text(errors="replace")
    file = _touched(patch)[0]
    body = text.split(f"diff --git a/{file} ", 1)[1]
    m = re.search(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@.*$", body, re.M)
    old = int(m.group(1)) - 1
    prev_ctx = None
    for line in body[m.end() + 1:].splitlines():
        if line.startswith("-"):
            return file, old
        if line.startswith("+"):
            return file, prev_ctx
        prev_ctx = old
        old += 1
    raise AssertionError(f"no change in the first hunk of {patch.name}")


def _sdist_with_change(sdist: Path, out: Path, rel: str, line_no: int) -> None:
    """Copy ``sdist`` to ``out`` with line ``line_no`` of ``rel`` (path under the sdist top) edited."""
    with tarfile.open(sdist) as src, gzip.open(out, "wb", compresslevel=1) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=src.format) as dst:
        hit = False
        for m in src:
            data = src.extractfile(m) if m.isfile() else None
            if m.isfile() and m.name.split("/", 1)[-1] == rel:
                lines = data.read().decode().splitlines(keepends=True)
                lines[line_no] = lines[line_no].rstrip("\n") + " // changed upstream\n"
                blob = "".join(lines).encode()
                m.size = len(blob)
                data, hit = io.BytesIO(blob), True
            dst.addfile(m, data)
    assert hit, f"{rel} not in {sdist.name}"


def test_check_exits_zero_with_every_patch_clean():
    r = _cli(ROOT, "check")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(r.stdout)
    assert list(rows) == [p.name for p in vendor.series(ROOT)]
    assert set(rows.values()) == {"clean"}


def test_check_names_a_failing_patch_and_exits_nonzero(tmp_path, fake_root):
    root = fake_root()
    bad = root / "patches" / "0002-bogus.patch"
    bad.write_text("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
                   "From: pybmoe <pybmoe@localhost>\nDate: Sun, 29 Nov 2026 00:00:00 +0000\n"
                   "Subject: [PATCH] bogus\n\n---\n"
                   "diff --git a/vendor/llama.cpp/src/llama.cpp b/vendor/llama.cpp/src/llama.cpp\n"
                   "--- a/vendor/llama.cpp/src/llama.cpp\n+++ b/vendor/llama.cpp/src/llama.cpp\n"
                   "@@ -1,2 +1,2 @@\n-not in upstream\n+nor this\n nor that\n")
    names = [p.name for p in vendor.series(root)]
    (root / "patches" / "series").write_text("\n".join([names[0], bad.name, *names[1:]]) + "\n")
    r = _cli(root, "check")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = _rows(r.stdout)
    assert rows[names[0]] == "clean"
    assert rows[bad.name] == "failed"
    assert all(rows[n] == "not reached" for n in names[1:])
    assert "0002-bogus.patch does not apply" in r.stdout


def test_rebase_onto_the_pinned_version_is_all_clean(tmp_path, pin, sdist, fake_root):
    root = fake_root()
    r = _cli(root, "rebase", "--onto", pin.version)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"sha256 {pin.sha256}" in r.stdout
    rows = _rows(r.stdout)
    assert list(rows) == [p.name for p in vendor.series(root)]
    assert set(rows.values()) == {"clean"}
    tree = root / "vendor" / "rebase" / pin.stem
    log = subprocess.run(["git", "log", "--format=%s", f"{vendor.BASE_TAG}..HEAD"], cwd=tree,
                         capture_output=True, text=True).stdout.splitlines()
    assert len(log) == len(rows)
    # exporting the rebased tree reproduces the series byte for byte
    before = {p.name: p.read_bytes() for p in (root / "patches").iterdir() if p.is_file()}
    r = _cli(root, "export", "--from", str(tree))
    assert r.returncode == 0, r.stderr
    assert {p.name: p.read_bytes() for p in (root / "patches").iterdir() if p.is_file()} == before
    # a second rebase does not clobber the tree
    r = _cli(root, "rebase", "--onto", str(sdist))
    assert r.returncode == 2 and "--force" in r.stderr


def test_rebase_conflict_stops_in_am_state_and_continues(tmp_path, sdist, fake_root):
    root = fake_root()
    victim = _victim(root)
    rel, line_no = _conflicting_change(victim)
    changed = tmp_path / "llama_cpp_python-0.3.36+conflict.tar.gz"
    _sdist_with_change(sdist, changed, rel, line_no)

    r = _cli(root, "rebase", "--onto", str(changed))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"sha256 {vendor.sha256_file(changed)}" in r.stdout
    rows = _rows(r.stdout)
    names = [p.name for p in vendor.series(root)]
    i = names.index(victim.name)
    assert rows[victim.name] == "conflicted"
    assert all(rows[n] in ("clean", "fuzzy") for n in names[:i])
    assert all(rows[n] == "not reached" for n in names[i + 1:])
    assert "git am --continue" in r.stdout and "patches export --from" in r.stdout

    tree = root / "vendor" / "rebase" / "llama_cpp_python-0.3.36+conflict"
    assert (tree / ".git" / "rebase-apply").is_dir()  # the git am state, for a hand resolution
    unmerged = subprocess.run(["git", "diff", "--name-only", "--diff-filter=U"], cwd=tree,
                              capture_output=True, text=True).stdout.split()
    assert unmerged == [rel]
    assert "<<<<<<<" in (tree / rel).read_text()

    # --continue refuses while the conflict is unresolved
    r = _cli(root, "rebase", "--continue", str(tree))
    assert r.returncode == 2 and "git am --continue failed" in r.stderr

    # resolve: take the patch's side, then resume
    subprocess.run(["git", "checkout", "--theirs", "--", rel], cwd=tree, check=True)
    subprocess.run(["git", "add", "--", rel], cwd=tree, check=True)
    r = _cli(root, "rebase", "--continue", str(tree))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(r.stdout)
    assert rows[victim.name] == "fuzzy"
    assert all(rows[n] == "clean" for n in names[i + 1:])
    assert not (tree / ".git" / "rebase-apply").exists()


def test_rebase_rejects_bad_input_early(tmp_path, fake_root):
    root = fake_root()
    r = _cli(root, "rebase", "--onto", "not a version!")
    assert r.returncode == 2 and "neither a .tar.gz sdist nor a version" in r.stderr
    r = _cli(root, "rebase", "--onto", str(tmp_path / "missing.tar.gz"))
    assert r.returncode == 2 and "no such sdist file" in r.stderr
    r = _cli(root, "rebase", "--continue", str(tmp_path))
    assert r.returncode == 2 and "not a tree made by" in r.stderr
    with pytest.raises(ValueError, match="neither"):
        patches.resolve_onto("../x", root)
