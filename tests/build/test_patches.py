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

from conftest import tar_folder, write_files
from pybmoe.build import patches, trees, vendor

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


def test_rebase_onto_the_pinned_version_is_all_clean(tmp_path, pin, sdist, engine_sdist, fake_root):
    """Onto the pinned llama.cpp (the engine's pinned version where the pin has one, else the pinned
    llama-cpp-python version) every patch replays clean, and exporting gives the series back. Issue 43,
    item 9: `--onto 11434.0.0`, the engine's version, was a pip error (only llama-cpp-python versions
    were known)."""
    root = fake_root()
    onto = pin.engine.version if pin.engine else pin.version
    r = _cli(root, "rebase", "--onto", onto)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"sha256 {pin.engine.sha256 if pin.engine else pin.sha256}" in r.stdout
    rows = _rows(r.stdout)
    assert list(rows) == [p.name for p in vendor.series(root)]
    assert set(rows.values()) == {"clean"}
    tree = root / "vendor" / "rebase" / (pin.engine.stem if pin.engine else pin.stem)
    log = subprocess.run(["git", "log", "--format=%s", f"{vendor.BASE_TAG}..HEAD"], cwd=tree,
                         capture_output=True, text=True).stdout.splitlines()
    assert len(log) == len(rows)
    # exporting the rebased tree reproduces the series byte for byte
    before = {p.name: p.read_bytes() for p in (root / "patches").iterdir() if p.is_file()}
    r = _cli(root, "export", "--from", str(tree))
    assert r.returncode == 0, r.stderr
    assert {p.name: p.read_bytes() for p in (root / "patches").iterdir() if p.is_file()} == before
    # a second rebase does not clobber the tree
    r = _cli(root, "rebase", "--onto", str(engine_sdist or sdist))
    assert r.returncode == 2 and "--force" in r.stderr


def test_rebase_conflict_stops_in_am_state_and_continues(tmp_path, pin, sdist, engine_sdist, fake_root):
    root = fake_root()
    victim = _victim(root)
    rel, line_no = _conflicting_change(victim)
    # the pinned llama.cpp with one line the victim changes changed "upstream" too: the engine's
    # sdist (llama.cpp at <top>/llama.cpp) where the pin has one, else the bindings' sdist
    base = engine_sdist or sdist
    stem = base.name[: -len(".tar.gz")]
    changed = tmp_path / f"{stem}+conflict.tar.gz"
    in_sdist = rel
    if pin.engine:
        in_sdist = pin.engine.path.split("/", 1)[-1] + rel[len(pin.subdir):]
    _sdist_with_change(base, changed, in_sdist, line_no)

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

    tree = root / "vendor" / "rebase" / f"{stem}+conflict"
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
    assert r.returncode == 2 and "neither an existing directory or tarball nor" in r.stderr
    r = _cli(root, "rebase", "--onto", str(tmp_path / "missing.tar.gz"))
    assert r.returncode == 2 and "no such file or directory" in r.stderr
    r = _cli(root, "rebase", "--continue", str(tmp_path))
    assert r.returncode == 2 and "not a tree made by" in r.stderr
    with pytest.raises(ValueError, match="no such file or directory"):
        patches.resolve_onto("../x", root)
    with pytest.raises(ValueError, match="neither"):
        patches.resolve_onto("x y", root)


# ------------------------------------------------------------ --onto any llama.cpp tree, on fake trees
# A fake pin (a llama-cpp-python-like sdist of five files, in a private PYBMOE_CACHE), a series of two
# patches made from it, and newer fake upstreams: a directory, a tarball holding llama.cpp deeper
# down, a git checkout. Each run takes about a second.

_SRC = "".join(f"int f{i}(void) {{ return {i}; }}\n" for i in range(30))
_HDR = "#pragma once\n#define LLAMA_API\n" + "".join(f"LLAMA_API int f{i}(void);\n" for i in range(30))


