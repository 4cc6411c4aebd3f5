"""``pybmoe sweep``: benchmark sweeps of the expert cache with the patched ``llama-bench``.

A sweep runs every point of a grid (slots per layer, insert cap, ubatch, threads, backend)
through ``llama-bench`` once per repeat, prompt processing and token generation as **separate**
runs (``-p N -n 0`` and ``-p 0 -n N``, so prefill never leaks into a decode figure), with the
cache off (``slots = 0``) interleaved with every cache-on point of the same configuration, and
the order of the slot counts reversed on every other repeat so that slow drift of the machine
falls on both sides. Each run is its own ``llama-bench`` process (``-r 1 -v``): a fresh model,
so the cache's counters in its ``moe-cache:`` summary line (printed when the context is freed,
covering llama-bench's warm-up and the measured run) belong to that run alone.

Backends:

- ``rpc``: a loopback ``ggml-rpc-server`` started by the sweep stands in for the device
  (``--rpc EP -ngl 99 -ncmoe 99 --repack 0``). It is the same CPU behind a socket, so the cache
  is **not** expected to be faster there; the sweep measures its overhead and checks its hit
  rate and uploads.
- ``gpu``: the local accelerator (``-ngl 99 -ncmoe 99 --repack 0``), experts in host memory.
- ``auto``: ``gpu`` when ``llama-bench --list-devices`` lists a device, else ``rpc``.

``--repack 0`` keeps the host experts in the GGUF layout: the cache's host chain needs the
plain CPU ``mul_mat_id`` (the one that honours the skip table).

Outputs, in the output folder:

- ``sweep.csv``: one row per run. llama-bench's own CSV columns (``n_prompt``, ``n_gen``,
  ``n_threads``, ``n_ubatch``, ``avg_ts`` tok/s, ``avg_ns``, ...) plus ``mode`` (``pp`` | ``tg``),
  ``repeat`` (0-based), ``backend``, ``slots`` (requested slots per layer, 0 = off),
  ``inserts`` (uploads per layer per step, 0 = unlimited), the cache columns of
  :func:`pybmoe.engine.cache_record` (``hit_pct`` percent, ``resident_mib`` MiB, ``uploads``
  experts, ``upload_mib`` MiB, ``steps`` graphs served, ``budget_mib`` MiB, ``slot_mib`` MiB,
  ``below_cycle``), and ``overflow`` / ``overflow_reason`` (see below). ``hit_pct`` is NaN when
  the cache is off, and 0 for ``pp`` rows: prompt batches use the stock graph today.
- ``sweep-summary.csv``: per point and mode, ``n`` runs, ``median_ts`` / ``min_ts`` /
  ``max_ts`` tok/s, ``baseline_ts`` (median of the cache-off runs of the same backend,
  threads, ubatch and mode), ``ratio`` = ``median_ts / baseline_ts``, ``median_hit_pct``,
  ``median_resident_mib``, ``median_uploads`` and ``overflow`` (any run overflowed).
- ``sweep-pp.png``, ``sweep-tg.png``: tok/s (median, min–max bars) and hit % against slots,
  with the cache-off median drawn as a horizontal line (:func:`pybmoe.plot.sweep_plot`).
- ``logs/``: each run's stderr, named after the run.

**Overflow.** A run whose configuration spills device memory is marked (``overflow = True``,
``avg_ts`` kept, or NaN when it failed) rather than reported as a slow point:
allocation errors in its log (``cudaMalloc failed``, ``failed to allocate``, ``out of
memory``, a backend ``falling back to`` another allocator), the cache's own refusals
(``moe-cache: cannot allocate ...``, ``N slots/layer need X MiB on DEV ... free``,
``auto resolved to 0 slots``, ``auto sizing left no
device``), or device buffers (model + KV + compute + cache, parsed from the load log) above the
free memory the device reported at load minus ``floor_mib``.

Speculative decoding is not an axis: ``llama-bench`` has no draft model; request-level
figures through ``llama-server`` are future work.

Errors: :class:`ValueError` for bad arguments (raised before anything runs), and
:class:`pybmoe.engine.EngineError` when ``llama-bench`` fails without an overflow explaining it.
"""
from __future__ import annotations

import argparse
import io
import itertools
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from . import engine

BACKENDS = ("auto", "rpc", "gpu")
MODES = ("pp", "tg")
#: Columns added to llama-bench's own, in this order.
CACHE_COLUMNS = ("mode", "repeat", "backend", "slots", "inserts", "hit_pct", "resident_mib", "uploads",
                 "upload_mib", "steps", "budget_mib", "slot_mib", "below_cycle", "overflow", "overflow_reason")
