"""The analysis of ``tools/device-bench.sh``: measured points against the bandwidth model.

``tools/device-bench.sh`` runs ``llama-bench`` once per point and mode on a synthetic model of a
real shape under route replay, and leaves in its output folder:

- ``runs.tsv``: one line per run: ``point``, ``mode`` (``pp`` | ``tg``), ``slots``,
  ``placement`` (``host``: experts in host memory, cache off; ``cache``: host experts with the
  cache, ``slots`` per layer; ``pool``: the same MiB as ``cache`` at those ``slots``, as one pool
  per device (``--moe-expert-cache-mb``); ``vram``: every expert on the device), ``repack``
  (0 | 1), ``rc``, ``wall_s``;
- ``runs/POINT_MODE.csv`` (llama-bench's CSV row, ``-r N``: ``avg_ts`` / ``stddev_ts`` tok/s) and
  ``runs/POINT_MODE.log`` (its stderr with ``-v``: the load log and the cache's lines);
- ``bw.txt``: the line of ``pybmoe-bw`` (GB/s, 1e9 bytes per second);
- ``synth.txt``: the line of ``pybmoe-make-synth`` (bytes of the model, of one expert, of the
  non-expert tensors, of all expert tensors) and the shape (``n_layer=.. n_expert=.. top_k=..``).

``python -m pybmoe.cli.devbench DIR [--stand-in]`` (:func:`analyze`) joins them into
``DIR/device-bench.csv`` and draws ``DIR/device-bench-tg.png`` and ``-pp.png`` (when matplotlib
is importable; else run the same command on another machine with the folder).

**The bandwidth model** (a lower bound on the time, so an upper bound on tok/s). Decode (``tg``),
per token, with ``T = n_layer × top_k × expert_bytes`` the expert bytes one token reads and ``h``
the cache's hit fraction (the ``moe-cache:`` summary; 0 for ``host``, 1 for ``vram``)::

    t_token >= (1 - h) T / B_host + (h T + D) / B_hbm

where ``D`` is the non-expert bytes (attention, norms, the router and the tied output head, all on
the device in every point and read once per token), ``B_host`` the host's memory read bandwidth
(the missed experts are computed by the host, streamed from RAM) and ``B_hbm`` the device's
memory bandwidth (``d2d``: a device-to-device copy, bytes read + written). The expert uploads
(``upload_mib / steps`` per token) cross the host-device link at ``B_h2d`` (pageable: the model is
memory-mapped); they run beside the computation, so they are reported as ``upload_ms`` and a
second bound ``model_serial_ms`` (model + uploads) rather than added to the first.

Prefill (``pp``), per ubatch of ``U`` tokens: llama.cpp offloads a batch's matrix products with
host-resident weights to the device (op offload, for batches of 32 tokens or more), uploading
every host-resident expert tensor ``X`` once per ubatch (the cache does not serve prefill, so
``host`` and ``cache`` alike)::

    t_ubatch >= X_host / B_h2d + (X + D) / B_hbm,   tok/s <= U / t_ubatch

with ``X_host = X`` for ``host`` and ``cache``, 0 for ``vram``. Prefill is usually compute bound
on the device, so the pp bound is loose.

``efficiency`` = measured tok/s ÷ the model's. ``--stand-in`` (the CPU smoke run, where a loopback
RPC server is the device): the device figures are the host read bandwidth, so the plumbing runs;
those numbers mean nothing.

Errors: :class:`FileNotFoundError` when ``runs.tsv``, ``bw.txt`` or ``synth.txt`` is missing,
:class:`ValueError` for a malformed line.
"""
from __future__ import annotations

import io
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from .. import engine

PLACEMENTS = ("host", "cache", "pool", "vram")
CACHED = ("cache", "pool")  # placements with the VRAM tier on
#: Columns of device-bench.csv, in order (llama-bench's own columns follow).
COLUMNS = ("point", "mode", "placement", "slots", "repack", "rc", "wall_s", "n_prompt", "n_gen", "n_ubatch",
           "n_threads", "avg_ts", "stddev_ts", "hit_pct", "uploads", "upload_mib", "steps", "resident_mib",
           "budget_mib", "token_demand_mib", "overflow", "overflow_reason", "expert_bytes", "token_expert_bytes",
           "dense_bytes", "miss_bytes", "hit_bytes", "host_read_gbs", "h2d_gbs", "hbm_gbs", "model_ms", "model_ts",
           "upload_ms", "model_serial_ms", "efficiency", "bw_source")

