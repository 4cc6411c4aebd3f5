"""The elastic plan under a memory limit, through ``llama-server`` at its defaults
(``tools/bench-elastic.py``; ``docs/stream-tier.md``, "Serving under a memory limit").

Three measurements, each under a cgroup limit from a cold page cache:

- :func:`chat_point`: one server start (the defaults, ``--moe-stream-cache-mb auto`` and nothing else of
  the tier, or those plus ``extra`` flags such as ``-c 4096``), one greedy chat of ``n_prompt`` prompt
  and ``n_gen`` generated tokens: the server's own decode tok/s (``timings.predicted_per_second``),
  prefill tok/s, the context it kept (its fit line and slots line), the cache cycle, and the budget
  sampled from ``/metrics`` every ``period_s`` while the chat ran (its least and its last);
- :func:`bench_point`: ``llama-bench``'s defaults point (``--moe-stream-cache-mb auto``, decode of
  ``n_gen`` tokens) under the same limit, the figure the chat is held against;
- :func:`fill_run`: one conversation that fills the server's context in turns (each turn's prompt is the
  last one, its answer and new tokens, sent with the prompt cache on, so each turn prefills only its new
  tokens), up to ``fractions[-1]`` of the slot's context; per turn the fill, the decode and prefill tok/s
  and the budget, committed KV and free memory after it, plus the ``/metrics`` samples over the whole run.
  The same conversation on stock ``llama-server`` (no tier, no limit, ``--no-repack``) gives the
  reference: every turn's tokens must be identical (:func:`compare_turns`).

Errors: :class:`ValueError` for bad arguments. A server that exits before it is healthy
(:class:`pybmoe.bench.server.ServerExited`) is a row or a setting with its ``status``, ``refused`` or ``oom``.
"""
from __future__ import annotations

import json
import math
import random
import threading
import time
import urllib.request
from pathlib import Path
from typing import Sequence

import pandas as pd

from ..engine import memlimit
from . import noise, server, stream

MIB = 2**20
#: The turns of the fill run, fractions of the slot's context after each turn's prompt and answer.
FRACTIONS = (0.05, 0.25, 0.5, 0.75, 0.92)
_METRICS = {"budget_mib": "moe_stream_budget_bytes", "resident_mib": "moe_stream_resident_bytes",
            "kv_committed_mib": "moe_stream_kv_committed_bytes", "kv_capacity_mib": "moe_stream_kv_capacity_bytes",
            "free_mib": "moe_stream_free_bytes"}


class Sampler:
    """``/metrics`` every ``period_s`` seconds in a thread, while used as a context manager: ``rows``, one
    dict per sample (``t_s`` since the start, and the MiB columns of :data:`_METRICS`, yields, grows)."""

    def __init__(self, url: str, period_s: float = 0.25):
        self.url, self.period_s, self.rows = url, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict:
        m = server.metrics(self.url)
        row = {k: m.get(f"llamacpp:{v}", math.nan) / MIB for k, v in _METRICS.items()}
        row.update(yields=m.get("llamacpp:moe_stream_yields_total", math.nan),
                   grows=m.get("llamacpp:moe_stream_grows_total", math.nan))
        return row

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            row = self.sample()
            row["t_s"] = time.monotonic() - t0
            self.rows.append(row)
            self._stop.wait(self.period_s)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def complete(url: str, prompt: Sequence[int], n_predict: int, *, timeout_s: float = 3600) -> dict:
    """One greedy ``/completion`` of token ids, the prompt cache on, ``n_predict`` tokens exactly (EOS
    ignored): ``ids`` (generated), ``decode_ts``, ``prefill_ts``, ``prompt_n`` (tokens it prefilled)."""
    body = {"prompt": list(prompt), "n_predict": n_predict, "temperature": 0, "top_k": 1, "seed": 0,
            "cache_prompt": True, "ignore_eos": True, "return_tokens": True}
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        d = json.loads(r.read())
    t = d.get("timings", {})
    return dict(ids=list(d.get("tokens", [])), decode_ts=t.get("predicted_per_second", math.nan),
                prefill_ts=t.get("prompt_per_second", math.nan), prompt_n=t.get("prompt_n", 0),
                predicted_n=t.get("predicted_n", 0))


def new_tokens(n: int, rng: random.Random) -> list[int]:
    """``n`` token ids of plain words of the pinned Qwen2 vocab (1000 .. 30000)."""
    return [rng.randrange(1000, 30000) for _ in range(n)]


