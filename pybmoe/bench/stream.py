"""``pybmoe bench-stream``: the stream tier against stock mmap on a model larger than a memory limit.

Every point runs ``llama-bench`` on the CPU (``-ngl 0 --repack 0``), prompt processing and token
generation as separate runs (``-p N -n 0`` and ``-p 0 -n N``, one repetition each, so prefill never
leaks into a decode figure), under one memory limit (:class:`pybmoe.engine.memlimit.MemoryLimit`: a
cgroup that counts the page cache too) and from a cold page cache (:func:`drop_caches`) unless
stated:

- ``mmap``: stock llama.cpp, the experts memory-mapped;
- ``defaults``: ``--moe-stream-cache-mb auto`` and no other flag of the tier: what a user who types
  only that gets (the auto floor, ``--dense-weights auto``); the headline point;
- ``stream:B``: ``--moe-stream-cache-mb B`` (``B`` MiB or ``auto``), the experts read from the GGUF
  into a RAM cache of that budget, the dense policy the engine's default (``auto``), and
  ``--moe-stream-floor-mb`` when ``floor_mib`` is given;
- ``stream:B+mmap``, ``stream:B+warm``, ``stream:B+anon``: the same with ``--dense-weights
  mmap|warm|anon`` (the dense policies, at every budget given);
- ``resident``: mmap without the limit and with a warm page cache: every expert in RAM, the
  ceiling.

Points are interleaved: each repeat runs every point once, in reversed order on odd repeats, so
slow drift of the machine falls on all of them.

Outputs, in the output folder:

- ``stream-runs.csv``: one row per run and mode: ``point``, ``mode`` (``pp`` | ``tg``),
  ``repeat``, ``limit_mib``, llama-bench's columns (``avg_ts`` tok/s, ``n_prompt``, ``n_gen``,
  ...), ``tokens`` (the run's tokens, llama-bench's warm-up included: the whole prompt again for pp,
  one token for tg), ``major_faults`` and
  ``read_mib`` (the process's ``getrusage`` major faults and block input, warm-up included),
  ``majflt_per_token``, ``read_mib_per_token``, ``peak_mib`` (the cgroup's peak use), and the
  stream tier's columns of :func:`pybmoe.engine.stream_record` (``stream_hit_pct``,
  ``stream_read_mib_per_token``, ``stream_io_wait_s``, ``stream_budget_mb``, ...).
- ``stream-summary.csv``: per point and mode, ``n`` runs, ``median_ts`` / ``min_ts`` /
  ``max_ts`` tok/s, ``ratio`` = ``median_ts`` / the ``mmap`` median of the same mode,
  ``median_hit_pct``, ``median_read_mib_per_token``, ``median_majflt_per_token`` and
  ``median_io_wait_s``; the disk and the limits (below): ``median_probe_mib_s``,
  ``compute_s_per_token``, ``median_miss_mib_per_token``, ``median_limit_ts``,
  ``median_overlap_limit_ts``, ``median_vs_limit`` and ``median_vs_overlap_limit``; with a
  route-replay trace, ``predicted_ts`` on the stream points' decode
  rows: :func:`pybmoe.routing.sizing.predict_stream` at the point's budget, from the trace, the disk
  bandwidth the stream runs measured (MiB read / io wait) and the resident point's decode; ``spread``
  (``max_ts / min_ts``), ``max_load_1m`` (the highest 1-minute load average a run started under, each
  run's ``load_1m``) and ``noisy`` (``spread`` over 1.5: :mod:`pybmoe.bench.noise`).
- ``stream-tg.png`` and ``stream-pp.png``: tok/s per point (median bars, each repeat a dot, min-max
  bars) with the ratio over mmap written on each bar and the serial and overlapped limits as ticks,
  and below, the tier's hit rate; the resident bar is hatched and labelled as run with no limit and
  warm (:func:`pybmoe.bench.plot.stream_figure`).
- ``logs/``: each run's stderr.

**The disk and the limit of every point.** Before each repeat the benchmark probes the disk on the
model's own file (:func:`pybmoe.bench.disk.probe`: ``O_DIRECT`` reads of random expert projections,
the tier's read size, on its read lanes; the page cache plays no part), so each run carries the probe
taken just before it (``probe_mib_s``). Each run then gets its limit, the speed it would reach if
its reads ran at the probe's rate and its compute at the all-resident point's (issue 23's bound):

- ``miss_mib_per_token``: the MiB a token had to read: the tier's reads per token
  (``stream_read_mib_per_token``) on the stream points, the process's block input per token
  (``read_mib_per_token``, the load included) on ``mmap`` and ``resident``;
- ``compute_s_per_token``: 1 / the ``resident`` point's median tok/s of the same mode;
- ``limit_ts`` = 1 / (miss / probe + compute): the serial limit, reads then compute;
- ``overlap_limit_ts`` = 1 / max(miss / probe, compute): reads wholly hidden behind compute;
- ``vs_limit`` and ``vs_overlap_limit``: the measured tok/s over each.

**The chain limit** (:func:`chain_limit_ts`, decode; ``tools/bench-stream-chain.py`` reports it). A
layer's misses are known only once its router has run, and its router needs the layer before it. So
the reads of a token can hide behind that token's expert matmuls only, never behind its dense part
(attention, norms, router, output): no engine that reads what the router chose, without guessing it
ahead, beats 1 / (dense + max(miss / probe, expert)) per token. That is ``chain_limit_ts``, with
``expert`` the expert matmuls' share of the all-resident token (:func:`expert_seconds`, measured
against a twin of the model with narrow experts) and ``dense`` the rest. It lies between
``limit_ts`` and ``overlap_limit_ts``, and equals the latter only when the reads dominate
(``docs/stream-tier.md``, "The chain limit").

Both are NaN without a ``resident`` point or a probe. The token counts include llama-bench's warm-up
(one token or one prompt, read from an empty cache), so a short run's misses per token are high and
its limit low; compare points of one run. The probe reads as decode's misses are read; prefill reads
longer runs, part of them behind compute (the prefetch), so a prefill run can beat its limit
(``docs/benchmarks/stream-prefill-limits-2026-12-05/README.md``).

Where cgroups cannot be created (not root, no memory controller) the benchmark says so and runs
without a limit; where the page cache cannot be dropped it says so and runs warm.

Errors: :class:`ValueError` for bad arguments (before anything runs); :class:`pybmoe.engine.EngineError`
when ``llama-bench`` fails (the command and its log's tail).
"""
from __future__ import annotations

