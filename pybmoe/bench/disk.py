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

``top_k`` reads as decode does instead (:func:`probe`'s ``top_k``): in layer steps, the layers in
file order as a token steps through them, each step ``top_k`` random distinct experts of its layer,
all their projections, consecutive experts merged into one read as the tier's ``read_jobs`` merges
them, the lanes taking the step's reads one by one and meeting at its end. That is the pattern of the
tier's decode misses (one layer's experts close together in the file, a few reads per step, the lanes
idle at each step's tail), which the random pattern lacks. Measured against the tier's own decode
reads (``docs/benchmarks/stream-dense-auto-2026-12-05/README.md``), it is steadier than the
random probe (638-1720 against 637-3687 MiB/s over one 18-setting run) but no closer to the tier's
rate, which swings by up to 3x between two runs of the same reads: the prediction was within 20 % at
15 of 36 points with it, 19 of 36 with the random probe, which stays the prediction's default.

``layout="record"`` (with ``top_k``) reads the same steps as one record per expert instead: the
expert's projections back to back (gate, up, down: the bytes of the three), the records of a layer in
expert order from the layer's first expert tensor on, consecutive experts merged into one read. That
is the sidecar layout of issue 23 ("read shape"), emulated on the GGUF's own bytes (the disk does not
care what the bytes are): each step reads exactly the bytes it reads in ``gguf`` layout, in one read
per run of experts instead of one per projection. ``docs/stream-tier.md``, "Read shape", has the
measurement.

Errors: :class:`ValueError` for a file without expert tensors or bad arguments; :class:`OSError` when
the file cannot be opened (with O_DIRECT: a file system that refuses it says so).
"""
from __future__ import annotations

import mmap
import os
import threading
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
    one expert projection; with ``top_k``, the largest read of the steps) on ``lanes`` threads,
    ``direct`` (O_DIRECT) or buffered, into ``fresh`` pages per read or one reused buffer per lane."""

    mib_s: float
    read_bytes: int
    lanes: int
    reads: int
    seconds: float
    direct: bool
    fresh: bool = False
    top_k: int | None = None  # decode's layer steps of top_k experts (read_bytes: the largest read), or random
    layout: str = "gguf"  # with top_k: "gguf" (one read per projection and run) or "record" (one per run)