def _llama_files(src: str = _SRC, hdr: str = _HDR) -> dict[str, str]:
    return {"include/llama.h": hdr, "ggml/CMakeLists.txt": "project(ggml)\n",
            "ggml/include/ggml.h": "#pragma once\n", "src/llama.cpp": src}




@pytest.fixture
def fake_pin(tmp_path):
    """``(root, env)``: a project whose pin is a fake sdist (``fakecpp-1.0``, llama.cpp at
    vendor/llama.cpp) and whose series is 0001 (src/llama.cpp, line 10) and 0002 (llama.h)."""
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    top = tmp_path / "pin" / "fakecpp-1.0"
    write_files(top / "vendor" / "llama.cpp", _llama_files())
    (top / "pyproject.toml").write_text("[project]\nname = 'fakecpp'\n")
    sdist = tar_folder(cache / "sdist" / "fakecpp-1.0.tar.gz", top, "fakecpp-1.0")
    root = tmp_path / "proj"
    (root / "vendor").mkdir(parents=True)
    (root / "patches").mkdir()
    (root / "vendor" / "upstream.toml").write_text(
        '[sdist]\nname = "fakecpp"\nversion = "1.0"\nfilename = "fakecpp-1.0.tar.gz"\n'
        f'sha256 = "{vendor.sha256_file(sdist)}"\n[llama_cpp]\ncommit = "0000000"\nsubdir = "vendor/llama.cpp"\n')
    work = tmp_path / "work"
    vendor.unpack(sdist, work)
    lc = work / "vendor" / "llama.cpp"
    lines = _SRC.splitlines(keepends=True)
    lines[10] = "int f10(void) { return moe_hook(10); }\n"
    (lc / "src" / "llama.cpp").write_text("".join(lines))
    vendor._git(work, "commit", "-q", "-a", "-m", "llama: a hook in f10")
    (lc / "include" / "llama.h").write_text(_HDR + "LLAMA_API int moe_hook(int);\n")
    vendor._git(work, "commit", "-q", "-a", "-m", "llama: declare the hook")
    names = patches.export(root, work)
    assert len(names) == 2
    env = {"PYBMOE_CACHE": str(cache)}
    return root, env


def _fake_cli(root: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYBMOE_ROOT=str(root), PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "pybmoe.cli", "patches", *args], cwd=root,
                          capture_output=True, text=True, env=full, timeout=120)


def _newer_files(conflict: bool = False) -> dict[str, str]:
    lines = _SRC.splitlines(keepends=True)
    if conflict:
        lines[10] = "int f10(void) { return 10 + 0; }\n"
    else:
        lines = [f"// new upstream line {i}\n" for i in range(5)] + lines
    return _llama_files(src="".join(lines))


def _newer(tmp_path: Path, kind: str, *, conflict: bool = False) -> tuple[list[str], Path]:
    """A newer fake upstream as ``--onto`` arguments (and the work tree it makes): five lines are
    added at the top of src/llama.cpp (0001 moves: fuzzy), or, with ``conflict``, the very line
    0001 changes is changed too."""
    files = _newer_files(conflict)
    if kind == "dir":
        d = tmp_path / "up" / "llama.cpp"
        write_files(d, files)
        return [str(d)], Path("llama.cpp")
    if kind == "tarball":  # llama.cpp two folders down, beside other files
        top = tmp_path / "up" / "pkg-2.0"
        write_files(top / "third_party" / "llama.cpp", files)
        (top / "setup.py").write_text("")
        return [str(tar_folder(tmp_path / "pkg-2.0.tar.gz", top, "pkg-2.0"))], Path("pkg-2.0")
    if kind == "git":  # the commit at tag v2, not the (different) working files
        d = tmp_path / "up" / "checkout"
        write_files(d / "llama.cpp", files)
        for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "v2"], ["tag", "v2"]):
            vendor._git(d, *cmd)
        (d / "llama.cpp" / "src" / "llama.cpp").write_text("garbage\n")
        sha = vendor._git(d, "rev-parse", "v2").stdout.strip()
        return [str(d), "--ref", "v2"], Path(f"checkout@{sha[:12]}")
    raise AssertionError(kind)