_KV = re.compile(r"(\w+)=(\S+)")


def parse_kv_line(text: str, prefix: str) -> dict[str, str]:
    """The ``key=value`` pairs of the last line of ``text`` that starts with ``prefix``.
    Raises :class:`ValueError` when there is none."""
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    if not lines:
        raise ValueError(f"no line starting with {prefix!r}; accepted: the tool's summary line")
    return dict(_KV.findall(lines[-1]))


def read_bw(path: str | Path) -> dict[str, float]:
    """``pybmoe-bw``'s GB/s figures: ``host_read_gbs``, ``h2d_pinned_gbs``, ``h2d_pageable_gbs``,
    ``d2d_gbs`` (nan when not measured)."""
    kv = parse_kv_line(Path(path).read_text(), "pybmoe-bw:")
    return {k: float(v) for k, v in kv.items() if k.endswith("_gbs")}


def read_synth(path: str | Path) -> dict[str, int]:
    """The model's byte counts and shape from ``synth.txt`` (the integers of both lines)."""
    text = Path(path).read_text()
    kv = parse_kv_line(text, "pybmoe-make-synth:")
    shape = parse_kv_line(text, "shape:")
    out = {k: int(v) for k, v in kv.items() if k.endswith("bytes")}
    out.update({k: int(v) for k, v in shape.items() if v.isdigit()})
    for k in ("bytes", "expert_bytes", "dense_bytes", "expert_tensors_bytes", "n_layer", "top_k"):
        if k not in out:
            raise ValueError(f"{path}: {k} missing; accepted: pybmoe-make-synth's line and a shape: line")
    return out