def _expert_tensors(model: str | os.PathLike) -> list[tuple[int, int, int, int]]:
    """Every expert tensor of the file as (layer, data offset, bytes per expert, experts), in file order.
    Raises :class:`ValueError` for a file without expert tensors."""
    import gguf
    out = []
    for t in gguf.GGUFReader(str(model)).tensors:
        if not t.name.endswith("_exps.weight") or len(t.shape) != 3:
            continue
        n_expert = int(t.shape[-1])
        out.append((int(t.name.split(".")[1]), int(t.data_offset), int(t.n_bytes) // n_expert, n_expert))
    if not out:
        raise ValueError(f"{model} has no expert tensors (blk.N.*_exps.weight); accepted: a MoE GGUF")
    return out


def _window(begin: int, end: int) -> tuple[int, int]:
    """The aligned window around bytes [begin, end) as (offset, length), as an O_DIRECT read takes it."""
    w0 = begin & ~(ALIGN - 1)
    return w0, ((end + ALIGN - 1) & ~(ALIGN - 1)) - w0


def _open(model: str | os.PathLike) -> tuple[int, bool]:
    """The file opened with O_DIRECT where it can be, else buffered: (fd, direct)."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(str(model), os.O_RDONLY | os.O_DIRECT), True
        except OSError:
            pass
    return os.open(str(model), os.O_RDONLY), False


def expert_windows(model: str | os.PathLike) -> tuple[list[tuple[int, int]], int]:
    """Every expert projection of the file as (aligned offset, aligned length), and the length of the
    largest one's window (bytes). Raises :class:`ValueError` for a file without expert tensors."""
    out = [_window(off + e * per, off + (e + 1) * per)
           for _, off, per, n_expert in _expert_tensors(model) for e in range(n_expert)]
    return out, max(n for _, n in out)


def expert_layers(model: str | os.PathLike) -> dict[int, list[tuple[int, int, int]]]:
    """Each MoE layer's expert tensors as (data offset, bytes per expert, experts), in file order, by
    layer index. Raises :class:`ValueError` for a file without expert tensors."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for il, off, per, n_expert in _expert_tensors(model):
        out.setdefault(il, []).append((off, per, n_expert))
    return {il: sorted(ts) for il, ts in sorted(out.items())}


def _runs(experts: np.ndarray) -> list[tuple[int, int]]:
    """The runs of consecutive ids among ``experts`` (sorted), as (first, last + 1)."""
    out = []
    i = 0
    while i < len(experts):
        j = i + 1
        while j < len(experts) and experts[j] == experts[j - 1] + 1:
            j += 1
        out.append((int(experts[i]), int(experts[j - 1]) + 1))
        i = j
    return out


def step_reads(tensors: list[tuple[int, int, int]], experts: np.ndarray) -> list[tuple[int, int]]:
    """One layer step's reads (aligned offset, aligned length): per expert tensor, one read per run of
    consecutive ids among ``experts`` (sorted), as the tier's ``read_jobs`` makes them."""
    runs = _runs(experts)
    return [_window(off + a * per, off + b * per) for off, per, _ in tensors for a, b in runs]


def record_reads(tensors: list[tuple[int, int, int]], experts: np.ndarray) -> list[tuple[int, int]]:
    """One layer step's reads (aligned offset, aligned length) in the record layout (module doc): expert
    ``e``'s record of ``sum(per)`` bytes at the layer's first tensor offset + ``e * sum(per)``, one read
    per run of consecutive ids among ``experts`` (sorted)."""
    base, rec = min(off for off, _, _ in tensors), sum(per for _, per, _ in tensors)
    return [_window(base + a * rec, base + b * rec) for a, b in _runs(experts)]


def _probe_steps(model, lanes: int, total_mib: float, seed: int, top_k: int, layout: str = "gguf") -> DiskProbe:
    layers = expert_layers(model)
    shape = step_reads if layout == "gguf" else record_reads
    rng = np.random.default_rng(seed)
    ids = list(layers)
    steps, n_bytes, biggest = [], 0, 0
    while n_bytes < total_mib * MIB:  # tokens: the layers in order, as decode steps through them
        ts = layers[ids[len(steps) % len(ids)]]
        reads = shape(ts, np.sort(rng.choice(ts[0][2], size=min(top_k, ts[0][2]), replace=False)))
        steps.append(reads)
        n_bytes += sum(n for _, n in reads)
        biggest = max(biggest, *(n for _, n in reads))
    fd, direct = _open(model)
    local = threading.local()

    def one(read: tuple[int, int]) -> int:
        if getattr(local, "buf", None) is None:  # one buffer per lane, its pages allocated once, as a frame's
            local.buf = mmap.mmap(-1, biggest)
            local.buf.write(bytes(biggest))
        with memoryview(local.buf) as mv:
            return os.preadv(fd, [mv[:read[1]]], read[0])

    try:
        with ThreadPoolExecutor(lanes) as ex:
            list(ex.map(one, [(0, min(biggest, ALIGN))] * lanes))  # the lanes' buffers, before the clock
            t0 = time.perf_counter()
            total = sum(sum(ex.map(one, reads)) for reads in steps)  # the lanes meet at each step's end
            dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return DiskProbe(total / MIB / dt, biggest, lanes, sum(len(r) for r in steps), dt, direct, False, top_k, layout)


def probe(model: str | os.PathLike, *, lanes: int = 4, total_mib: float = 256.0, seed: int = 0,
          fresh: bool = False, top_k: int | None = None, layout: str = "gguf") -> DiskProbe:
    """Reads about ``total_mib`` MiB of distinct random expert projections of ``model`` as the stream
    tier does (module doc) and returns the bandwidth; with ``top_k``, in decode's layer steps of
    ``top_k`` experts each instead (module doc; ``fresh`` does not apply), in the GGUF's layout or,
    with ``layout="record"``, one record per expert (module doc; the same seed reads the same experts
    either way). Raises :class:`ValueError` for ``lanes`` outside 1 .. 64, ``total_mib`` <= 0,
    ``top_k`` < 1, ``fresh`` with ``top_k``, a ``layout`` other than gguf or record (record only with
    ``top_k``), or a file without expert tensors."""
    if (not 1 <= lanes <= 64 or not total_mib > 0 or (top_k is not None and (top_k < 1 or fresh))
            or layout not in ("gguf", "record") or (layout == "record" and top_k is None)):
        raise ValueError(f"lanes={lanes}, total_mib={total_mib}, top_k={top_k}, fresh={fresh}, layout={layout!r}; "
                         "accepted: lanes 1 .. 64, total_mib > 0, top_k None or >= 1 and not with fresh, layout "
                         "gguf or record (record with top_k)")
    if top_k is not None:
        return _probe_steps(model, lanes, total_mib, seed, top_k, layout)
    windows, size = expert_windows(model)
    rng = np.random.default_rng(seed)
    n = min(len(windows), max(lanes, int(total_mib * MIB / size)))
    picks = [windows[i] for i in rng.choice(len(windows), size=n, replace=False)]
    fd, direct = _open(model)

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