def _context(log_path: Path) -> dict:
    info = server.parse_log(log_path.read_text(errors="replace"))
    return {k: info[k] for k in ("n_ctx_slot", "n_slots", "kv_unified", "fit_line", "cycle_mb")}


def chat_point(model: Path, limit_mib: int, log_path: Path, *, n_prompt: int = 256, n_gen: int = 128,
               extra: Sequence[str] = (), route_replay: Path | None = None, seed: int = 0,
               period_s: float = 0.25) -> dict:
    """One server start and one chat (module doc); ``status`` ``ok``, ``oom`` or ``refused``."""
    if n_prompt < 1 or n_gen < 1 or limit_mib < 16:
        raise ValueError(f"n_prompt {n_prompt}, n_gen {n_gen}, limit {limit_mib} MiB; accepted: >= 1, >= 1, >= 16")
    row: dict = dict(point="server" + (" " + " ".join(extra) if extra else ""), limit_mib=limit_mib,
                     n_prompt=n_prompt, n_gen=n_gen)
    with memlimit.MemoryLimit(limit_mib) as lim:
        kills0 = lim.oom_kills() or 0
        try:
            with server.running_server(model, limit=lim, log_path=log_path, extra=extra, route_replay=route_replay) as srv:
                row["load_1m"] = noise.load_average()
                with Sampler(srv.url, period_s) as s:
                    a = complete(srv.url, new_tokens(n_prompt, random.Random(seed)), n_gen)
                samples = pd.DataFrame(s.rows)
                row.update(status="ok", startup_s=srv.startup_s, decode_ts=a["decode_ts"], prefill_ts=a["prefill_ts"],
                           predicted_n=a["predicted_n"], budget_min_mib=samples.budget_mib.min(),
                           budget_last_mib=samples.budget_mib.iloc[-1], yields=samples.yields.iloc[-1],
                           grows=samples.grows.iloc[-1], kv_committed_mib=samples.kv_committed_mib.iloc[-1],
                           kv_capacity_mib=samples.kv_capacity_mib.iloc[-1])
        except server.ServerExited as e:
            row.update(status=e.status, error=e.log_tail.splitlines()[-1] if e.log_tail else "")
        row.update(_context(log_path), oom_kills=(lim.oom_kills() or 0) - kills0, peak_mib=lim.peak_mib())
    return row


def bench_point(model: Path, limit_mib: int, log_path: Path, *, n_gen: int = 128,
                route_replay: Path | None = None) -> dict:
    """``llama-bench``'s defaults point, decode of ``n_gen`` tokens, under ``limit_mib`` (module doc)."""
    with memlimit.MemoryLimit(limit_mib) as lim:
        r = stream.run_point(model, stream.StreamPoint("defaults", "auto"), "tg", limit=lim, cold=True, log_path=log_path,
                             n_prompt=32, n_gen=n_gen, threads=2, ubatch=512, io_threads=None, floor_mib=None,
                             route_replay=route_replay)
    return dict(point="llama-bench defaults", limit_mib=limit_mib, n_gen=n_gen, status="ok", decode_ts=r["avg_ts"],
                load_1m=r["load_1m"], peak_mib=r["peak_mib"], budget_last_mib=r.get("stream_budget_after_contexts_mb") or r.get("stream_budget_mb") or math.nan,
                cycle_mb=r.get("stream_cache_cycle_mb") or math.nan, hit_pct=r.get("stream_hit_pct") or math.nan)


def turn_lengths(n_ctx: int, fractions: Sequence[float], n_gen: int) -> list[int]:
    """Each turn's prompt length in tokens: the context after the turn (its prompt and ``n_gen``
    answered tokens) is ``fraction`` of ``n_ctx``. Raises :class:`ValueError` for fractions that do not
    grow, or a first turn shorter than one token."""
    if not fractions or any(b <= a for a, b in zip(fractions, fractions[1:])) or fractions[-1] >= 1:
        raise ValueError(f"fractions {list(fractions)}; accepted: growing, under 1")
    out = [int(f * n_ctx) - n_gen for f in fractions]
    if out[0] < 1:
        raise ValueError(f"a first turn of {out[0]} tokens (n_ctx {n_ctx}, n_gen {n_gen}); accepted: >= 1")
    return out