#: Point keys: one cache-off baseline per (backend, n_threads, n_ubatch, mode).
BASE_KEYS = ("backend", "n_threads", "n_ubatch", "mode")
POINT_KEYS = BASE_KEYS + ("slots", "inserts")

# Log lines that mean the configuration did not fit on the device (see the module docstring).
_OVERFLOW = re.compile(
    r"(cudaMalloc failed[^\n]*|failed to allocate[^\n]*|out of memory[^\n]*|ErrorOutOfDeviceMemory[^\n]*"
    r"|falling back to [^\n]*|moe-cache: cannot allocate[^\n]*|moe-cache: \d+ slots/layer need [^\n]*"
    r"|moe-cache: WARNING auto resolved to 0 slots[^\n]*"
    r"|moe-cache: WARNING auto sizing left no device[^\n]*)", re.I)
_DEV_FREE = re.compile(r"using device (\S+) \(.*?\).*? - (\d+) MiB free")
_BUF = re.compile(r"(?:load_tensors|llama_kv_cache|sched_reserve):\s+(\S+)\s+(?:model|KV|compute) buffer size =\s+"
                  r"([0-9.]+) MiB")


@dataclass(frozen=True)
class Point:
    """One configuration of the grid (a run per mode and repeat).

    ``slots``: slots per layer (0 = cache off); ``inserts``: uploads per layer per step
    (0 = unlimited); ``ubatch`` tokens; ``threads`` host threads; ``backend`` ``rpc`` | ``gpu``.
    """

    slots: int
    inserts: int
    ubatch: int
    threads: int
    backend: str


@dataclass
class SweepResult:
    """What :func:`sweep` wrote: the tidy frame, the summary frame and the file paths."""

    runs: pd.DataFrame
    summary: pd.DataFrame
    csv: Path
    summary_csv: Path
    plots: list[Path]


def _ints(name: str, values: Sequence[int], lo: int) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name}: {v!r} is not an integer >= {lo}; accepted: integers >= {lo}")
        out.append(int(v))
    if not out:
        raise ValueError(f"{name}: no value given; accepted: one or more integers >= {lo}")
    return list(dict.fromkeys(out))


def grid(slots: Sequence[int], inserts: Sequence[int], ubatch: Sequence[int], threads: Sequence[int],
         backends: Sequence[str]) -> list[Point]:
    """The points of a sweep. The cache-off point (``slots = 0``) appears once per backend,
    threads and ubatch, whatever the insert caps, with ``inserts = 0``.

    Raises :class:`ValueError` for a negative slot count or insert cap, a ubatch or thread count
    below 1, or an unknown backend.
    """
    slots = _ints("slots", slots, 0)
    inserts = _ints("inserts", inserts, 0)
    ubatch = _ints("ubatch", ubatch, 1)
    threads = _ints("threads", threads, 1)
    for b in backends:
        if b not in ("rpc", "gpu"):
            raise ValueError(f"backend {b!r} is not supported; accepted: rpc, gpu (or auto)")
    pts: list[Point] = []
    for b, t, u, s in itertools.product(dict.fromkeys(backends), threads, ubatch, slots):
        for i in ([0] if s == 0 else inserts):
            pts.append(Point(s, i, u, t, b))
    return list(dict.fromkeys(pts))


def detect_backend() -> str:
    """``gpu`` when the patched ``llama-bench --list-devices`` lists a device, else ``rpc``."""
    exe = engine.find_binary("llama-bench")
    r = subprocess.run([str(exe), "--list-devices"], capture_output=True, text=True, timeout=120)
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines()]
    try:
        devs = lines[lines.index("Available devices:") + 1:]
    except ValueError:
        return "rpc"
    return "gpu" if any(d and d != "(none)" and ":" in d for d in devs) else "rpc"


