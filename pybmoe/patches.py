"""The patch series against the pinned upstream: list, check and export.

``patches/series`` names ``NNNN-topic.patch`` files made by ``git format-patch``
from the commits of the vendored work tree (see :mod:`pybmoe.vendor`). Each patch
carries a DEP-3 style header in its message: a Description of why, ``Forwarded``
and ``Last-Update``.

Workflow::

    pybmoe vendor                  # materialise vendor/src/... with the series applied
    (edit + git commit inside vendor/src/llama_cpp_python-*/)
    pybmoe patches export          # rewrite patches/ from those commits
    pybmoe patches check           # the series applies cleanly to a fresh pin
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import vendor


def list_series(root: Path | None = None) -> list[tuple[str, str]]:
    """``[(file name, Subject)]`` of the series, in order."""
    root = root or vendor.project_root()
    out = []
    for p in vendor.series(root):
        m = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*)$", p.read_text(errors="replace"), re.M)
        out.append((p.name, m.group(1) if m else "?"))
    return out


def export(root: Path | None = None) -> list[str]:
    """Regenerate ``patches/*.patch`` and ``patches/series`` from the work tree's commits.

    The output is stable: exporting right after :func:`pybmoe.vendor.ensure_tree`
    reproduces the files byte for byte.

    Raises:
        VendorError: the work tree is missing or has uncommitted edits.
    """
    root = root or vendor.project_root()
    pin = vendor.load_pin(root)
    tree = vendor.tree_dir(root, pin)
    if not (tree / ".git").is_dir():
        raise vendor.VendorError(f"no work tree at {tree}; run `pybmoe vendor` first")
    if vendor.is_dirty(tree):
        raise vendor.DirtyTreeError(f"{tree} has uncommitted edits; commit them before exporting")
    pdir = root / "patches"
    with tempfile.TemporaryDirectory() as tmp:
        vendor._git(tree, "format-patch", "-q", "--no-signature", "--zero-commit", "--no-stat",
                    "--full-index", "-N", "-o", tmp, f"{vendor.BASE_TAG}..HEAD")
        new = sorted(Path(tmp).glob("*.patch"))
        for old in pdir.glob("*.patch"):
            old.unlink()
        pdir.mkdir(exist_ok=True)
        for p in new:
            shutil.copyfile(p, pdir / p.name)
    names = [p.name for p in new]
    (pdir / "series").write_text("".join(n + "\n" for n in names))
    (tree / ".git" / "pybmoe-series.sha256").write_text(vendor.series_digest(root))
    return names


def check(root: Path | None = None, log=print) -> bool:
    """Apply the series to a fresh copy of the pinned upstream; report per patch.

    Returns True when every patch applies cleanly.
    """
    root = root or vendor.project_root()
    pin = vendor.load_pin(root)
    sdist = vendor.fetch_sdist(pin, vendor.cache_dir())
    ok = True
    with tempfile.TemporaryDirectory(prefix="pybmoe-check-") as tmp:
        tree = Path(tmp) / pin.stem
        vendor.unpack(sdist, tree)
        for p in vendor.series(root):
            r = vendor._git(tree, "am", "-q", "--keep-cr", str(p), check=False)
            if r.returncode != 0:
                log(f"FAIL  {p.name}\n{(r.stdout + r.stderr).strip()}")
                vendor._git(tree, "am", "--abort", check=False)
                ok = False
                break
            log(f"ok    {p.name}")
    return ok


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="pybmoe patches", description="the patch series against the pinned upstream")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the series, in order")
    sub.add_parser("check", help="apply the series to a fresh pin; exit 0 when clean")
    sub.add_parser("export", help="rewrite patches/ from the vendored work tree's commits")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "list":
            for name, subject in list_series():
                print(f"{name}  {subject}")
            return 0
        if a.cmd == "check":
            return 0 if check() else 1
        if a.cmd == "export":
            for n in export():
                print(n)
            return 0
    except vendor.VendorError as e:
        print(f"pybmoe patches: error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