def _base_message(tree: Path) -> str:
    return vendor._git(tree, "log", "-1", "--format=%B", vendor.BASE_TAG).stdout


@pytest.mark.parametrize("kind", ["dir", "tarball", "git"])
def test_rebase_onto_a_fake_tree_applies_and_records_its_source(tmp_path, fake_pin, kind):
    root, env = fake_pin
    onto, name = _newer(tmp_path, kind)
    r = _fake_cli(root, env, "rebase", "--onto", *onto)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(r.stdout)
    assert rows == {"0001-llama-a-hook-in-f10.patch": "fuzzy", "0002-llama-declare-the-hook.patch": "clean"}
    assert "offsets 5 lines" in r.stdout
    tree = root / "vendor" / "rebase" / name
    lc = tree / "vendor" / "llama.cpp"  # wherever llama.cpp sat, it lands where the series expects it
    assert "moe_hook(10)" in (lc / "src" / "llama.cpp").read_text()
    assert "// new upstream line 4" in (lc / "src" / "llama.cpp").read_text()
    msg = _base_message(tree)
    if kind == "tarball":
        digest = "sha256:" + vendor.sha256_file(Path(onto[0]))
        assert f"sha256 {digest[7:]}" in r.stdout
        assert "Source: tarball" in msg and "llama.cpp at pkg-2.0/third_party/llama.cpp" in msg
        assert not (tree / "setup.py").exists()  # only the llama.cpp tree is taken
    else:
        if kind == "git":
            assert "Source: git checkout" in msg and "at v2 (commit " in msg
        else:
            assert "Source: directory" in msg
        # the digest recorded is the files digest of the tree taken (the base's vendor/llama.cpp),
        # which is that of the same files anywhere else
        same = tmp_path / "same"
        write_files(same, _newer_files())
        digest = trees.files_digest(same)
        base = tmp_path / "base"
        vendor._git(tree, "worktree", "add", "-q", "--detach", str(base), vendor.BASE_TAG)
        assert trees.files_digest(base / "vendor" / "llama.cpp") == digest
        assert f"files-sha256 {digest[len('files-sha256:'):]}" in r.stdout
    assert f"Digest: {digest}" in msg


@pytest.mark.parametrize("kind", ["dir", "tarball"])
def test_rebase_onto_a_fake_tree_stops_at_a_conflict_and_continues(tmp_path, fake_pin, kind):
    root, env = fake_pin
    onto, name = _newer(tmp_path, kind, conflict=True)
    r = _fake_cli(root, env, "rebase", "--onto", *onto)
    assert r.returncode == 1, r.stdout + r.stderr
    assert _rows(r.stdout) == {"0001-llama-a-hook-in-f10.patch": "conflicted",
                               "0002-llama-declare-the-hook.patch": "not reached"}
    tree = root / "vendor" / "rebase" / name
    rel = "vendor/llama.cpp/src/llama.cpp"
    assert (tree / ".git" / "rebase-apply").is_dir()
    assert "<<<<<<<" in (tree / rel).read_text()
    assert "git am --continue" in r.stdout
    subprocess.run(["git", "checkout", "--theirs", "--", rel], cwd=tree, check=True)
    subprocess.run(["git", "add", "--", rel], cwd=tree, check=True)
    r = _fake_cli(root, env, "rebase", "--continue", str(tree))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _rows(r.stdout) == {"0001-llama-a-hook-in-f10.patch": "fuzzy",
                               "0002-llama-declare-the-hook.patch": "clean"}
    assert "conflicts resolved by hand" in r.stdout