def overflow_reason(log: str, floor_mib: float = 0.0) -> str | None:
    """Why a run's log says its configuration spilled device memory, or None.

    Checks, in order: allocation errors and the cache's refusals (the line itself is returned),
    then the device buffers (model + KV + compute + cache MiB, per device, from the load log)
    against the free MiB the device reported at load minus ``floor_mib``.
    """
    m = _OVERFLOW.search(log)
    if m:
        return m.group(1).strip()
    free = {name: float(mib) for name, mib in _DEV_FREE.findall(log)}
    if not free:
        return None
    used: dict[str, float] = {}
    compute: dict[str, float] = {}
    for line in log.splitlines():
        b = _BUF.search(line)
        if not b:
            continue
        buf, mib = b.group(1), float(b.group(2))
        dev = next((d for d in free if buf.startswith(d)), None)
        if dev is None:
            continue
        if "compute buffer" in line:
            compute[dev] = max(compute.get(dev, 0.0), mib)
        else:
            used[dev] = used.get(dev, 0.0) + mib
    pre = engine.parse_cache_preamble(log) or {}
    for buf, mib in (pre.get("budget_mib") or {}).items():
        dev = next((d for d in free if buf.startswith(d)), None)
        if dev is not None:
            used[dev] = used.get(dev, 0.0) + mib
    for dev, f in free.items():
        total = used.get(dev, 0.0) + compute.get(dev, 0.0)
        if total > f - floor_mib:
            return f"{dev}: buffers {total:.1f} MiB > {f:.0f} MiB free - {floor_mib:.0f} MiB floor"
    return None


def _backend_args(backend: str, rpc_endpoint: str | None) -> list[str]:
    args = ["-ngl", "99", "-ncmoe", "99", "--repack", "0"]
    if backend == "rpc":
        assert rpc_endpoint
        args = ["--rpc", rpc_endpoint, *args]
    return args


