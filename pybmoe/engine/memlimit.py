"""Run an engine binary under a memory limit, as on a device smaller than the model.

A :class:`MemoryLimit` is a child cgroup with a memory limit (cgroup v1's memory controller at
``/sys/fs/cgroup/memory``, or a cgroup v2 folder with ``memory.max``). :meth:`MemoryLimit.wrap`
turns a command into one that joins the cgroup before it starts, so the page cache the process
fills counts against the limit too: a memory-mapped model larger than the limit thrashes, as it
would on a phone or a small laptop. :func:`drop_caches` empties the page cache (root only), for
cold-cache runs; :func:`drop_file_cache` drops one file's pages (no root needed), and
:func:`cached_bytes` says how much of a file is cached.

Creating a cgroup needs root. :func:`limit_available` says whether it can be done here, and why
not; callers say so and run without a limit.

Errors: :class:`MemoryLimitError` (a :class:`RuntimeError`) names the path it could not write.
"""
from __future__ import annotations

import os
import shlex
import uuid
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


class MemoryLimitError(RuntimeError):
    """A cgroup could not be created, limited or joined."""


def _v2() -> bool:
    return (V2_ROOT / "cgroup.controllers").is_file() and "memory" in (V2_ROOT / "cgroup.controllers").read_text()


def limit_available() -> tuple[bool, str]:
    """(True, "") when this process can create a memory-limited cgroup, else (False, why)."""
    root = V1_ROOT if V1_ROOT.is_dir() else (V2_ROOT if _v2() else None)
    if root is None:
        return False, "no cgroup memory controller is mounted (neither /sys/fs/cgroup/memory nor cgroup v2 memory)"
    if not os.access(root, os.W_OK):
        return False, f"{root} is not writable (memory limits need root)"
    return True, ""


class MemoryLimit:
    """A child cgroup limited to ``limit_mib`` MiB (page cache included); a context manager that
    removes the cgroup on exit.

    Raises :class:`MemoryLimitError` when the cgroup cannot be created or limited, and
    :class:`ValueError` for a limit < 16 MiB.
    """

    def __init__(self, limit_mib: int, name: str | None = None):
        if limit_mib < 16:
            raise ValueError(f"limit_mib {limit_mib}; accepted: >= 16 MiB")
        ok, why = limit_available()
        if not ok:
            raise MemoryLimitError(why)
        self.limit_mib = int(limit_mib)
        self.v1 = V1_ROOT.is_dir()
        root = V1_ROOT if self.v1 else V2_ROOT
        self.path = root / (name or f"pybmoe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.path.mkdir(exist_ok=True)
            limit = str(self.limit_mib * 2**20)
            if self.v1:
                (self.path / "memory.limit_in_bytes").write_text(limit)
            else:
                (self.path / "memory.max").write_text(limit)
                (self.path / "memory.swap.max").write_text("0")
        except OSError as e:
            raise MemoryLimitError(f"cannot create the memory cgroup {self.path}: {e}") from e

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the cgroup (``sh -c 'echo $$ > cgroup.procs; exec cmd'``)."""
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {shlex.join(cmd)}"]

    def peak_mib(self) -> float | None:
        """The cgroup's peak memory use so far, MiB (v1 ``memory.max_usage_in_bytes``, v2
        ``memory.peak``), or None when the kernel does not report it."""
        f = self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        try:
            return int(f.read_text().split()[0]) / 2**20
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int | None:
        """How many processes the kernel's OOM killer has killed in this cgroup (v1
        ``memory.oom_control``'s ``oom_kill``, v2 ``memory.events``' ``oom_kill``), or None when the
        kernel does not count them."""
        return read_oom_kills(self.path, self.v1)

    def stat_mib(self) -> dict[str, float]:
        """The cgroup's memory now, MiB (:func:`read_stat_mib`). Raises :class:`OSError` when its
        ``memory.stat`` cannot be read."""
        return read_stat_mib(self.path, self.v1)

    def reset_peak(self) -> None:
        """Starts a new peak (v1 only; v2 keeps the peak of the cgroup's life)."""
        if self.v1:
            try:
                (self.path / "memory.max_usage_in_bytes").write_text("0")
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass  # a process still in it; the kernel removes nothing, the next run reuses no name

    def __enter__(self) -> "MemoryLimit":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_oom_kills(path: Path, v1: bool) -> int | None:
    """The ``oom_kill`` count of the cgroup folder ``path`` (v1: ``memory.oom_control``; v2:
    ``memory.events``), or None when the file or the field is missing (kernels before 4.13)."""
    f = Path(path) / ("memory.oom_control" if v1 else "memory.events")
    try:
        for line in f.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def read_stat_mib(path: Path, v1: bool) -> dict[str, float]:
    """The memory of the cgroup folder ``path`` now, MiB, from its ``memory.stat``: ``anon`` (v1
    ``total_rss``, v2 ``anon``) and ``mapped`` (file pages mapped into its processes: v1
    ``total_mapped_file``, v2 ``file_mapped``). Raises :class:`OSError` when the file cannot be read."""
    d = {}
    for line in (Path(path) / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            d[key] = int(value) / 2**20
    if v1:
        return {"anon": d.get("total_rss", 0.0), "mapped": d.get("total_mapped_file", 0.0)}
    return {"anon": d.get("anon", 0.0), "mapped": d.get("file_mapped", 0.0)}


_LOW_BIT = bytes(b & 1 for b in range(256))


def cached_bytes(path: str | os.PathLike) -> int:
    """Bytes of the file ``path`` in the page cache now (``mincore`` over a read-only mapping of it:
    the kernel's own count, a page at a time; the mapping touches no page). Raises :class:`OSError`
    when the file cannot be opened or mapped."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), os.fspath(path))
        try:
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), os.fspath(path))
            resident = bytes(vec).translate(_LOW_BIT).count(1)  # the low bit: resident (the others are reserved)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * page, size)


def drop_file_cache(path: str | os.PathLike) -> int:
    """Drops the file ``path``'s pages from the page cache (its dirty pages written back first, then
    ``posix_fadvise(POSIX_FADV_DONTNEED)``: no root needed), so that a process started after it reads
    the file from the disk and its memory limit counts those reads, whichever cgroup the pages were
    charged to before (the writer's, after ``pybmoe make-model``). Pages another process keeps mapped
    stay. Returns the bytes that were cached before. Raises :class:`OSError` when the file cannot be
    opened or the advice is refused."""
    before = cached_bytes(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # written-back pages can be dropped; dirty ones cannot
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return before


def drop_caches() -> bool:
    """Writes back dirty pages and empties the page cache (``sync``; ``echo 3 >
    /proc/sys/vm/drop_caches``); False when not permitted."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False