import io
import math
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from .. import engine
from ..engine import memlimit
from . import disk, noise
from . import server as server_mod
from ..routing import sizing
from ..routing import trace as tr

MODES = ("pp", "tg")
STREAM_IO_THREADS = 4  # the engine's read lanes by default (--moe-stream-io-threads)


@dataclass(frozen=True)
class StreamPoint:
    """One configuration: ``kind`` ``mmap`` | ``stream`` | ``defaults`` | ``resident``; ``budget``
    the stream budget (MiB as a string, or ``auto``); ``policy`` the tier's policy through
    ``PYBMOE_MOE_STREAM_POLICY`` ("" leaves the engine's default, ``global-lru-scan``)."""

    kind: str
    budget: str = ""
    dense: str = "auto"
    policy: str = ""

    @property
    def name(self) -> str:
        suffix = f"/{self.policy}" if self.policy else ""
        if self.kind != "stream":
            return self.kind + suffix
        return f"stream:{self.budget}" + (f"+{self.dense}" if self.dense != "auto" else "") + suffix

    @property
    def limited(self) -> bool:
        return self.kind != "resident"


DENSE = ("mmap", "warm", "anon", "auto")


def points(budgets: Sequence[str], include_resident: bool = True, dense: Sequence[str] = (),
           defaults: bool = True, dense_only: bool = False) -> list[StreamPoint]:
    """mmap, the ``defaults`` point (unless ``defaults`` is False), one stream point per budget (at the
    engine's dense policy; left out with ``dense_only`` when ``dense`` is given), one more per budget
    and dense policy, and (optionally) the resident ceiling.

    Raises :class:`ValueError` for a budget that is neither ``auto`` nor a positive integer, or an
    unknown dense policy."""
    out = [StreamPoint("mmap")]
    if defaults:
        out.append(StreamPoint("defaults", "auto"))
    bs = []
    for b in budgets:
        b = str(b).strip()
        if b != "auto" and not (b.isdigit() and int(b) > 0):
            raise ValueError(f"budget {b!r}; accepted: a positive number of MiB or 'auto'")
        bs.append(b)
        if not (dense_only and dense):
            out.append(StreamPoint("stream", b))
    for d in dense:
        if d not in DENSE:
            raise ValueError(f"dense policy {d!r}; accepted: {', '.join(DENSE)}")
    for b in bs:
        out += [StreamPoint("stream", b, d) for d in dense if d != "auto"]
    if include_resident:
        out.append(StreamPoint("resident"))
    return out


