"""The paths a user gives on the command line, checked before any work: each problem is one line naming
the option, the path and what is wrong with it (never an errno number or a traceback)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from .. import models

#: What an errno means for a path, in words (others: the system's own text, lower-cased).
_REASONS = {
    errno.ENOENT: "no such file or folder",
    errno.EACCES: "permission denied",
    errno.EPERM: "not permitted",
    errno.EROFS: "a read-only file system",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.EISDIR: "it is a folder",
    errno.EEXIST: "something else is already there",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.ENAMETOOLONG: "the name is too long",
}


def os_reason(e: OSError) -> str:
    """What went wrong in ``e``, in a few words (``no such file or folder``, ``permission denied``, ...)."""
    if e.errno in _REASONS:
        return _REASONS[e.errno]
    return (e.strerror or str(e)).lower()


def os_error_line(e: OSError, what: str = "") -> str:
    """One line for ``e``: its path (``e.filename``), ``what`` was being done, and why it failed."""
    path = f"{e.filename}: " if e.filename is not None else ""
    return f"{path}{what + ': ' if what else ''}{os_reason(e)}"


def out_dir_error(path: Path, option: str = "--out") -> str | None:
    """Why ``path`` cannot be the output folder, in one line, or None when it can. A folder that is
    there must be one this process can write into; a missing one is created as a trial (with its
    missing parents) and removed again, so that nothing is left behind when a later check refuses the
    command (the work creates it for good)."""
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            return f"{option} {path}: it is a file; accepted: a folder (created when missing)"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{option} {path}: the folder cannot be written (permission denied)"
        return None
    missing = [p for p in [path, *path.parents] if not (p.exists() or p.is_symlink())]
    try:
        path.mkdir(parents=True)
    except OSError as e:
        where = f" ({e.filename})" if e.filename is not None and Path(e.filename) != path else ""
        return (f"{option} {path}: cannot create the folder{where}: {os_reason(e)}; accepted: a folder that can be "
                "created and written")
    for p in missing:  # the deepest first
        try:
            p.rmdir()
        except OSError:
            break
    return None


def model_error(path: Path, option: str | None = None) -> str | None:
    """Why ``path`` is not a model llama.cpp loads, in one line that names the path (and ``option``,
    e.g. ``-m``, when given): :func:`pybmoe.models.check_gguf`: missing, a folder, empty, not GGUF,
    truncated. None when it is one."""
    try:
        models.check_gguf(path)
    except models.ModelFileError as e:
        return f"{option} {e}" if option else str(e)
    return None