def fill_run(model: Path, limit_mib: int | None, log_path: Path, *, fractions: Sequence[float] = FRACTIONS,
             n_gen: int = 32, n_ctx: int | None = None, tier: Sequence[str] = server.DEFAULTS,
             extra: Sequence[str] = (), seed: int = 1, period_s: float = 0.5) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The conversation that fills the context (module doc): ``(turns, samples, info)``. ``n_ctx``: the
    slot context to fill (None: the one the server reports). ``limit_mib`` None: no limit (the
    reference); ``tier=()`` with ``extra=("--no-repack", "-c", N)``: stock llama-server."""
    lim = memlimit.MemoryLimit(limit_mib) if limit_mib is not None else None
    rows, info = [], {}
    try:
        kills0 = (lim.oom_kills() or 0) if lim is not None else 0
        with server.running_server(model, limit=lim, log_path=log_path, extra=extra, tier=tier) as srv:
            info = _context(log_path)
            ctx = int(n_ctx or info["n_ctx_slot"])
            rng = random.Random(seed)
            convo: list[int] = []
            with Sampler(srv.url, period_s) as s:
                for i, n in enumerate(turn_lengths(ctx, fractions, n_gen)):
                    prompt = convo + new_tokens(n - len(convo), rng)
                    t_start = time.monotonic()
                    a = complete(srv.url, prompt, n_gen)
                    after = s.sample()
                    convo = prompt + a["ids"]
                    rows.append(dict(turn=i, n_ctx=ctx, fill_tokens=len(convo), fill=len(convo) / ctx,
                                     prompt_n=a["prompt_n"], predicted_n=a["predicted_n"], decode_ts=a["decode_ts"],
                                     prefill_ts=a["prefill_ts"], turn_s=time.monotonic() - t_start,
                                     ids=" ".join(map(str, a["ids"])), **after))
            samples = pd.DataFrame(s.rows)
        info.update(status="ok")
    except server.ServerExited as e:
        samples = pd.DataFrame()
        info.update(status=e.status, error=e.log_tail)
    finally:
        if lim is not None:
            info.update(oom_kills=(lim.oom_kills() or 0) - kills0, peak_mib=lim.peak_mib())
            lim.close()
    return pd.DataFrame(rows), samples, info


def compare_turns(turns: pd.DataFrame, ref: pd.DataFrame) -> list[bool]:
    """Per turn: the generated ids identical to the reference's."""
    return [a == b for a, b in zip(turns.ids, ref.ids)] + [False] * abs(len(turns) - len(ref))


def medians(runs: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Median decode tok/s per ``keys`` over the repeats that ran (``status`` ok), with
    :func:`pybmoe.bench.noise.flag_spread`'s ``spread`` (largest over smallest), ``max_load_1m`` and
    ``noisy``."""
    ok = runs[runs.status == "ok"]
    g = ok.groupby(list(keys), dropna=False)
    out = g.agg(median_ts=("decode_ts", "median"), min_ts=("decode_ts", "min"), max_ts=("decode_ts", "max"),
                repeats=("decode_ts", "size")).reset_index()
    return noise.flag_spread(out, ok, keys)


def plot_fill(turns: pd.DataFrame, path: Path, title: str, ref: pd.DataFrame | None = None) -> Path:
    """Budget and committed KV (MiB) and decode tok/s against the context's fill, one colour per ``label``
    (its cache cycle dashed); ``ref``: the stock runs' decode (``label`` ending in its setting's label),
    dotted in the same colour."""
    from .plot import _pyplot
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, d) in enumerate(turns.groupby("label")):
        c = colors[i % len(colors)]
        d = d.sort_values("fill")
        a1.plot(100 * d.fill, d.budget_mib, marker="o", color=c, label=f"{label}: budget")
        a1.plot(100 * d.fill, d.kv_committed_mib, marker="x", linestyle=":", color=c, label=f"{label}: KV committed")
        if d.cycle_mb.notna().any():
            a1.axhline(d.cycle_mb.dropna().iloc[0], color=c, linestyle="--", linewidth=0.7)
        a2.plot(100 * d.fill, d.decode_ts, marker="o", color=c, label=f"{label}: the tier")
        if ref is not None:
            r = ref[ref.label.str.startswith(label)].sort_values("fill")
            if len(r):
                a2.plot(100 * r.fill, r.decode_ts, marker=".", linestyle=":", color=c,
                        label=f"{label.split(' @')[0]}: stock, no limit")
    a1.plot([], [], color="grey", linestyle="--", linewidth=0.7, label="each model's cache cycle")
    a1.set_xlabel("context filled, %")
    a1.set_ylabel("MiB")
    a2.set_xlabel("context filled, %")
    a2.set_ylabel("decode tok/s (the server's own)")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