def bench_command(model: Path, point: StreamPoint, mode: str, *, n_prompt: int, n_gen: int, threads: int,
                  ubatch: int, io_threads: int | None, floor_mib: int | None, route_replay: Path | None) -> list[str]:
    """The ``llama-bench`` command line of one run (``io_threads``, ``floor_mib``: None leaves the
    engine's default; the ``defaults`` point never passes them)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; accepted: {', '.join(MODES)}")
    pn = ["-p", str(n_prompt), "-n", "0"] if mode == "pp" else ["-p", "0", "-n", str(n_gen)]
    cmd = [str(engine.find_binary("llama-bench")), "-m", str(model), *pn, "-r", "1", "-o", "csv", "-v",
           "-t", str(threads), "-ub", str(ubatch), "-b", str(max(ubatch, 1)), "-ngl", "0", "--repack", "0"]
    if point.kind == "defaults":
        cmd += ["--moe-stream-cache-mb", "auto"]
    elif point.kind == "stream":
        cmd += ["--moe-stream-cache-mb", point.budget]
        if io_threads is not None:
            cmd += ["--moe-stream-io-threads", str(io_threads)]
        if floor_mib is not None:
            cmd += ["--moe-stream-floor-mb", str(floor_mib)]
        if point.dense != "auto":
            cmd += ["--dense-weights", point.dense]
    if route_replay is not None:
        cmd += ["--moe-route-replay", str(route_replay)]
    return cmd


def _warm(model: Path) -> None:
    """Reads the model once through the page cache (the resident ceiling's warm start)."""
    with open(model, "rb") as f:
        while f.read(16 << 20):
            pass


def run_point(model: Path, point: StreamPoint, mode: str, *, limit: memlimit.MemoryLimit | None, cold: bool,
              log_path: Path, **kw) -> dict:
    """One ``llama-bench`` run: its CSV row plus the resource and stream columns (see the module doc).

    Raises :class:`pybmoe.engine.EngineError` when it fails."""
    cmd = bench_command(model, point, mode, **kw)
    if point.kind == "resident":
        _warm(model)
    elif cold:
        memlimit.drop_caches()
    if limit is not None and point.limited:
        limit.reset_peak()
        cmd = limit.wrap(cmd)
    env = {**os.environ, "PYBMOE_MOE_STREAM_POLICY": point.policy} if point.policy else None
    load_1m = noise.load_average()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(r.stderr)
    text = "\n".join(ln for ln in r.stdout.splitlines() if ln.strip())
    rows = pd.read_csv(io.StringIO(text)).to_dict("records") if r.returncode == 0 and text else []
    if len(rows) != 1:
        raise engine.EngineError(f"llama-bench exited with code {r.returncode} ({len(rows)} result rows): "
                                 f"{' '.join(cmd)}\n{r.stderr[-4000:]}")
    row = dict(rows[0])
    # llama-bench warms up with the whole prompt (pp) or one token (tg) before the measured run
    tokens = 2 * int(row.get("n_prompt", 0)) if mode == "pp" else int(row.get("n_gen", 0)) + 1
    majflt = after.ru_majflt - before.ru_majflt
    read_mib = (after.ru_inblock - before.ru_inblock) * 512 / 2**20
    row.update(point=point.name, kind=point.kind, budget=point.budget, dense=point.dense, mode=mode, tokens=tokens,
               load_1m=load_1m,
               major_faults=majflt, read_mib=read_mib, majflt_per_token=majflt / tokens,
               read_mib_per_token=read_mib / tokens,
               peak_mib=limit.peak_mib() if limit is not None and point.limited else np.nan,
               **engine.stream_record(r.stderr))
    return row


@dataclass
class StreamBenchResult:
    runs: pd.DataFrame
    summary: pd.DataFrame
    out_dir: Path
    limit_mib: int | None
    notes: list[str]
    server_runs: pd.DataFrame | None = None     # the server point's rows (pybmoe.bench.server), when asked
    server_summary: pd.DataFrame | None = None  # per clients: medians, and ratios over llama-bench's points


def limit_ts(miss_mib_per_token, probe_mib_s, compute_s_per_token, *, overlap: bool = False):
    """The limit of a run (module doc), tok/s: 1 / (miss / probe + compute), or with ``overlap``
    1 / max(miss / probe, compute). Arguments are MiB per token, MiB/s and seconds per token, scalars
    or arrays; NaN where an input is NaN or a bandwidth is not positive."""
    miss = np.asarray(miss_mib_per_token, dtype=float)
    bw = np.asarray(probe_mib_s, dtype=float)
    compute = np.asarray(compute_s_per_token, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        read = np.where(bw > 0, miss / bw, np.nan)
        t = np.maximum(read, compute) if overlap else read + compute
        out = np.where(t > 0, 1.0 / t, np.nan)
    return float(out) if out.ndim == 0 else out


def chain_limit_ts(miss_mib_per_token, probe_mib_s, compute_s_per_token, expert_s_per_token):
    """The chain limit of a run (module doc), tok/s: 1 / (dense + max(miss / probe, expert)), with
    ``expert`` the seconds per token of the expert matmuls (:func:`expert_seconds`) and dense = compute -
    expert the rest of the all-resident token. Arguments are MiB per token, MiB/s and seconds per token,
    scalars or arrays; NaN where an input is NaN, a bandwidth is not positive or ``expert`` is not in
    [0, compute]."""
    miss = np.asarray(miss_mib_per_token, dtype=float)
    bw = np.asarray(probe_mib_s, dtype=float)
    compute = np.asarray(compute_s_per_token, dtype=float)
    expert = np.asarray(expert_s_per_token, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        read = np.where(bw > 0, miss / bw, np.nan)
        ok = (expert >= 0) & (expert <= compute)
        t = np.where(ok, compute - expert + np.maximum(read, expert), np.nan)
        out = np.where(t > 0, 1.0 / t, np.nan)
    return float(out) if out.ndim == 0 else out


def expert_seconds(ts, twin_ts, n_ff, twin_n_ff) -> float:
    """Seconds per token of a model's expert matmuls, from its all-resident tok/s ``ts`` and that of its
    narrow twin ``twin_ts``: the same model with every expert's FFN width ``twin_n_ff`` instead of
    ``n_ff`` (elements; ``pybmoe-make-synth --n-ff-exp``), so the same dense weights, router and
    top-k. The expert matmuls' time scales with the width, the rest does not: expert =
    (1/ts - 1/twin_ts) * n_ff / (n_ff - twin_n_ff). Raises :class:`ValueError` unless
    0 < twin_n_ff < n_ff and both speeds are positive. Can come out negative (or above 1/ts) when the
    two runs are noise apart; :func:`chain_limit_ts` then gives NaN."""
    if not 0 < twin_n_ff < n_ff:
        raise ValueError(f"the twin's expert width must be below the model's: {twin_n_ff} vs {n_ff}")
    if not (ts > 0 and twin_ts > 0):
        raise ValueError(f"speeds must be positive: {ts}, {twin_ts} tok/s")
    return (1.0 / ts - 1.0 / twin_ts) * n_ff / (n_ff - twin_n_ff)


def limit_columns(ts, miss_mib_per_token, probe_mib_s, compute_s_per_token, expert_s_per_token=None) -> dict:
    """A run's limit columns (module doc) from its measured tok/s and :func:`limit_ts`'s inputs:
    ``limit_ts``, ``overlap_limit_ts``, ``vs_limit`` and ``vs_overlap_limit`` (scalars or arrays); with
    ``expert_s_per_token`` (:func:`expert_seconds`) also ``chain_limit_ts`` and ``vs_chain_limit``."""
    lim = limit_ts(miss_mib_per_token, probe_mib_s, compute_s_per_token)
    olim = limit_ts(miss_mib_per_token, probe_mib_s, compute_s_per_token, overlap=True)
    out = dict(limit_ts=lim, overlap_limit_ts=olim, vs_limit=ts / lim, vs_overlap_limit=ts / olim)
    if expert_s_per_token is not None:
        clim = chain_limit_ts(miss_mib_per_token, probe_mib_s, compute_s_per_token, expert_s_per_token)
        out.update(chain_limit_ts=clim, vs_chain_limit=ts / clim)
    return out


def warm_page_cache(path: Path) -> None:
    """Reads the whole file once (buffered, 8 MiB at a time), so that its pages are in the page cache
    before a warm run: a run after a cold one (which drops the cache) would otherwise read its experts
    from the disk as it first routes to them, and time the disk (0.6 tok/s where 13 was right)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


def resident_ts(model: Path, mode: str, log_dir: Path, name: str, *, n_prompt: int, n_gen: int,
                runs: int = 3) -> float:
    """The all-resident speed of ``model`` in ``mode``, tok/s: the median of ``runs`` warm runs without a
    limit (the ``resident`` point, 2 threads), their logs ``log_dir/NAME-resident-I.log``; the file is read
    into the page cache first (:func:`warm_page_cache`). Raises :class:`pybmoe.engine.EngineError` when a
    run fails."""
    warm_page_cache(model)
    return float(np.median([run_point(model, StreamPoint("resident"), mode, limit=None, cold=False,
                                      log_path=log_dir / f"{name}-resident-{i}.log", n_prompt=n_prompt, n_gen=n_gen,
                                      threads=2, ubatch=512, io_threads=None, floor_mib=None,
                                      route_replay=None)["avg_ts"] for i in range(runs)]))


def add_limits(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with the limit columns of the module doc (``miss_mib_per_token``,
    ``compute_s_per_token``, ``limit_ts``, ``overlap_limit_ts``, ``vs_limit``, ``vs_overlap_limit``);
    it needs ``probe_mib_s`` (NaN where the disk was not probed) and a ``resident`` point for the
    compute (NaN without)."""
    r = runs.copy()
    res = r[r.kind == "resident"].groupby("mode")["avg_ts"].median()
    r["compute_s_per_token"] = [1.0 / res[m] if m in res and res[m] > 0 else np.nan for m in r["mode"]]
    streamed = r.kind.isin(["stream", "defaults"])
    tier = pd.to_numeric(r.get("stream_read_mib_per_token"), errors="coerce") if "stream_read_mib_per_token" in r \
        else pd.Series(np.nan, index=r.index)
    r["miss_mib_per_token"] = np.where(streamed, tier, r.read_mib_per_token)
    probe = r["probe_mib_s"] if "probe_mib_s" in r else pd.Series(np.nan, index=r.index)
    for col, v in limit_columns(r.avg_ts.to_numpy(float), r.miss_mib_per_token.to_numpy(float),
                                probe.to_numpy(float), r.compute_s_per_token.to_numpy(float)).items():
        r[col] = v
    return r


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """Per point and mode: medians, ranges, the ratio over the mmap median, and the disk and the limits
    when ``runs`` has them (:func:`add_limits`; see the module doc)."""
    g = runs.groupby(["point", "mode"], sort=False)
    s = g.agg(n=("avg_ts", "size"), median_ts=("avg_ts", "median"), min_ts=("avg_ts", "min"),
              max_ts=("avg_ts", "max"), median_hit_pct=("stream_hit_pct", "median"),
              median_read_mib_per_token=("read_mib_per_token", "median"),
              median_stream_read_mib_per_token=("stream_read_mib_per_token", "median"),
              median_majflt_per_token=("majflt_per_token", "median"),
              median_io_wait_s=("stream_io_wait_s", "median"), median_peak_mib=("peak_mib", "median")).reset_index()
    base = s[s.point == "mmap"].set_index("mode")["median_ts"]
    s["ratio"] = [r.median_ts / base.get(r.mode, np.nan) for r in s.itertuples()]
    if "limit_ts" in runs:
        lim = g.agg(median_probe_mib_s=("probe_mib_s", "median"), compute_s_per_token=("compute_s_per_token", "median"),
                    median_miss_mib_per_token=("miss_mib_per_token", "median"),
                    median_limit_ts=("limit_ts", "median"), median_overlap_limit_ts=("overlap_limit_ts", "median"),
                    median_vs_limit=("vs_limit", "median"),
                    median_vs_overlap_limit=("vs_overlap_limit", "median")).reset_index()
        s = s.merge(lim, on=["point", "mode"], how="left", sort=False)
    return noise.flag_spread(s, runs, ["point", "mode"])


def predict(runs: pd.DataFrame, summary: pd.DataFrame, model: Path, trace_path: Path) -> pd.DataFrame:
    """``summary`` with ``predicted_ts`` (decode tok/s) and ``disk_mib_s`` on the stream points' tg rows
    (see the module doc); NaN where a figure is missing."""
    s = summary.copy()
    s["predicted_ts"] = np.nan
    s["disk_mib_s"] = np.nan
    st = runs[runs.kind.isin(["stream", "defaults"]) & (runs.stream_io_wait_s > 0)]
    res = runs[(runs.kind == "resident") & (runs["mode"] == "tg")]
    if st.empty or res.empty:
        return s
    disk = float((st.stream_read_mib / st.stream_io_wait_s).median())
    shape = sizing.model_shape(model)
    t = tr.read_trace(trace_path)
    for i, r in s.iterrows():
        if r["mode"] != "tg" or not (str(r.point).startswith("stream:") or r.point == "defaults"):
            continue
        pt = runs[(runs.point == r.point)]
        budget = pt.stream_budget_mb.median()
        window = pt.stream_prefetch_experts.median() if "stream_prefetch_experts" in pt else math.nan
        p = sizing.predict_stream(shape, t, float(budget), disk_mib_s=disk, resident_tok_s=float(res.avg_ts.median()),
                                  window_experts=None if math.isnan(window) else int(window))
        s.loc[i, "predicted_ts"] = p.tok_s
        s.loc[i, "disk_mib_s"] = disk
    return s


def plot(summary: pd.DataFrame, out_dir: Path, title: str, runs: pd.DataFrame | None = None,
         server_summary: pd.DataFrame | None = None, server_runs: pd.DataFrame | None = None) -> list[Path]:
    """``stream-<mode>.png`` per mode (:func:`pybmoe.bench.plot.stream_figure`): tok/s per point with
    each repeat, the min-max and the limits, the ratio over mmap, and the tier's hit rate; the
    all-resident point marked as unlimited and warm; with the server point (``server_summary``, else
    ``out_dir/server-summary.csv`` when it is there), its bars in ``stream-tg.png`` beside the others
    (:func:`server_plot_rows`: ``server/1 client``, ``server/4 clients``, decode). The repeats come
    from ``runs`` (``server_runs``), else from ``out_dir/stream-runs.csv`` (``server-runs.csv``) when it is
    there (what :func:`bench_stream` wrote). Returns the paths written."""
    from .plot import stream_plot
    summary, runs = plot_frames(summary, out_dir, runs, server_summary, server_runs)
    return [stream_plot(summary, runs, out_dir / f"stream-{mode}.png", mode, title=title)
            for mode in MODES if (summary["mode"] == mode).any()]


def plot_frames(summary: pd.DataFrame, out_dir: Path, runs: pd.DataFrame | None = None,
                server_summary: pd.DataFrame | None = None,
                server_runs: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The summary and runs :func:`plot` draws: ``runs`` (else ``out_dir/stream-runs.csv``), and the
    server point's rows (:func:`server_plot_rows`, from ``server_summary``, else
    ``out_dir/server-summary.csv`` and ``server-runs.csv``) appended in decode when there is one."""
    if runs is None and (out_dir / "stream-runs.csv").is_file():
        runs = pd.read_csv(out_dir / "stream-runs.csv")
    if server_summary is None and (out_dir / "server-summary.csv").is_file():
        server_summary = pd.read_csv(out_dir / "server-summary.csv")
        if server_runs is None and (out_dir / "server-runs.csv").is_file():
            server_runs = pd.read_csv(out_dir / "server-runs.csv")
    if server_summary is not None and len(server_summary) and (summary["mode"] == "tg").any():
        rows, sruns = server_plot_rows(server_summary, server_runs)
        summary = pd.concat([summary, rows], ignore_index=True)
        runs = sruns if runs is None else pd.concat([runs, sruns], ignore_index=True)
    return summary, runs


def check_model(model: str | os.PathLike) -> Path:
    """``model`` as a Path. Raises :class:`ValueError` naming what it is when it is not a file (a
    directory, missing, not a regular file)."""
    model = Path(model)
    if not model.is_file():
        what = "is a directory" if model.is_dir() else "is not a regular file" if model.exists() else "does not exist"
        raise ValueError(f"model {model} {what}; accepted: a GGUF file")
    return model


def bench_stream(model: str | os.PathLike, out_dir: str | os.PathLike, *, limit_mib: int | None,
                 budgets: Sequence[str] = ("auto",), n_prompt: int = 64, n_gen: int = 32, repeats: int = 3,
                 threads: int = 2, ubatch: int = 512, io_threads: int | None = None, floor_mib: int | None = None,
                 route_replay: str | os.PathLike | None = None, include_resident: bool = True, cold: bool = True,
                 dense: Sequence[str] = (), defaults: bool = True, dense_only: bool = False,
                 n_gen_mmap: int | None = None, probe: bool = True, probe_mib: float = 256.0,
                 server: bool = False, server_clients: Sequence[int] = (1, 4),
                 progress: Callable[[int], None] | None = None) -> StreamBenchResult:
    """Run the benchmark (see the module doc) and write its CSVs and plots to ``out_dir``.

    ``limit_mib``: the memory limit (None: no limit); ``floor_mib``: ``--moe-stream-floor-mb``
    for the ``stream:auto`` points (None: the engine's auto floor); ``io_threads``: read lanes of
    the stream points (None: the engine's default, 4); ``defaults``: include the ``defaults``
    point; ``n_gen_mmap``: the ``mmap`` point's generated tokens, when they should be fewer than the others'
    (stock mmap thrashes at a rate that does not depend on the token; default ``n_gen``). ``probe``:
    probe the disk before each repeat, ``probe_mib`` MiB on the tier's lanes (``io_threads``, default
    4), for the limit columns (module doc); a probe that fails (a file system that refuses
    ``O_DIRECT`` falls back to buffered reads, see :func:`pybmoe.bench.disk.probe`) leaves a note and
    NaN. ``server``: also the ``server`` point in every repeat (:mod:`pybmoe.bench.server`:
    ``llama-server`` at its own defaults, ``server_clients`` clients, ``n_prompt`` and ``n_gen``
    tokens a request), written to ``server-runs.csv`` and ``server-summary.csv``. ``progress`` is
    called with 1 after each run. Raises :class:`ValueError` for bad arguments and
    :class:`pybmoe.engine.EngineError` when a run fails.
    """
    model = check_model(model)
    for name, v, lo in (("n_prompt", n_prompt, 1), ("n_gen", n_gen, 1), ("repeats", repeats, 1),
                        ("threads", threads, 1), ("ubatch", ubatch, 1), ("io_threads", io_threads or 1, 1),
                        ("floor_mib", 0 if floor_mib is None else floor_mib, 0)):
        if v < lo:
            raise ValueError(f"{name} {v}; accepted: >= {lo}")
    if probe and not probe_mib > 0:
        raise ValueError(f"probe_mib {probe_mib}; accepted: > 0 (MiB)")
    pts = points(budgets, include_resident, dense, defaults, dense_only)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    limit = None
    if limit_mib is not None:
        ok, why = memlimit.limit_available()
        if ok:
            limit = memlimit.MemoryLimit(limit_mib)
        else:
            notes.append(f"no memory limit: {why}; running without one")
            limit_mib = None
    if cold and not memlimit.drop_caches():
        notes.append("the page cache cannot be dropped here (not root); runs start warm")
        cold = False
    for n in notes:
        print(f"pybmoe bench-stream: {n}", file=sys.stderr)
    rp = Path(route_replay) if route_replay is not None else None
    rows, srows = [], []
    try:
        for rep in range(repeats):
            bw = _probe(model, io_threads, probe_mib, rep, notes) if probe else np.nan
            order = pts if rep % 2 == 0 else pts[::-1]
            if server:  # the server point first on even repeats, last on odd ones, as the others interleave
                order = [None, *order] if rep % 2 == 0 else [*order, None]
            for pt in order:
                if pt is None:
                    for row in server_mod.run_server_point(model, limit=limit, cold=cold, threads=threads,
                                                           log_path=out / "logs" / f"server-{rep}.log",
                                                           n_prompt=n_prompt, n_gen=n_gen, clients=server_clients,
                                                           route_replay=rp):
                        row.update(repeat=rep)
                        srows.append(row)
                    if progress:
                        progress(1)
                    continue
                for mode in MODES:
                    row = run_point(model, pt, mode, limit=limit, cold=cold,
                                    log_path=out / "logs" / f"{pt.name.replace(':', '-')}-{mode}-{rep}.log",
                                    n_prompt=n_prompt, n_gen=n_gen_mmap if pt.kind == "mmap" and n_gen_mmap else n_gen,
                                    threads=threads, ubatch=ubatch,
                                    io_threads=io_threads, floor_mib=floor_mib, route_replay=rp)
                    row.update(repeat=rep, limit_mib=limit_mib if pt.limited else None, probe_mib_s=bw)
                    rows.append(row)
                    if progress:
                        progress(1)
    finally:
        if limit is not None:
            limit.close()
    runs = add_limits(pd.DataFrame(rows))
    runs.to_csv(out / "stream-runs.csv", index=False)
    summary = summarize(runs)
    if rp is not None:
        summary = predict(runs, summary, model, rp)
    summary.to_csv(out / "stream-summary.csv", index=False)
    sruns = ssum = None
    if server:
        sruns = pd.DataFrame(srows)
        sruns.to_csv(out / "server-runs.csv", index=False)
        ssum = summarize_server(sruns, summary)
        ssum.to_csv(out / "server-summary.csv", index=False)
    title = f"{model.name}: limit {limit_mib} MiB" if limit_mib else f"{model.name}: no memory limit"
    plot(summary, out, title, runs=runs, server_summary=ssum if ssum is not None else pd.DataFrame(),
         server_runs=sruns)
    return StreamBenchResult(runs, summary, out, limit_mib, notes, sruns, ssum)


def summarize_server(sruns: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Per ``clients`` of the server point: ``n`` runs that answered (``refused``/``oom`` counted apart),
    ``median_ts`` (decode tok/s: one client's per-request median, or the aggregate over the decode
    phase), ``min_ts``, ``max_ts``, ``median_wall_ts`` (all generated tokens over the wall time, prefill
    included), ``median_ttft_s``, ``median_hit_pct``, the context and budget it ran with
    (``n_ctx_slot``, ``n_slots``, ``budget_mb``, ``serving_budget_mb``, ``cycle_mb``), ``peak_mib``, ``oom_kills``, the
    answers' verdicts, and ``vs_bench_defaults`` / ``vs_mmap``: ``median_ts`` over llama-bench's
    ``defaults`` and ``mmap`` decode medians of the same run (NaN without them)."""
    tg = summary[summary["mode"] == "tg"].set_index("point")["median_ts"] if len(summary) else pd.Series(dtype=float)
    rows = []
    for clients, g in sruns.groupby(sruns.get("clients", pd.Series([1] * len(sruns))).fillna(1).astype(int)):
        ok = g[g["status"] == "ok"]
        med = float(ok.decode_ts.median()) if len(ok) else math.nan
        rows.append(dict(point="server", clients=clients, n=len(ok), refused=int((g.status == "refused").sum()),
                         oom=int((g.status == "oom").sum()), median_ts=med,
                         min_ts=float(ok.decode_ts.min()) if len(ok) else math.nan,
                         max_ts=float(ok.decode_ts.max()) if len(ok) else math.nan,
                         median_wall_ts=float(ok.wall_ts.median()) if len(ok) and "wall_ts" in ok else math.nan,
                         median_ttft_s=float(ok.ttft_s.median()) if len(ok) else math.nan,
                         median_hit_pct=float(ok.hit_pct.median()) if len(ok) else math.nan,
                         n_ctx_slot=g.n_ctx_slot.max(), n_slots=g.n_slots.max(),
                         budget_mb=float(g.budget_mb.median()), cycle_mb=float(g.cycle_mb.median()),
                         serving_budget_mb=float(ok.serving_budget_mb.median()) if len(ok) else math.nan,
                         peak_mib=float(g.peak_mib.max()) if "peak_mib" in g else math.nan,
                         oom_kills=int(g.oom_kills.fillna(0).sum()),
                         identical=ok.get("identical", pd.Series(dtype=float)).sum(min_count=1),
                         near_tie=ok.get("near_tie", pd.Series(dtype=float)).sum(min_count=1),
                         wrong=ok.get("wrong", pd.Series(dtype=float)).sum(min_count=1),
                         vs_bench_defaults=med / tg["defaults"] if "defaults" in tg else math.nan,
                         vs_mmap=med / tg["mmap"] if "mmap" in tg else math.nan,
                         max_load_1m=float(g.load_1m.max()) if "load_1m" in g else math.nan))
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    spread = out.max_ts / out.min_ts.where(out.min_ts > 0)
    return out.assign(spread=spread, noisy=(spread > noise.SPREAD_LIMIT).fillna(False).astype(bool))


def server_label(clients: int) -> str:
    """The label of the server point's bar of ``clients`` in ``stream-tg.png`` (:func:`server_plot_rows`)."""
    return f"server/{clients} client{'s' if clients != 1 else ''}"


def server_plot_rows(server_summary: pd.DataFrame, server_runs: pd.DataFrame | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The server point as :func:`pybmoe.bench.plot.stream_figure` draws the others, in decode (``tg``):
    summary rows (one per clients, ``point`` :func:`server_label`, ``median_ts`` / ``min_ts`` /
    ``max_ts`` its decode tok/s, ``ratio`` its ``vs_mmap``, its hit rate and ``noisy``) and run rows
    (each answered run's ``decode_ts`` as ``avg_ts``)."""
    ss = server_summary[server_summary["n"] > 0] if len(server_summary) else server_summary
    rows = pd.DataFrame({"point": [server_label(int(c)) for c in ss.clients], "mode": "tg", "n": ss.n.to_numpy(),
                         "median_ts": ss.median_ts.to_numpy(), "min_ts": ss.min_ts.to_numpy(),
                         "max_ts": ss.max_ts.to_numpy(), "ratio": ss.vs_mmap.to_numpy(),
                         "median_hit_pct": ss.median_hit_pct.to_numpy(),
                         "spread": ss.get("spread", pd.Series(np.nan, index=ss.index)).to_numpy(),
                         "max_load_1m": ss.get("max_load_1m", pd.Series(np.nan, index=ss.index)).to_numpy(),
                         "noisy": ss.get("noisy", pd.Series(False, index=ss.index)).to_numpy()})
    runs = pd.DataFrame({"point": [], "mode": [], "avg_ts": []})
    if server_runs is not None and len(server_runs) and "decode_ts" in server_runs:
        ok = server_runs[server_runs["status"] == "ok"]
        runs = pd.DataFrame({"point": [server_label(int(c)) for c in ok.clients], "mode": "tg",
                             "avg_ts": ok.decode_ts.to_numpy()})
    return rows, runs


def _probe(model: Path, io_threads: int | None, total_mib: float, seed: int, notes: list[str]) -> float:
    """One disk probe for a repeat (module doc): MiB/s, or NaN with a note when it fails."""
    try:
        p = disk.probe(model, lanes=io_threads or STREAM_IO_THREADS, total_mib=total_mib, seed=seed)
    except OSError as e:
        note = f"the disk probe failed ({e}); no limits"
        if note not in notes:
            notes.append(note)
            print(f"pybmoe bench-stream: {note}", file=sys.stderr)
        return math.nan
    return p.mib_s


def format_summary(summary: pd.DataFrame) -> str:
    """The summary as a fixed-width table (tok/s, ratio, hit %, MiB and faults per token; ``noisy``: the
    spread and load of a point whose repeats disagree, :mod:`pybmoe.bench.noise`), and under it one line
    per noisy point."""
    cols = ["point", "mode", "n", "median_ts", "ratio", "median_hit_pct", "median_read_mib_per_token",
            "median_majflt_per_token", "median_io_wait_s", "median_peak_mib", "median_probe_mib_s",
            "median_limit_ts", "median_vs_limit", "median_overlap_limit_ts", "median_vs_overlap_limit", "predicted_ts",
            "noisy"]
    t = summary[[c for c in cols if c in summary]].copy()
    if "noisy" in t:
        t["noisy"] = [noise.noisy_note(r) for r in summary.itertuples(index=False)]
    text = t.to_string(index=False, float_format=lambda v: f"{v:.2f}")
    return "\n".join([text, *noise.noisy_lines(summary, ["point", "mode"])])