def test_rebase_dry_run_reports_every_patch_and_keeps_nothing(tmp_path, fake_pin):
    root, env = fake_pin
    onto, _ = _newer(tmp_path, "tarball", conflict=True)
    r = _fake_cli(root, env, "rebase", "--onto", *onto, "--dry-run")
    assert r.returncode == 1, r.stdout + r.stderr
    # 0001 conflicts and is skipped; 0002 (another file) is still tried
    assert _rows(r.stdout) == {"0001-llama-a-hook-in-f10.patch": "conflicted",
                               "0002-llama-declare-the-hook.patch": "clean"}
    assert "dry run: nothing kept" in r.stdout
    assert not (root / "vendor" / "rebase").exists()


def test_rebase_onto_a_whole_sdist_keeps_its_layout(tmp_path, fake_pin):
    root, env = fake_pin
    top = tmp_path / "up" / "fakecpp-2.0"
    write_files(top / "vendor" / "llama.cpp", _llama_files())
    (top / "pyproject.toml").write_text("")
    sd = tar_folder(tmp_path / "fakecpp-2.0.tar.gz", top, "fakecpp-2.0")
    r = _fake_cli(root, env, "rebase", "--onto", str(sd))
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(_rows(r.stdout).values()) == {"clean"}
    assert (root / "vendor" / "rebase" / "fakecpp-2.0" / "pyproject.toml").is_file()


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    none = tmp_path / "bad" / "none"
    write_files(none, {"include/llama.h": "", "README": ""})  # llama.h but no ggml/
    two = tmp_path / "bad" / "two"
    write_files(two / "a", _llama_files())
    write_files(two / "b", _llama_files())
    notar = tmp_path / "bad" / "notes.tar.gz"
    notar.write_text("not a tarball")
    two_tar = tar_folder(tmp_path / "bad" / "two.tar.gz", two, "two")
    none_tar = tar_folder(tmp_path / "bad" / "none.tar.gz", none, "none")
    onto, _ = _newer(tmp_path, "git")
    return [
        ([str(tmp_path / "missing")], "no such file or directory"),
        ([str(tmp_path / "missing.tar.gz")], "no such file or directory"),
        (["not a version!"], "neither an existing directory or tarball nor a version (accepted: 1.0)"),
        ([str(none)], "no llama.cpp tree in it"),
        ([str(none_tar)], "no llama.cpp tree in it"),
        ([str(two)], "2 llama.cpp trees in it (a, b)"),
        ([str(two_tar)], "2 llama.cpp trees in it (two/a, two/b)"),
        ([str(notar)], "not a tar archive"),
        ([str(two), "--ref", "HEAD"], "is not in a git checkout"),
        ([str(two_tar), "--ref", "HEAD"], "needs --onto to be a directory in a git checkout"),
        ([onto[0], "--ref", "no-such-tag"], "--ref no-such-tag: names no commit"),
    ]


def test_rebase_onto_bad_input_is_one_line_and_exit_2_before_any_work(tmp_path, fake_pin):
    root, env = fake_pin
    for args, want in _bad_inputs(tmp_path):
        r = _fake_cli(root, env, "rebase", "--onto", *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert want in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stdout == "" and not (root / "vendor" / "rebase").exists(), args
    r = _fake_cli(root, env, "rebase", "--continue", str(tmp_path), "--dry-run")
    assert r.returncode == 2 and "go with --onto" in r.stderr


def test_find_llama_cpp_at_any_depth():
    assert trees.find_llama_cpp(["include/llama.h", "ggml/CMakeLists.txt"]) == [""]
    assert trees.find_llama_cpp(["x/y/include/llama.h", "x/y/ggml/", "x/include/llama.h"]) == ["x/y"]
    # a tree inside another counts once, as the outer one
    assert trees.find_llama_cpp(["l/include/llama.h", "l/ggml/a", "l/t/include/llama.h", "l/t/ggml/b"]) == ["l"]
    assert trees.find_llama_cpp(["a/include/llama.h", "a/ggml/x", "b/include/llama.h", "b/ggml/x"]) == ["a", "b"]
    assert trees.find_llama_cpp(["include/llama.h", "ggmlx/y"]) == []