def read_runs(folder: str | Path) -> pd.DataFrame:
    """One row per line of ``runs.tsv``, with llama-bench's CSV columns and the cache's lines."""
    folder = Path(folder)
    runs = pd.read_csv(folder / "runs.tsv", sep="\t")
    rows = []
    for r in runs.to_dict("records"):
        name = f"{r['point']}_{r['mode']}"
        csv, log_p = folder / "runs" / f"{name}.csv", folder / "runs" / f"{name}.log"
        log = log_p.read_text(errors="replace") if log_p.is_file() else ""
        bench: dict = {}
        if csv.is_file():
            text = "\n".join(ln for ln in csv.read_text().splitlines() if ln.strip())
            if text:
                recs = pd.read_csv(io.StringIO(text)).to_dict("records")
                bench = recs[-1] if recs else {}
        rec = engine.cache_record(log)
        from .sweeps import overflow_reason
        reason = overflow_reason(log) if log else None
        row = dict(bench)
        row.update(r)
        cache_on = r["placement"] in CACHED
        row.update(hit_pct=rec["hit_pct"] if cache_on else np.nan,
                   uploads=rec["uploads"] if cache_on else 0,
                   upload_mib=rec["upload_mib"] if cache_on else 0.0,
                   steps=rec["steps"], resident_mib=rec["resident_mib"] if cache_on else 0.0,
                   budget_mib=rec["budget_mib"], token_demand_mib=rec["token_demand_mib"],
                   overflow=reason is not None, overflow_reason=reason or "")
        row.setdefault("avg_ts", np.nan)
        row.setdefault("stddev_ts", np.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def bandwidth_model(runs: pd.DataFrame, bw: dict[str, float], synth: dict[str, int], *,
                    stand_in: bool = False) -> pd.DataFrame:
    """``runs`` with the model's columns (see the module docstring). Bytes are bytes, times ms."""
    df = runs.copy()
    host = bw.get("host_read_gbs", math.nan)
    h2d = bw.get("h2d_pageable_gbs", math.nan)
    if not h2d > 0:
        h2d = bw.get("h2d_pinned_gbs", math.nan)
    hbm = bw.get("d2d_gbs", math.nan)
    source = "measured"
    if stand_in:
        h2d, hbm, source = host, host, "stand-in (host read for every figure)"
    eb, dense, xall = synth["expert_bytes"], synth["dense_bytes"], synth["expert_tensors_bytes"]
    tok = synth["n_layer"] * synth["top_k"] * eb
    out = []
    for r in df.to_dict("records"):
        p = r["placement"]
        if p not in PLACEMENTS:
            raise ValueError(f"placement {p!r}; accepted: {', '.join(PLACEMENTS)}")
        h = {"host": 0.0, "vram": 1.0}.get(p)
        if h is None:
            h = r["hit_pct"] / 100 if pd.notna(r.get("hit_pct")) else math.nan
        r.update(expert_bytes=eb, token_expert_bytes=tok, dense_bytes=dense, host_read_gbs=host, h2d_gbs=h2d,
                 hbm_gbs=hbm, bw_source=source)
        if r["mode"] == "tg":
            miss, hit = (1 - h) * tok, h * tok
            ms = 1e3 * (miss / (host * 1e9) + (hit + dense) / (hbm * 1e9))
            steps = r.get("steps")
            per_tok_up = (r["upload_mib"] * 2**20 / steps) if (p in CACHED and steps and steps > 0) else 0.0
            up_ms = 1e3 * per_tok_up / (h2d * 1e9)
            r.update(miss_bytes=miss, hit_bytes=hit, model_ms=ms, model_ts=1e3 / ms, upload_ms=up_ms,
                     model_serial_ms=ms + up_ms)
        else:
            u = r.get("n_ubatch") if pd.notna(r.get("n_ubatch", np.nan)) else 512
            u = min(int(u), int(r.get("n_prompt") or u))
            x_host = 0.0 if p == "vram" else float(xall)
            ms = 1e3 * (x_host / (h2d * 1e9) + (xall + dense) / (hbm * 1e9))
            r.update(miss_bytes=x_host, hit_bytes=float(xall) - x_host, model_ms=ms, model_ts=u * 1e3 / ms,
                     upload_ms=1e3 * x_host / (h2d * 1e9), model_serial_ms=ms)
        r["efficiency"] = r["avg_ts"] / r["model_ts"] if r.get("model_ts") else math.nan
        out.append(r)
    res = pd.DataFrame(out)
    # drawing and reading order: tg then pp; host, host-repack, the cache by slots, vram
    rank = res["placement"].map({"host": 0, "cache": 1, "pool": 2, "vram": 3})
    res = (res.assign(_m=res["mode"].map({"tg": 0, "pp": 1}), _p=rank, _r=res["repack"])
              .sort_values(["_m", "_p", "slots", "_r"], kind="stable").drop(columns=["_m", "_p", "_r"])
              .reset_index(drop=True))
    first = [c for c in COLUMNS if c in res.columns]
    return res[first + [c for c in res.columns if c not in first]]


def analyze(folder: str | Path, *, stand_in: bool = False, plots: bool = True) -> pd.DataFrame:
    """Write ``device-bench.csv`` (and the PNGs) into ``folder`` from its runs; returns the frame."""
    folder = Path(folder)
    bw = read_bw(folder / "bw.txt")
    synth = read_synth(folder / "synth.txt")
    df = bandwidth_model(read_runs(folder), bw, synth, stand_in=stand_in)
    df.to_csv(folder / "device-bench.csv", index=False)
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("pybmoe devbench: matplotlib is not importable here: no PNGs (run `python -m pybmoe.cli.devbench "
                  f"{folder}` where it is)", file=sys.stderr)
        else:
            from .plot import device_bench_plot
            title = (f"L{synth['n_layer']} E{synth.get('n_expert', '?')} top-{synth['top_k']}, "
                     f"{synth['bytes'] / 1e9:.1f} GB; host {bw.get('host_read_gbs', math.nan):.0f}, "
                     f"h2d {df['h2d_gbs'].iloc[0] if len(df) else math.nan:.0f}, "
                     f"HBM {df['hbm_gbs'].iloc[0] if len(df) else math.nan:.0f} GB/s"
                     + (" (stand-in)" if stand_in else ""))
            for mode in ("tg", "pp"):
                sub = df[df["mode"] == mode]
                if len(sub):
                    device_bench_plot(sub, folder / f"device-bench-{mode}.png", title=f"{mode}: {title}")
    return df


def format_table(df: pd.DataFrame) -> str:
    """A plain-text table of the main columns."""
    cols = ["point", "mode", "slots", "avg_ts", "stddev_ts", "hit_pct", "upload_mib", "model_ts", "efficiency",
            "upload_ms", "overflow"]
    return df[[c for c in cols if c in df.columns]].to_string(index=False, float_format=lambda v: f"{v:.2f}")
