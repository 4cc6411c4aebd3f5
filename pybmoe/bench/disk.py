"""The disk as the stream tier sees it: O_DIRECT reads of one expert projection at a time, on the tier's
read lanes, into fresh anonymous memory (:func:`probe`).

The stream tier reads each missed expert's projections (up, gate, down) from the GGUF with O_DIRECT,
straight into its place in the reservation, on 4 lanes. With its page frames (the default,
``docs/stream-tier.md``, "Page frames") that place holds pages an evicted expert gave back, already
allocated, so a read costs the device's time for that size; with ``PYBMOE_MOE_STREAM_FRAMES=0`` the
pages are fresh and the kernel's time to fault in and zero them adds to it (1.05 s of CPU per 2 GiB
here, against 0.09 s into mapped pages). The probe does the same on the model's own file: random
expert projections (distinct, from the expert tensors of the file), on ``lanes`` threads, each lane
into one buffer it reuses (``fresh=False``, the frames) or into a newly mapped anonymous buffer per
read (``fresh=True``), and reports MiB/s. It is the disk bandwidth
:func:`pybmoe.routing.sizing.predict_stream` wants (``pybmoe size --disk-mib-s``), measured at the
tier's own read size. The page cache plays no part (O_DIRECT), so no root is needed; run it on a
quiet machine, in the same session as the benchmark it explains (these disks vary 0.8 - 2 GB/s from
day to day).

Errors: :class:`ValueError` for a file without expert tensors or bad arguments; :class:`OSError` when
the file cannot be opened (with O_DIRECT: a file system that refuses it says so).
"""
from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIB = 2**20
ALIGN = 4096


@dataclass(frozen=True)
class DiskProbe:
    """One probe: ``mib_s`` MiB/s over ``reads`` reads of ``read_bytes`` bytes (the aligned window around
    one expert projection) on ``lanes`` threads, ``direct`` (O_DIRECT) or buffered, into ``fresh`` pages
    per read or one reused buffer per lane."""

    mib_s: float
    read_bytes: int
    lanes: int
    reads: int
    seconds: float
    direct: bool
    fresh: bool = False


def expert_windows(model: str | os.PathLike) -> tuple[list[tuple[int, int]], int]:
    """Every expert projection of the file as (aligned offset, aligned length), and the length of the
    largest one's window (bytes). Raises :class:`ValueError` for a file without expert tensors."""
    import gguf
    r = gguf.GGUFReader(str(model))
    out, size = [], 0
    for t in r.tensors:
        if not t.name.endswith("_exps.weight") or len(t.shape) != 3:
            continue
        n_expert = int(t.shape[-1])
        per = int(t.n_bytes) // n_expert
        for e in range(n_expert):
            off = int(t.data_offset) + e * per
            w0 = off & ~(ALIGN - 1)
            w1 = (off + per + ALIGN - 1) & ~(ALIGN - 1)
            out.append((w0, w1 - w0))
            size = max(size, w1 - w0)
    if not out:
        raise ValueError(f"{model} has no expert tensors (blk.N.*_exps.weight); accepted: a MoE GGUF")
    return out, size


def probe(model: str | os.PathLike, *, lanes: int = 4, total_mib: float = 256.0, seed: int = 0,
          fresh: bool = False) -> DiskProbe:
    """Reads about ``total_mib`` MiB of distinct random expert projections of ``model`` as the stream
    tier does (module doc) and returns the bandwidth. Raises :class:`ValueError` for ``lanes`` outside
    1 .. 64 or ``total_mib`` <= 0, or a file without expert tensors."""
    if not 1 <= lanes <= 64 or not total_mib > 0:
        raise ValueError(f"lanes={lanes}, total_mib={total_mib}; accepted: lanes 1 .. 64, total_mib > 0")
    windows, size = expert_windows(model)
    rng = np.random.default_rng(seed)
    n = min(len(windows), max(lanes, int(total_mib * MIB / size)))
    picks = [windows[i] for i in rng.choice(len(windows), size=n, replace=False)]
    direct = hasattr(os, "O_DIRECT")
    try:
        fd = os.open(str(model), os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError:
        direct = False
        fd = os.open(str(model), os.O_RDONLY)

    def lane(part: list[tuple[int, int]]) -> int:
        if fresh:  # each read into newly mapped anonymous pages: an admitted expert's place without frames
            got = 0
            for off, length in part:
                with mmap.mmap(-1, length) as buf:
                    got += os.preadv(fd, [memoryview(buf)], off)
            return got
        with mmap.mmap(-1, size) as buf:  # one buffer per lane, its pages allocated once, as a frame's
            buf.write(bytes(size))
            return sum(os.preadv(fd, [memoryview(buf)[:length]], off) for off, length in part)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(lanes) as ex:
            total = sum(ex.map(lane, [picks[i::lanes] for i in range(lanes)]))
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return DiskProbe(total / MIB / dt, size, lanes, n, dt, direct, fresh)
