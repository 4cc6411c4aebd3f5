"""``pybmoe vendor``: fetch, verify, unpack and patch the pinned upstream (:mod:`pybmoe.build.vendor`).

CMake's configure step runs it as ``python -m pybmoe.cli vendor`` and reads the patched tree's
path from the last line of its output.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ..build import vendor
from ..build.vendor import VendorError, cache_dir, ensure_tree, load_pin, project_root, tree_dir, verify_sdist


def _into_cache(path: Path, source) -> None:
    """Verify the local sdist ``path`` against ``source`` (the pin or its ``[engine]``) and put it
    where :func:`ensure_tree` looks for it. Raises HashMismatchError (a VendorError)."""
    verify_sdist(path, source)
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    if path.resolve() != (cache / source.filename).resolve():
        shutil.copyfile(path, cache / source.filename)


def local_file_error(flag: str, path: Path | None) -> str | None:
    """Why ``path``, given as ``flag``, is not a local sdist to read (no such file, a directory, not a
    regular file), in one line; None when it is one or was not given."""
    if path is None or path.is_file():
        return None
    what = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "no such file"
    return f"{flag} {path}: {what}; accepted: a local .tar.gz sdist (its sha256 is checked against the pin)"


def main(argv: list[str] | None = None) -> int:
    """``pybmoe vendor [--force] [--sdist FILE] [--engine-sdist FILE]``; returns the exit status: 0, or 2
    with one line on stderr (a local sdist that is not a file, one that fails its sha256, a dirty tree, a
    patch that does not apply)."""
    ap = argparse.ArgumentParser(prog="pybmoe vendor", description=vendor.__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="discard uncommitted edits in the vendored tree")
    ap.add_argument("--sdist", type=Path, help="use this local sdist file instead of downloading "
                    "(still verified against the pinned sha256)")
    ap.add_argument("--engine-sdist", type=Path, help="use this local file as the engine's sdist ([engine] of "
                    "vendor/upstream.toml) instead of downloading it (still verified against its sha256)")
    a = ap.parse_args(argv)
    for flag, path in (("--sdist", a.sdist), ("--engine-sdist", a.engine_sdist)):
        why = local_file_error(flag, path)
        if why:
            print(f"pybmoe vendor: error: {why}", file=sys.stderr)
            return 2
    try:
        root = project_root()
        pin = load_pin(root)
        local = [(a.sdist, pin)]
        if a.engine_sdist:
            if not pin.engine:
                raise VendorError("--engine-sdist: vendor/upstream.toml pins no [engine] sdist")
            local.append((a.engine_sdist, pin.engine))
        for path, source in local:
            if path:
                _into_cache(path, source)
                if tree_dir(root, pin).exists() and a.force:
                    shutil.rmtree(tree_dir(root, pin))
        print(ensure_tree(root, force=a.force))
    except VendorError as e:
        print(f"pybmoe vendor: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