def bench_command(model: Path, point: Point, mode: str, *, n_prompt: int, n_gen: int,
                  rpc_endpoint: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The ``llama-bench`` command line of one run (one mode, one repetition, CSV on stdout)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; accepted: {', '.join(MODES)}")
    pn = ["-p", str(n_prompt), "-n", "0"] if mode == "pp" else ["-p", "0", "-n", str(n_gen)]
    return [str(engine.find_binary("llama-bench")), "-m", str(model), *pn, "-r", "1", "-o", "csv", "-v",
            "-t", str(point.threads), "-ub", str(point.ubatch),
            *_backend_args(point.backend, rpc_endpoint),
            *engine.cache_args(point.slots, point.inserts), *extra_args]


def run_point(model: Path, point: Point, mode: str, *, n_prompt: int, n_gen: int, rpc_endpoint: str | None = None,
              extra_args: Sequence[str] = (), log_path: Path | None = None, floor_mib: float = 0.0,
              timeout_s: float = 1800) -> dict:
    """Run ``llama-bench`` once and return its row (a dict of :data:`CACHE_COLUMNS` less
    ``repeat``, plus llama-bench's columns).

    Raises :class:`pybmoe.engine.EngineError` when it fails and its log shows no overflow.
    """
    cmd = bench_command(model, point, mode, n_prompt=n_prompt, n_gen=n_gen, rpc_endpoint=rpc_endpoint,
                        extra_args=extra_args)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        out, log, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        log = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        log += f"\n(timed out after {timeout_s:.0f} s)"
        rc = 124
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(log)
    reason = overflow_reason(log, floor_mib)
    rows = []
    if rc == 0:
        text = "\n".join(ln for ln in out.splitlines() if ln.strip())
        rows = pd.read_csv(io.StringIO(text)).to_dict("records") if text else []
    if rc != 0 or len(rows) != 1:
        if reason is None:
            raise engine.EngineError(f"llama-bench exited with code {rc} ({len(rows)} result rows): {' '.join(cmd)}\n"
                                     f"{log[-4000:]}")
        rows = [{}]
    rec = engine.cache_record(log)
    row = dict(rows[0])
    row.update(mode=mode, backend=point.backend, slots=point.slots, inserts=point.inserts,
               hit_pct=rec["hit_pct"] if point.slots else np.nan,
               resident_mib=rec["resident_mib"] if point.slots else 0.0,
               uploads=rec["uploads"] if point.slots else 0,
               upload_mib=rec["upload_mib"] if point.slots else 0.0,
               steps=rec["steps"], budget_mib=rec["budget_mib"], slot_mib=rec["slot_mib"],
               below_cycle=rec["below_cycle"], overflow=reason is not None, overflow_reason=reason or "")
    row.setdefault("n_threads", point.threads)
    row.setdefault("n_ubatch", point.ubatch)
    row.setdefault("avg_ts", np.nan)
    return row


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """Medians per point and mode, and the ratio to the cache-off median (see the module docstring)."""
    g = runs.groupby(list(POINT_KEYS), sort=True, dropna=False)
    s = g.agg(n=("avg_ts", "size"), median_ts=("avg_ts", "median"), min_ts=("avg_ts", "min"),
              max_ts=("avg_ts", "max"), median_hit_pct=("hit_pct", "median"),
              median_resident_mib=("resident_mib", "median"), median_uploads=("uploads", "median"),
              overflow=("overflow", "any")).reset_index()
    base = s[s["slots"] == 0].set_index(list(BASE_KEYS))["median_ts"].rename("baseline_ts")
    s = s.join(base, on=list(BASE_KEYS))
    s["ratio"] = s["median_ts"] / s["baseline_ts"]
    cols = list(POINT_KEYS) + ["n", "median_ts", "min_ts", "max_ts", "baseline_ts", "ratio", "median_hit_pct",
                               "median_resident_mib", "median_uploads", "overflow"]
    return s[cols]


def sweep(model: str | os.PathLike, out_dir: str | os.PathLike, *, slots: Sequence[int] = (0, 8),
          inserts: Sequence[int] = (0,), ubatch: Sequence[int] = (512,), threads: Sequence[int] | None = None,
          backends: Sequence[str] = ("auto",), repeats: int = 3, n_prompt: int = 128, n_gen: int = 64,
          modes: Sequence[str] = MODES, rpc_threads: int | None = None, floor_mib: float = 0.0,
          extra_args: Sequence[str] = (), progress: bool = True, plots: bool = True) -> SweepResult:
    """Run a sweep and write ``sweep.csv``, ``sweep-summary.csv`` and the plots into ``out_dir``.

    ``slots`` slots per layer (0 = cache off; it is added when missing, as the baseline);
    ``inserts`` uploads per layer per step; ``ubatch`` tokens; ``threads`` host threads
    (default: the CPU count); ``backends`` any of :data:`BACKENDS`; ``repeats`` runs per point
    and mode; ``n_prompt`` / ``n_gen`` tokens of the pp / tg runs; ``rpc_threads`` threads of the
    loopback ``ggml-rpc-server`` (default: its own default); ``floor_mib`` MiB a device must keep
    free (overflow check); ``extra_args`` go to every ``llama-bench`` run.

    Raises :class:`ValueError` (bad arguments, before anything runs), :class:`FileNotFoundError`
    (no model file) or :class:`pybmoe.engine.EngineError` (a failed run).
    """
    model = Path(model)
    if not model.is_file():
        raise FileNotFoundError(f"model {model} not found; accepted: a GGUF file")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    for name, v in (("n_prompt", n_prompt), ("n_gen", n_gen)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1 (tokens)")
    modes = list(dict.fromkeys(modes))
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode {m!r}; accepted: {', '.join(MODES)}")
    slots = _ints("slots", slots, 0)
    if 0 not in slots:
        slots = [0, *slots]
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"backend {b!r} is not supported; accepted: {', '.join(BACKENDS)}")
    threads = threads or [os.cpu_count() or 1]
    resolved = list(dict.fromkeys(detect_backend() if b == "auto" else b for b in backends))
    points = grid(slots, inserts, ubatch, threads, resolved)
    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)

    total = len(points) * len(modes) * repeats
    rpc = engine.RpcServer(threads=rpc_threads, log_dir=out_dir / "logs") if "rpc" in resolved else None
    rows: list[dict] = []
    from tqdm import tqdm
    bar = tqdm(total=total, desc="sweep", unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    try:
        if rpc:
            rpc.start()
        for rep in range(repeats):
            # every other repeat runs the slot counts in reverse: drift falls on both sides
            order = points if rep % 2 == 0 else sorted(points, key=lambda p: -p.slots)
            order = sorted(order, key=lambda p: (p.backend, p.threads, p.ubatch))  # stable: keeps the slot order
            for p in order:
                for mode in modes:
                    bar.set_postfix_str(f"{mode} slots={p.slots} ins={p.inserts} ub={p.ubatch} t={p.threads} "
                                        f"{p.backend} r{rep}")
                    name = f"{mode}-s{p.slots}-i{p.inserts}-ub{p.ubatch}-t{p.threads}-{p.backend}-r{rep}.log"
                    row = run_point(model, p, mode, n_prompt=n_prompt, n_gen=n_gen,
                                    rpc_endpoint=rpc.endpoint if rpc else None, extra_args=extra_args,
                                    log_path=out_dir / "logs" / name, floor_mib=floor_mib)
                    row["repeat"] = rep
                    rows.append(row)
                    bar.update(1)
    finally:
        bar.close()
        if rpc:
            rpc.stop()

    runs = pd.DataFrame(rows)
    bench_cols = [c for c in runs.columns if c not in CACHE_COLUMNS]
    runs = runs[bench_cols + list(CACHE_COLUMNS)]
    runs["overflow"] = runs["overflow"].astype(bool)
    summary = summarize(runs)
    csv = out_dir / "sweep.csv"
    runs.to_csv(csv, index=False)
    summary_csv = out_dir / "sweep-summary.csv"
    summary.to_csv(summary_csv, index=False)
    pngs: list[Path] = []
    if plots:
        from .plot import sweep_plot
        for mode in modes:
            sub = runs[runs["mode"] == mode]
            if len(sub):
                n = n_prompt if mode == "pp" else n_gen
                pngs.append(sweep_plot(sub, out_dir / f"sweep-{mode}.png",
                                       title=f"{model.name}: {mode}{n} ({'prefill' if mode == 'pp' else 'decode'}), "
                                             f"{repeats} repeats"))
    return SweepResult(runs, summary, csv, summary_csv, pngs)


def _list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe sweep -m MODEL --slots 0,8 [--repeats N] --out DIR ...``; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="pybmoe sweep",
        description="Benchmark the expert cache with llama-bench: pp and tg separately, cache off interleaved "
                    "with cache on, several repeats, medians and ratios; writes DIR/sweep.csv, "
                    "DIR/sweep-summary.csv and DIR/sweep-{pp,tg}.png.")
    ap.add_argument("-m", "--model", type=Path, required=True, help="GGUF model")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--slots", type=_list, default=[0, 8], help="slots per layer, comma-separated (0 = off; "
                                                                 "always included) (default 0,8)")
    ap.add_argument("--inserts", type=_list, default=[0], help="insert caps (uploads per layer per step, "
                                                               "0 = unlimited) (default 0)")
    ap.add_argument("--ubatch", type=_list, default=[512], help="ubatch sizes in tokens (default 512)")
    ap.add_argument("--threads", type=_list, default=None, help="host threads (default: the CPU count)")
    ap.add_argument("--backend", default="auto", help="comma-separated: auto, rpc (loopback ggml-rpc-server), "
                                                      "gpu (the local device) (default auto)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point and mode (default 3)")
    ap.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens of the pp runs (default 128)")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="generated tokens of the tg runs (default 64)")
    ap.add_argument("--modes", default="pp,tg", help="pp, tg or pp,tg (default)")
    ap.add_argument("--rpc-threads", type=int, default=None, help="threads of the loopback rpc server")
    ap.add_argument("--floor-mb", type=float, default=0.0, help="MiB each device must keep free (overflow check)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--bench-args", default="", help="extra llama-bench arguments, one string (e.g. '-fa on')")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        res = sweep(a.model, a.out, slots=a.slots, inserts=a.inserts, ubatch=a.ubatch, threads=a.threads,
                    backends=[b.strip() for b in a.backend.split(",") if b.strip()], repeats=a.repeats,
                    n_prompt=a.n_prompt, n_gen=a.n_gen, modes=[m.strip() for m in a.modes.split(",") if m.strip()],
                    rpc_threads=a.rpc_threads, floor_mib=a.floor_mb, extra_args=a.bench_args.split(),
                    progress=not a.no_progress)
    except (ValueError, FileNotFoundError, engine.EngineError) as e:
        print(f"pybmoe sweep: error: {e}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(format_summary(res.summary))
    print(f"\n{res.csv}\n{res.summary_csv}")
    for p in res.plots:
        print(p)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


def format_summary(summary: pd.DataFrame) -> str:
    """The summary as a Markdown table (tok/s medians, ratio to cache off, hit %, uploads)."""
    cols = ["mode", "backend", "n_threads", "n_ubatch", "slots", "inserts", "n", "median_ts", "baseline_ts", "ratio",
            "median_hit_pct", "median_resident_mib", "median_uploads", "overflow"]
    s = summary[cols].copy()
    for c in ("median_ts", "baseline_ts"):
        s[c] = s[c].map(lambda v: f"{v:.1f}")
    s["ratio"] = s["ratio"].map(lambda v: f"{v:.3f}")
    s["median_hit_pct"] = s["median_hit_pct"].map(lambda v: "–" if pd.isna(v) else f"{v:.1f}")
    s["median_resident_mib"] = s["median_resident_mib"].map(lambda v: f"{v:.1f}")
    s["median_uploads"] = s["median_uploads"].map(lambda v: f"{v:.0f}")
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "\n".join("| " + " | ".join(str(v) for v in r) + " |" for r in s.itertuples(index=False))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
