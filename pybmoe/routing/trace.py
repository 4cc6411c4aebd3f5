"""Routing traces: which experts the router picked, token by token, layer by layer.

The canonical form is a pandas DataFrame with one row per **lookup** (one routed expert of
one token at one MoE layer)::

    column    dtype     meaning
    workload  category  the prompt / request the token belongs to (each replays from a cold cache)
    phase     category  "prefill" or "decode"
    ubatch    int32     0-based index of the engine ubatch (one graph) within the workload
    token     int32     0-based running token index within the workload
    layer     int16     model layer index (need not be contiguous: dense layers have no rows)
    rank      int16     position in router order, 0 .. top-k - 1
    expert    int32     expert id, 0 .. n_expert - 1
    hit       int8      the engine cache's answer: 1 hit, 0 miss, -1 not served / unknown

Files (all read by :func:`read_trace`, format sniffed from the content):

- **engine CSV** (what ``--moe-trace FILE`` writes, and what :func:`write_trace` writes for
  ``.csv``): one comment line ``# pybmoe-trace v1 key=value ...`` (keys ``n_layer``,
  ``n_expert``, ``n_expert_used``, ``slots``, ``inserts``; unknown keys are kept in
  :attr:`TraceMeta.extra`), then the header ``workload,phase,ubatch,token,layer,rank,expert,hit``
  and one row per lookup. ``hit`` is the VRAM tier's answer (1 hit, 0 miss, -1 not served). With
  the stream tier on (``--moe-stream-cache-mb``) the engine adds a ninth column, ``ram_hit``: its
  answer for the same lookup (-1: computed on a device, or not streamed).
- **Parquet** (``.parquet``): the same columns; the comment line is kept in the schema metadata
  under ``pybmoe-trace``.
- **granite JSON** (the bundled ``pybmoe/data/granite-3.0-1b-a400m-routing.json``, short name
  ``granite``: :data:`PACKAGED_TRACES`): ``{num_layers,
  num_experts, top_k, prompts: {name: {prefill: [T][L][k], decode: [D][L][k]}}}``. Each prompt
  is a workload; its prefill is one ubatch (tokens ``0..T-1``) and each decode token is its own
  ubatch; ``hit`` is -1.
- **JSONL route logs**: one object per line ``{"layer": L, "token_idx": t, "topk_ids": [...]}``.
  One workload (named after the file), decode phase, each token its own ubatch; tokens are
  renumbered 0.. in ``token_idx`` order.

:func:`trace_stats` computes the locality statistics (expert-frequency Gini per layer,
consecutive-token overlap, reuse distances, static hot-set coverage in and out of sample).

Errors: :class:`TraceFormatError` (a :class:`ValueError`) names the file, the line or field and
the accepted values.
"""
from __future__ import annotations

import csv
import io
import json
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

#: Version written in (and accepted from) the first line of an engine CSV.
FORMAT_VERSION = 1
MAGIC = "# pybmoe-trace"
COLUMNS = ("workload", "phase", "ubatch", "token", "layer", "rank", "expert", "hit")
#: Columns kept when present: the stream tier's answer per lookup.
OPTIONAL_COLUMNS = ("ram_hit",)
PHASES = ("prefill", "decode")
#: Phase selections accepted by the statistics and the simulator.
PHASE_CHOICES = ("prefill", "decode", "all")
_INT_DTYPES = {"ubatch": np.int32, "token": np.int32, "layer": np.int16, "rank": np.int16,
               "expert": np.int32, "hit": np.int8, "ram_hit": np.int8}
_META_KEYS = ("n_layer", "n_expert", "n_expert_used", "slots", "inserts")
FORMATS = ("auto", "engine", "parquet", "granite", "jsonl")
#: The traces the package ships, by short name: wherever pybmoe reads a trace (:func:`read_trace`;
#: ``pybmoe trace``, ``simulate``, ``size --trace``), the short name stands for the file, from any
#: directory (a file of that name is ``./granite``).
PACKAGED_TRACES = {"granite": Path(__file__).resolve().parent.parent / "data" / "granite-3.0-1b-a400m-routing.json"}
#: What each short name is (the help and the errors say it).
PACKAGED_TRACE_DOCS = {"granite": "the bundled granite-3.0-1b-a400m routing trace: 24 layers, 32 experts, top-8"}


def accepted_traces() -> str:
    """The words an error about a trace path ends with: what is accepted, the short names included."""
    names = "; ".join(f"{k} ({v})" for k, v in PACKAGED_TRACE_DOCS.items())
    return f"accepted: a trace file (engine CSV, Parquet, granite JSON, JSONL route log) or a packaged trace's short name: {names}"


def trace_path(path: str | Path) -> Path:
    """The file a trace argument names: a short name of :data:`PACKAGED_TRACES` (``"granite"``) is
    the packaged file, anything else the path itself. Raises :class:`FileNotFoundError` when the file
    is not there; the message names the accepted short names."""
    name = str(path)
    resolved = PACKAGED_TRACES.get(name, Path(path))
    if not resolved.is_file():
        raise FileNotFoundError(f"trace {name} not found; {accepted_traces()}")
    return resolved


class TraceFormatError(ValueError):
    """A trace file or frame does not follow the format; the message names the place and the accepted values."""


@dataclass(frozen=True)
class TraceMeta:
    """Shape of the model a trace came from (counts), plus the engine cache settings if known.

    ``n_layer``: model layers (block count; layer indices are below it), ``n_expert``: experts
    per MoE layer, ``n_expert_used``: top-k, ``slots`` / ``inserts``: the engine's
    ``--moe-expert-cache`` / ``--moe-expert-cache-inserts`` when the trace was captured with the
    cache (None when unknown), ``extra``: any other ``key=value`` of the header.
    """

    n_layer: int
    n_expert: int
    n_expert_used: int
    slots: int | None = None
    inserts: int | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def header_line(self) -> str:
        """The ``# pybmoe-trace v1 ...`` comment line (no newline)."""
        kv = {"n_layer": self.n_layer, "n_expert": self.n_expert, "n_expert_used": self.n_expert_used}
        if self.slots is not None:
            kv["slots"] = self.slots
        if self.inserts is not None:
            kv["inserts"] = self.inserts
        kv.update(self.extra)
        return f"{MAGIC} v{FORMAT_VERSION} " + " ".join(f"{k}={v}" for k, v in kv.items())


@dataclass(frozen=True)
class Trace:
    """A routing trace: the canonical ``frame`` (see the module doc) and its ``meta``."""

    frame: pd.DataFrame
    meta: TraceMeta
    source: str = ""

    @property
    def workloads(self) -> list[str]:
        """Workload names in order of first appearance."""
        return [str(w) for w in pd.unique(self.frame["workload"])]

    @property
    def layers(self) -> np.ndarray:
        """The distinct layer indices present, ascending (int)."""
        return np.unique(self.frame["layer"].to_numpy()).astype(np.int64)

    def select(self, phase: str = "all", workload: str | None = None) -> "Trace":
        """The rows of one phase (``prefill``, ``decode`` or ``all``) and optionally one workload.

        Raises :class:`ValueError` for an unknown phase or workload.
        """
        mask = phase_mask(self.frame, phase)
        if workload is not None:
            if workload not in self.workloads:
                raise ValueError(f"workload {workload!r} is not in the trace; accepted: {self.workloads}")
            mask &= (self.frame["workload"] == workload).to_numpy()
        return replace(self, frame=self.frame.loc[mask].reset_index(drop=True))


def phase_mask(frame: pd.DataFrame, phase: str) -> np.ndarray:
    """Boolean mask ``[len(frame)]`` of the rows in ``phase`` (``prefill``, ``decode`` or ``all``)."""
    if phase not in PHASE_CHOICES:
        raise ValueError(f"phase {phase!r} is not accepted; accepted: {', '.join(PHASE_CHOICES)}")
    if phase == "all":
        return np.ones(len(frame), dtype=bool)
    return (frame["phase"] == phase).to_numpy()


# --------------------------------------------------------------------------- building and checking

def _categorical(values: Any, categories: Sequence[str] | None = None) -> pd.Categorical:
    """String categories; without ``categories`` they are the values in order of first appearance."""
    if categories is None:
        if isinstance(getattr(values, "dtype", None), pd.CategoricalDtype):
            codes = np.asarray(values.cat.codes)
            cats = np.asarray(values.cat.categories).astype(str)
            if (codes < 0).any():
                raise TraceFormatError("column 'workload' has missing values; accepted: a name on every row")
            seen = pd.unique(codes)
            remap = np.full(len(cats), -1, dtype=np.int64)
            remap[seen] = np.arange(len(seen))
            return pd.Categorical.from_codes(remap[codes], categories=list(cats[seen]))
        codes, uniques = pd.factorize(pd.Series(values).astype(str), sort=False)
        return pd.Categorical.from_codes(codes, categories=[str(u) for u in uniques])
    if isinstance(getattr(values, "dtype", None), pd.CategoricalDtype):
        return pd.Series(values).cat.set_categories(list(categories)).array
    return pd.Categorical(values, categories=list(categories))


#: Accepted values of the integer columns (inclusive), and of the header's counts.
_INT_RANGE = {c: ((-1, 1) if c in ("hit", "ram_hit") else (0, int(np.iinfo(dt).max))) for c, dt in _INT_DTYPES.items()}
_META_RANGE = {"n_layer": (1, int(np.iinfo(np.int16).max) + 1), "n_expert": (1, int(np.iinfo(np.int32).max)),
               "n_expert_used": (1, int(np.iinfo(np.int16).max) + 1), "slots": (0, int(np.iinfo(np.int32).max)),
               "inserts": (0, int(np.iinfo(np.int32).max))}
_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_BOM = "\ufeff"


def _row(where: str, i: int | None) -> str:
    return f"{where}: row {i}" if i is not None else where


def _int_column(col: pd.Series, c: str, where: str) -> np.ndarray:
    """``col`` as int64, or :class:`TraceFormatError` naming the first bad row, its value and the accepted range."""
    lo, hi = _INT_RANGE[c]
    if isinstance(col.dtype, pd.CategoricalDtype):
        col = pd.Series(np.asarray(col, dtype=object), index=col.index)
    dt = col.dtype
    if pd.api.types.is_bool_dtype(dt) or not (pd.api.types.is_integer_dtype(dt) or pd.api.types.is_float_dtype(dt)
                                              or pd.api.types.is_object_dtype(dt) or pd.api.types.is_string_dtype(dt)):
        raise TraceFormatError(f"{where}: column {c!r} has the type {dt}; accepted: integers {lo} .. {hi}")
    missing = col.isna().to_numpy()
    if missing.any():
        i = int(np.flatnonzero(missing)[0])
        raise TraceFormatError(f"{_row(where, i)}: column {c!r} has a missing value; accepted: integers {lo} .. {hi}")
    if pd.api.types.is_integer_dtype(dt):
        raw = col.to_numpy()
        bad = (raw > hi) if raw.dtype.kind == "u" else (raw < lo) | (raw > hi)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TraceFormatError(f"{_row(where, i)}: column {c!r} has the value {int(raw[i])}; accepted: {lo} .. {hi}")
        return raw.astype(np.int64)
    if pd.api.types.is_float_dtype(dt):
        raw = col.to_numpy(dtype=np.float64)
        with np.errstate(invalid="ignore"):
            nonint = ~np.isfinite(raw) | (raw != np.floor(raw))
        if nonint.any():
            i = int(np.flatnonzero(nonint)[0])
            raise TraceFormatError(f"{_row(where, i)}: column {c!r} has the non-integer value {float(raw[i])!r}; "
                                   f"accepted: integers {lo} .. {hi}")
        bad = (raw < lo) | (raw > hi)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TraceFormatError(f"{_row(where, i)}: column {c!r} has the value {raw[i]:.0f}; accepted: {lo} .. {hi}")
        return raw.astype(np.int64)
    out = np.empty(len(col), dtype=np.int64)       # Python objects (a frame built by hand): one by one
    for i, x in enumerate(col.tolist()):
        if isinstance(x, (bool, np.bool_)):
            v = None
        elif isinstance(x, (int, np.integer)):
            v = int(x)
        elif isinstance(x, (float, np.floating)):
            v = int(x) if np.isfinite(x) and x == np.floor(x) else None
        elif isinstance(x, str) and _INT_TEXT.fullmatch(x.strip()):
            v = int(x)
        else:
            v = None
        if v is None:
            raise TraceFormatError(f"{_row(where, i)}: column {c!r} has the non-integer value {x!r:.60}; "
                                   f"accepted: integers {lo} .. {hi}")
        if not lo <= v <= hi:
            raise TraceFormatError(f"{_row(where, i)}: column {c!r} has the value {v}; accepted: {lo} .. {hi}")
        out[i] = v
    return out


def from_frame(frame: pd.DataFrame, meta: TraceMeta | None = None, source: str = "") -> Trace:
    """Check and normalise a frame with the canonical :data:`COLUMNS` into a :class:`Trace`.

    ``hit`` may be missing (filled with -1). Missing ``meta`` fields are inferred: ``n_layer`` =
    max layer + 1, ``n_expert`` = max expert + 1, ``n_expert_used`` = max rank + 1.
    Raises :class:`TraceFormatError` for a missing or repeated column, a missing workload, a bad
    phase, a non-integer, negative or out-of-range value (naming the row, the column, the value
    and the accepted range).
    """
    where = source or "frame"
    dup = sorted({str(c) for c in frame.columns[frame.columns.duplicated()]})
    if dup:
        raise TraceFormatError(f"{where}: column(s) {dup} appear more than once; accepted: each column once")
    frame = frame.copy()
    if "hit" not in frame.columns:
        frame["hit"] = -1
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise TraceFormatError(f"{where}: missing column(s) {missing}; accepted columns: {', '.join(COLUMNS)}")
    frame = frame[list(COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in frame.columns]].reset_index(drop=True)
    wl = frame["workload"]
    no_name = wl.isna().to_numpy()
    if no_name.any():
        raise TraceFormatError(f"{_row(where, int(np.flatnonzero(no_name)[0]))}: column 'workload' has a missing "
                               "value; accepted: a name on every row")
    ph = frame["phase"]
    if isinstance(ph.dtype, pd.CategoricalDtype):
        ok_codes = np.array([str(x) in PHASES for x in ph.cat.categories] + [False])   # code -1 (missing): bad
        bad_phase = ~ok_codes[ph.cat.codes.to_numpy()]
    else:
        if pd.api.types.infer_dtype(ph, skipna=False) == "string":    # all str: isin is exact and fast
            bad_phase = ~ph.isin(PHASES).to_numpy(dtype=bool)
        else:                  # other objects (an array equal to 'decode' passes isin): one by one
            bad_phase = ~ph.map(lambda x: isinstance(x, str) and x in PHASES).to_numpy(dtype=bool)
    if bad_phase.any():
        first = int(np.flatnonzero(bad_phase)[0])
        shown = list(dict.fromkeys(repr(x)[:40] for x in ph[bad_phase].head(1000).astype(object)))[:5]
        raise TraceFormatError(f"{_row(where, first)}: phase value(s) [{', '.join(shown)}]; accepted: {', '.join(PHASES)}")
    out = {"workload": _categorical(wl), "phase": _categorical(ph, PHASES)}
    for c, dt in _INT_DTYPES.items():
        if c in frame.columns:
            out[c] = _int_column(frame[c], c, where).astype(dt)
    df = pd.DataFrame(out)
    if len(df) == 0:
        raise TraceFormatError(f"{where}: the trace has no rows; accepted: at least one lookup")
    inferred = TraceMeta(int(df["layer"].max()) + 1, int(df["expert"].max()) + 1, int(df["rank"].max()) + 1)
    meta = meta or inferred
    for name, have, need in (("n_layer", meta.n_layer, inferred.n_layer), ("n_expert", meta.n_expert, inferred.n_expert),
                             ("n_expert_used", meta.n_expert_used, inferred.n_expert_used)):
        if have < need:
            col = {"n_layer": "layer", "n_expert": "expert", "n_expert_used": "rank"}[name]
            i = int(np.flatnonzero(df[col].to_numpy() == need - 1)[0])
            raise TraceFormatError(f"{_row(where, i)}: column {col!r} has the value {need - 1} but the header says "
                                   f"{name}={have}; accepted: {col} 0 .. {have - 1}")
    return Trace(df, meta, source)


def make_trace(routing: np.ndarray, *, workload: str = "w0", phase: str = "decode", n_expert: int | None = None,
               ubatch_tokens: int = 1) -> Trace:
    """A trace from a dense routing array ``[tokens, layers, top_k]`` of expert ids (one workload).

    Tokens are grouped into ubatches of ``ubatch_tokens`` consecutive tokens; ``hit`` is -1.
    Handy for tests and synthetic benchmarks. Raises :class:`TraceFormatError` for a bad shape.
    """
    r = np.asarray(routing)
    if r.ndim != 3:
        raise TraceFormatError(f"routing has shape {r.shape}; accepted: [tokens, layers, top_k]")
    t, l, k = r.shape
    tok, lay, rnk = np.meshgrid(np.arange(t), np.arange(l), np.arange(k), indexing="ij")
    df = pd.DataFrame({"workload": workload, "phase": phase, "ubatch": (tok // ubatch_tokens).ravel(),
                       "token": tok.ravel(), "layer": lay.ravel(), "rank": rnk.ravel(), "expert": r.ravel(), "hit": -1})
    meta = TraceMeta(l, n_expert if n_expert is not None else int(r.max()) + 1, k)
    return from_frame(df, meta, f"routing[{t}x{l}x{k}]")


def concat(traces: Iterable[Trace]) -> Trace:
    """Several traces as one (their workloads must have distinct names); meta is the widest shape."""
    traces = list(traces)
    if not traces:
        raise ValueError("concat needs at least one trace")
    names: list[str] = []
    for t in traces:
        dup = set(names) & set(t.workloads)
        if dup:
            raise ValueError(f"workload name(s) {sorted(dup)} appear in more than one trace; accepted: distinct names")
        names += t.workloads
    frame = pd.concat([t.frame.drop(columns="workload") for t in traces], ignore_index=True)
    frame.insert(0, "workload", union_categoricals([t.frame["workload"] for t in traces]))
    m = traces[0].meta
    meta = TraceMeta(max(t.meta.n_layer for t in traces), max(t.meta.n_expert for t in traces),
                     max(t.meta.n_expert_used for t in traces), m.slots, m.inserts, dict(m.extra))
    return from_frame(frame, meta, "+".join(t.source for t in traces))


# --------------------------------------------------------------------------- readers

def _kind(v: Any) -> str:
    """What a JSON value is, in words (for messages)."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            float: "a number"}.get(type(v), "an integer" if isinstance(v, int) else type(v).__name__)


def _json_int(v: Any, where: str, lo: int, hi: int) -> int:
    """``v`` when it is a JSON integer in ``lo .. hi`` (not a boolean, not a number with a fraction)."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise TraceFormatError(f"{where} is {v!r:.60} ({_kind(v)}); accepted: an integer {lo} .. {hi}")
    return v


def _decode(data: bytes, where: str, line0: int = 1) -> str:
    """``data`` as UTF-8 text without a leading byte-order mark; :class:`TraceFormatError` names the line of a bad byte."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line0 + data.count(b"\n", 0, e.start)
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise TraceFormatError(f"{where}:{line}: byte 0x{data[e.start]:02x} at column {col} is not UTF-8 text; "
                               "accepted: a UTF-8 text file") from None
    return text[1:] if line0 == 1 and text.startswith(_BOM) else text


def _json_loads(text: str, where: str, what: str, line: int | None = None) -> Any:
    """Parse JSON ``text``; :class:`TraceFormatError` names the line (``line``, or the one in the text) and ``what``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}:{line or e.lineno}: not JSON ({e.msg} at column {e.colno}); "
                               f"accepted: {what}") from None
    except RecursionError:
        raise TraceFormatError(f"{where}{f':{line}' if line else ''}: JSON nested too deeply to read; "
                               f"accepted: {what}") from None


def parse_header(line: str, where: str = "trace") -> TraceMeta:
    """Parse a ``# pybmoe-trace v1 key=value ...`` line into a :class:`TraceMeta`.

    Raises :class:`TraceFormatError` for another magic or version, a token that is not
    ``key=value``, a key given twice, a known key that is not an integer in its range
    (``n_layer`` 1 .. 32768, ``n_expert`` 1 .. 2^31 - 1, ``n_expert_used`` 1 .. min(32768,
    ``n_expert``), ``slots`` and ``inserts`` 0 .. 2^31 - 1), or a missing
    ``n_layer``/``n_expert``/``n_expert_used``.
    """
    parts = line.strip().split()
    if len(parts) < 3 or " ".join(parts[:2]) != MAGIC:
        raise TraceFormatError(f"{where}: line 1 is {line.strip()[:60]!r}; accepted: '{MAGIC} v{FORMAT_VERSION} key=value ...'")
    if parts[2] != f"v{FORMAT_VERSION}":
        raise TraceFormatError(f"{where}: header: trace format {parts[2][:40]!r}; accepted: v{FORMAT_VERSION}")
    kv: dict[str, str] = {}
    for p in parts[3:]:
        if "=" not in p:
            raise TraceFormatError(f"{where}: header token {p[:60]!r}; accepted: key=value")
        k, v = p.split("=", 1)
        if k in kv:
            raise TraceFormatError(f"{where}: header key {k[:40]!r} is given twice; accepted: each key once")
        kv[k] = v
    ints: dict[str, int | None] = {}
    for k in _META_KEYS:
        if k in kv:
            v = kv.pop(k)
            lo, hi = _META_RANGE[k]
            if not _INT_TEXT.fullmatch(v) or not lo <= int(v) <= hi:
                raise TraceFormatError(f"{where}: header {k}={v[:40]!r}; accepted: an integer {lo} .. {hi}")
            ints[k] = int(v)
    need = [k for k in _META_KEYS[:3] if k not in ints]
    if need:
        raise TraceFormatError(f"{where}: header lacks {need}; accepted header keys: {', '.join(_META_KEYS)}")
    if ints["n_expert_used"] > ints["n_expert"]:
        raise TraceFormatError(f"{where}: header n_expert_used={ints['n_expert_used']} with n_expert={ints['n_expert']}; "
                               f"accepted: n_expert_used 1 .. n_expert")
    return TraceMeta(ints["n_layer"], ints["n_expert"], ints["n_expert_used"], ints.get("slots"), ints.get("inserts"), kv)


def _check_csv_rows(path: Path, columns: list[str], meta: TraceMeta) -> None:
    """Scan the rows of an engine CSV line by line and raise :class:`TraceFormatError` at the first bad one
    (its line, field, value and what is accepted). Used to explain a file the fast reader refused."""
    bounds = dict(_INT_RANGE)
    for c, key in (("layer", "n_layer"), ("expert", "n_expert"), ("rank", "n_expert_used")):
        bounds[c] = (0, getattr(meta, key) - 1)
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            if no <= 2:
                continue
            text = _decode(raw, str(path), no)
            if not text.strip():
                continue
            try:
                fields = next(csv.reader([text.rstrip("\r\n")], strict=True), [])
            except csv.Error as e:
                raise TraceFormatError(f"{path}:{no}: not a CSV row ({e}); accepted: {','.join(columns)}") from None
            if len(fields) != len(columns):
                raise TraceFormatError(f"{path}:{no}: {len(fields)} fields; accepted: {len(columns)} "
                                       f"({','.join(columns)})")
            for c, v in zip(columns, fields):
                if c == "phase" and v not in PHASES:
                    raise TraceFormatError(f"{path}:{no}: phase value(s) [{v[:40]!r}]; accepted: {', '.join(PHASES)}")
                if c in bounds:
                    lo, hi = bounds[c]
                    if not _INT_TEXT.fullmatch(v.strip()):
                        raise TraceFormatError(f"{path}:{no}: column {c!r} has the non-integer value {v[:40]!r}; "
                                               f"accepted: integers {lo} .. {hi}")
                    x = int(v)
                    if x < lo or x > hi:
                        key = {"layer": "n_layer", "expert": "n_expert", "rank": "n_expert_used"}.get(c)
                        if key and x > hi:
                            raise TraceFormatError(f"{path}:{no}: column {c!r} has the value {x} but the header says "
                                                   f"{key}={hi + 1}; accepted: {c} 0 .. {hi}")
                        raise TraceFormatError(f"{path}:{no}: column {c!r} has the value {x}; accepted: {lo} .. {hi}")


def read_engine_csv(path: str | Path) -> Trace:
    """Read an engine CSV (``--moe-trace FILE``, or :func:`write_trace` to ``.csv``). See the module doc.

    A UTF-8 byte-order mark before the header is skipped. Raises :class:`TraceFormatError`, naming
    the line, for a bad header or column line, a row with the wrong number of fields, a value that
    is not an integer in its column's range, an unknown phase, a workload name with a line break in
    it, or a last row without its line end (a file cut off in the middle of a row).
    """
    path = Path(path)
    where = str(path)
    with open(path, "rb") as f:
        first = _decode(f.readline(), where, 1)
        second_raw = f.readline()
    meta = parse_header(first, where)
    second = _decode(second_raw, where, 2).strip()
    columns = second.split(",")
    if columns not in (list(COLUMNS), list(COLUMNS + OPTIONAL_COLUMNS)):
        raise TraceFormatError(f"{path}: line 2 is {second[:80]!r}; accepted: {','.join(COLUMNS)}"
                               f"[,{','.join(OPTIONAL_COLUMNS)}]")
    data = path.read_bytes()
    NL = b"\n"
    if not data.endswith(NL):
        raise TraceFormatError(f"{path}:{data.count(NL) + 1}: the last line has no line end (the file is cut off); "
                               "accepted: every row ending in a newline, as the engine writes it")
    if data.count(b"\r") != data.count(b"\r\n"):
        at = next(m.start() for m in re.finditer(b"\r(?!\n)", data))
        raise TraceFormatError(f"{path}:{data.count(NL, 0, at) + 1}: a carriage return inside a line; accepted: "
                               "lines ending in a newline (or CR LF)")
    # one column more than the header: a row with an extra field fills it (and is refused), where pandas
    # would otherwise take the first row's extra field for an index or drop it
    names = columns + ["__extra__"]
    dtypes = {"workload": "category", "phase": "category", "__extra__": str, **{c: np.int64 for c in _INT_DTYPES}}
    try:
        with warnings.catch_warnings():          # pandas warns of the rows it then refuses: the error says it
            warnings.simplefilter("ignore")
            df = pd.read_csv(io.BytesIO(data), skiprows=2, header=None, names=names, dtype=dtypes, keep_default_na=False,
                             na_filter=False, index_col=False, encoding="utf-8")
        extra = df.pop("__extra__").to_numpy(dtype=str) != ""
        if extra.any():
            raise ValueError(f"row {int(np.flatnonzero(extra)[0])} has an extra field")
        if len(df):
            broken = [w for w in df["workload"].cat.categories if "\n" in str(w) or "\r" in str(w)]
            if broken:
                raise ValueError(f"workload {str(broken[0])[:60]!r} spans lines (an unmatched quote)")
        return from_frame(df, meta, where)
    except (ValueError, OverflowError) as e:   # TraceFormatError, pandas' parser errors, UnicodeDecodeError
        _check_csv_rows(path, columns, meta)   # raises at the first bad line when one is
        if isinstance(e, TraceFormatError):
            raise
        raise TraceFormatError(f"{path}: {e}; accepted: rows of {','.join(columns)} (phase prefill|decode, "
                               "integer columns in range)") from None


def read_parquet(path: str | Path) -> Trace:
    """Read a Parquet trace written by :func:`write_trace` (meta from the schema metadata, else inferred).

    Raises :class:`TraceFormatError` for a file pyarrow cannot read, a schema header that is not
    a ``# pybmoe-trace v1`` line, a column that is not one of :data:`COLUMNS` or
    :data:`OPTIONAL_COLUMNS`, and any bad value (see :func:`from_frame`).
    """
    path = Path(path)
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
        md = table.schema.metadata or {}
        frame = table.to_pandas()
    except Exception as e:   # noqa: BLE001 - whatever pyarrow raises for a mangled file, named here
        raise TraceFormatError(f"{path}: not a readable Parquet trace ({type(e).__name__}: {str(e)[:200]}); "
                               f"accepted: a Parquet file of the columns {', '.join(COLUMNS)}") from None
    meta = None
    if b"pybmoe-trace" in md:
        try:
            header = md[b"pybmoe-trace"].decode("utf-8")
        except UnicodeDecodeError:
            raise TraceFormatError(f"{path}: the schema metadata 'pybmoe-trace' is not UTF-8 text; "
                                   f"accepted: '{MAGIC} v{FORMAT_VERSION} key=value ...'") from None
        meta = parse_header(header, f"{path} (schema metadata)")
    unknown = [str(c) for c in frame.columns if c not in COLUMNS + OPTIONAL_COLUMNS]
    if unknown:
        raise TraceFormatError(f"{path}: unknown column(s) {unknown[:5]}; accepted columns: "
                               f"{', '.join(COLUMNS + OPTIONAL_COLUMNS)}")
    return from_frame(frame, meta, str(path))


def _routing_array(v: Any, where: str, L: int, K: int, E: int) -> np.ndarray | None:
    """A granite ``[tokens][L][K]`` array of expert ids as int64, None for ``[]``."""
    if isinstance(v, list) and not v:
        return None
    accepted = f"accepted: [tokens, {L}, {K}] expert ids 0 .. {E - 1}"
    try:
        arr = np.asarray(v)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise TraceFormatError(f"{where} is not a rectangular array of numbers; {accepted}") from None
    if arr.ndim != 3 or arr.shape[1:] != (L, K):
        raise TraceFormatError(f"{where} has shape {arr.shape}; accepted: [tokens, {L}, {K}]")
    if arr.dtype.kind not in "iu":
        flat = arr.ravel().tolist()
        i = next((i for i, x in enumerate(flat) if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < E), 0)
        t, rest = divmod(i, L * K)
        raise TraceFormatError(f"{where}[{t}][{rest // K}][{rest % K}] is {flat[i]!r:.40} ({_kind(flat[i])}); "
                               f"accepted: an integer 0 .. {E - 1}")
    bad = (arr < 0) | (arr >= E)
    if bad.any():
        t, l, k = (int(x) for x in np.argwhere(bad)[0])
        raise TraceFormatError(f"{where}[{t}][{l}][{k}] is {arr[t, l, k]}; accepted: an expert id 0 .. {E - 1} "
                               f"(num_experts={E})")
    return arr.astype(np.int64)


def read_granite_json(path: str | Path) -> Trace:
    """Import the granite routing JSON (see the module doc): one workload per prompt, in file order.

    Raises :class:`TraceFormatError` naming the field (``num_layers``, ``prompts.NAME.decode[t][l][k]``,
    ...) for anything that is not that shape: not UTF-8 or not JSON, a count that is not a
    positive integer, a routing array of another shape, an id that is not an integer below
    ``num_experts``.
    """
    path = Path(path)
    what = "an object {num_layers, num_experts, top_k, prompts}"
    doc = _json_loads(_decode(path.read_bytes(), str(path)), str(path), what)
    if not isinstance(doc, dict):
        raise TraceFormatError(f"{path}: the document is {_kind(doc)}; accepted: {what}")
    for key in ("num_layers", "num_experts", "top_k", "prompts"):
        if key not in doc:
            raise TraceFormatError(f"{path}: no {key!r}; accepted: {{num_layers, num_experts, top_k, prompts}}")
    L = _json_int(doc["num_layers"], f"{path}: num_layers", *_META_RANGE["n_layer"])
    E = _json_int(doc["num_experts"], f"{path}: num_experts", *_META_RANGE["n_expert"])
    K = _json_int(doc["top_k"], f"{path}: top_k", 1, min(E, _META_RANGE["n_expert_used"][1]))
    if not isinstance(doc["prompts"], dict):
        raise TraceFormatError(f"{path}: prompts is {_kind(doc['prompts'])}; accepted: an object "
                               "{name: {prefill, decode}}")
    frames = []
    for name, p in doc["prompts"].items():
        if not isinstance(p, dict):
            raise TraceFormatError(f"{path}: prompts.{name} is {_kind(p)}; accepted: an object with prefill and "
                                   "decode arrays")
        t0 = 0
        ub0 = 0
        for phase in PHASES:
            if phase not in p:
                raise TraceFormatError(f"{path}: prompt {name!r} has no {phase!r}; accepted: prefill and decode arrays")
            arr = _routing_array(p[phase], f"{path}: prompts.{name}.{phase}", L, K, E)
            if arr is None:
                continue
            n = arr.shape[0]
            tok, lay, rnk = np.meshgrid(np.arange(n), np.arange(L), np.arange(K), indexing="ij")
            ub = np.zeros_like(tok) if phase == "prefill" else tok
            frames.append(pd.DataFrame({"workload": name, "phase": phase, "ubatch": (ub0 + ub).ravel(),
                                        "token": (t0 + tok).ravel(), "layer": lay.ravel(), "rank": rnk.ravel(),
                                        "expert": arr.ravel(), "hit": -1}))
            t0 += n
            ub0 += 1 if phase == "prefill" else n
    if not frames:
        raise TraceFormatError(f"{path}: no prompt has any token; accepted: prompts with prefill or decode tokens")
    return from_frame(pd.concat(frames, ignore_index=True), TraceMeta(L, E, K), str(path))


def read_route_jsonl(path: str | Path, *, workload: str | None = None, n_expert: int | None = None) -> Trace:
    """Import a JSONL route log (``{"layer", "token_idx", "topk_ids"}`` per line) as one decode workload.

    ``workload`` defaults to the file name without its suffix; ``n_expert`` to max id + 1.
    Raises :class:`TraceFormatError` naming the line and the field for a line that is not UTF-8
    or not a JSON object with those keys, a value that is not an integer in its range (``layer``
    0 .. 32767, ``token_idx`` 0 .. 2^63 - 1, ids 0 .. 2^31 - 2), or ragged ``topk_ids``.
    """
    path = Path(path)
    layers, tokens, ids = [], [], []
    k = None
    what = '{"layer": int, "token_idx": int, "topk_ids": [int, ...]} on every line'
    lay_hi = _INT_RANGE["layer"][1]
    tok_hi = int(np.iinfo(np.int64).max)
    id_hi = _INT_RANGE["expert"][1] - 1
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            line = _decode(raw, str(path), no)
            if not line.strip():
                continue
            o = _json_loads(line, str(path), what, no)
            if not isinstance(o, dict):
                raise TraceFormatError(f"{path}:{no}: the line is {_kind(o)}; accepted: {what}")
            for key in ("layer", "token_idx", "topk_ids"):
                if key not in o:
                    raise TraceFormatError(f"{path}:{no}: no {key!r}; accepted: {what}")
            lay = _json_int(o["layer"], f"{path}:{no}: layer", 0, lay_hi)
            tok = _json_int(o["token_idx"], f"{path}:{no}: token_idx", 0, tok_hi)
            if not isinstance(o["topk_ids"], list):
                raise TraceFormatError(f"{path}:{no}: topk_ids is {_kind(o['topk_ids'])}; accepted: {what}")
            top = [_json_int(x, f"{path}:{no}: topk_ids[{j}]", 0, id_hi) for j, x in enumerate(o["topk_ids"])]
            if k is None:
                k = len(top)
            if len(top) != k or k == 0:
                raise TraceFormatError(f"{path}:{no}: {len(top)} topk_ids; accepted: {k or 'at least 1'} on every line")
            if k > _META_RANGE["n_expert_used"][1]:
                raise TraceFormatError(f"{path}:{no}: {k} topk_ids; accepted: 1 .. {_META_RANGE['n_expert_used'][1]}")
            layers.append(lay)
            tokens.append(tok)
            ids.append(top)
    if k is None:
        raise TraceFormatError(f"{path}: no route lines; accepted: {what}")
    tok_arr = np.asarray(tokens, dtype=np.int64)
    _, dense = np.unique(tok_arr, return_inverse=True)
    n = len(layers)
    ids_arr = np.asarray(ids, dtype=np.int64)
    df = pd.DataFrame({"workload": workload or path.stem, "phase": "decode",
                       "ubatch": np.repeat(dense, k), "token": np.repeat(dense, k),
                       "layer": np.repeat(np.asarray(layers, dtype=np.int64), k),
                       "rank": np.tile(np.arange(k), n), "expert": ids_arr.ravel(), "hit": -1})
    df = df.sort_values(["token", "layer", "rank"], kind="stable").reset_index(drop=True)
    lay_max, e_max = int(df["layer"].max()), int(df["expert"].max())
    meta = TraceMeta(lay_max + 1, n_expert if n_expert is not None else e_max + 1, k)
    return from_frame(df, meta, str(path))


def sniff_format(path: str | Path) -> str:
    """The format of a trace file: ``engine``, ``parquet``, ``granite`` or ``jsonl`` (from its first bytes;
    a UTF-8 byte-order mark is skipped; a first line that is a JSON object with ``topk_ids`` is JSONL)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4096)
        if head.startswith(b"\xef\xbb\xbf"):
            head = head[3:]
        first_line = (head.split(b"\n", 1)[0] + (b"" if b"\n" in head else f.readline(1 << 20))).lstrip()
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(MAGIC.encode()):
        return "engine"
    text = head.lstrip()
    if text.startswith(b"{"):
        try:
            o = json.loads(first_line)
            if isinstance(o, dict) and "topk_ids" in o:
                return "jsonl"
        except (ValueError, RecursionError):    # not JSON or not UTF-8: the reader of its kind says where
            if b'"topk_ids"' in first_line:
                return "jsonl"
        return "granite"
    raise TraceFormatError(f"{path}: unknown trace format (starts with {head[:24]!r}); accepted: engine CSV "
                           f"('{MAGIC} v{FORMAT_VERSION}'), Parquet, granite JSON, JSONL route log")


def read_trace(path: str | Path, *, fmt: str = "auto", workload: str | None = None) -> Trace:
    """Read any supported trace file (see the module doc); ``fmt`` is one of :data:`FORMATS`.

    ``path`` may be a packaged trace's short name (:func:`trace_path`: ``"granite"``). ``workload``
    names the workload of a JSONL log. Raises :class:`FileNotFoundError` for a missing file (naming
    the short names) and :class:`TraceFormatError` for a malformed one or an unknown ``fmt``.
    """
    path = trace_path(path)
    if fmt not in FORMATS:
        raise TraceFormatError(f"trace format {fmt!r}; accepted: {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = sniff_format(path)
    if fmt == "engine":
        return read_engine_csv(path)
    if fmt == "parquet":
        return read_parquet(path)
    if fmt == "granite":
        return read_granite_json(path)
    return read_route_jsonl(path, workload=workload)


#: The output formats of :func:`write_trace` by file name suffix (``fmt="auto"``).
OUTPUT_SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


def output_format(path: str | Path) -> str:
    """The format :func:`write_trace` writes to ``path`` (``csv`` or ``parquet``), from its suffix
    (:data:`OUTPUT_SUFFIXES`). Raises :class:`TraceFormatError` for another suffix, naming the accepted ones
    (rather than CSV written into a ``.txt`` unannounced)."""
    path = Path(path)
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        what = f"{path.suffix!r} is not a trace file's suffix" if path.suffix else "no suffix names its format"
        raise TraceFormatError(f"{path}: {what}; accepted: .csv (the engine's --moe-trace CSV), .parquet or .pq")
    return OUTPUT_SUFFIXES[path.suffix.lower()]


def write_trace(trace: Trace, path: str | Path, *, fmt: str = "auto") -> Path:
    """Write ``trace`` as an engine CSV (``fmt="csv"``) or Parquet (``fmt="parquet"``).

    ``auto`` picks the format from the suffix (:func:`output_format`: ``.csv``, ``.parquet`` or
    ``.pq``; any other is a :class:`TraceFormatError`). The CSV is the engine's ``--moe-trace``
    format, so the file reads back with :func:`read_trace`. Returns the path.
    """
    path = Path(path)
    if fmt == "auto":
        fmt = output_format(path)
    if fmt not in ("csv", "parquet"):
        raise TraceFormatError(f"output format {fmt!r}; accepted: csv, parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        table = pa.Table.from_pandas(trace.frame, preserve_index=False)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               b"pybmoe-trace": trace.meta.header_line().encode()})
        pq.write_table(table, path)
        return path
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(trace.meta.header_line() + "\n")
        trace.frame.to_csv(f, index=False, lineterminator="\n")
    return path


def replay_mismatch(trace: Trace, model: str | Path) -> str | None:
    """Why the engine's ``--moe-route-replay`` would refuse ``trace`` on the GGUF ``model``, in one
    sentence, or None when it would replay it. The engine's own checks (``llama-moe-replay.cpp``), made
    from the model's header before a run: every layer of the trace is a MoE layer of the model, every
    rank is below its top-k, every expert below its experts per layer, and every MoE layer has rows.
    Raises :class:`ValueError` for a model that is not GGUF."""
    from .. import models
    meta = models.read_metadata(model)
    layers = sorted({int(t.name.split(".")[1]) for t in meta.tensors
                     if t.name.startswith("blk.") and t.name.endswith("_exps.weight") and len(t.shape) == 3})
    n_expert = max((int(t.shape[2]) for t in meta.tensors if t.name.endswith("_exps.weight") and len(t.shape) == 3),
                   default=0)
    arch = meta.kvs["general.architecture"].value if "general.architecture" in meta.kvs else b"?"
    arch = arch.decode() if isinstance(arch, bytes) else str(arch)
    key = f"{arch}.expert_used_count"
    top_k = int(meta.kvs[key].value) if key in meta.kvs else 0
    f = trace.frame
    t_layers = sorted(int(x) for x in trace.layers)
    t_rank = int(f["rank"].max()) + 1 if len(f) else 0
    t_expert = int(f["expert"].max()) + 1 if len(f) else 0
    ours = f"{len(layers)} MoE layers, {n_expert} experts, top-{top_k}"
    theirs = f"{len(t_layers)} layers, {trace.meta.n_expert} experts, top-{trace.meta.n_expert_used}"
    if not layers:
        why = "the model has no MoE layers"
    elif [x for x in t_layers if x not in set(layers)]:
        bad = [x for x in t_layers if x not in set(layers)]
        why = f"the trace's layer {bad[0]} is not a MoE layer of the model"
    elif t_rank > top_k:
        why = f"the trace routes {t_rank} experts a token where the model's top-k is {top_k}"
    elif t_expert > n_expert:
        why = f"the trace names expert {t_expert - 1} where the model has {n_expert} per layer"
    elif [x for x in layers if x not in set(t_layers)]:
        bad = [x for x in layers if x not in set(t_layers)]
        why = f"the model's MoE layer {bad[0]} has no rows in the trace"
    else:
        return None
    return f"{why}: the trace is of another shape ({theirs}) than {Path(model).name} ({ours})"


# --------------------------------------------------------------------------- statistics

def gini(counts: np.ndarray) -> float:
    """Gini coefficient of non-negative counts ``[n]`` (zeros included): 0 = uniform, (n-1)/n = one item.

    Returns 0.0 for an all-zero vector.
    """
    x = np.sort(np.asarray(counts, dtype=np.float64))
    n, s = len(x), x.sum()
    if n == 0 or s == 0:
        return 0.0
    i = np.arange(1, n + 1)
    return float(2.0 * (i * x).sum() / (n * s) - (n + 1) / n)


def _codes(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    f = trace.frame
    wl = f["workload"].cat.codes.to_numpy().astype(np.int64)
    return wl, f["token"].to_numpy().astype(np.int64), f["layer"].to_numpy().astype(np.int64), f["expert"].to_numpy().astype(np.int64)


def frequency_gini(trace: Trace) -> pd.DataFrame:
    """Per layer: the Gini of its experts' selection counts (pooled over workloads).

    Columns ``layer, lookups, gini, top_share`` (``top_share``: the most selected expert's share).
    """
    f = trace.frame
    E = trace.meta.n_expert
    rows = []
    for layer, g in f.groupby("layer", sort=True, observed=True):
        c = np.bincount(g["expert"].to_numpy(), minlength=E)
        rows.append({"layer": int(layer), "lookups": int(c.sum()), "gini": gini(c), "top_share": float(c.max() / c.sum())})
    return pd.DataFrame(rows)


def _overlap_sums(wl: np.ndarray, tok: np.ndarray, lay: np.ndarray, exp: np.ndarray, n_expert: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive-token overlap from code arrays (``wl``, ``lay`` dense codes from 0).

    Returns ``(pairs, overlap_sum)`` per (wl, layer), flattened as ``wl * n_lay + lay``, and
    ``n_lay``: a pair is a token ``t`` whose token ``t - 1`` has lookups at the same layer.
    """
    n_lay = int(lay.max()) + 1 if len(lay) else 1
    n_wl = int(wl.max()) + 1 if len(wl) else 1
    T = int(tok.max()) + 2 if len(tok) else 2         # + 2: token T - 1 never occurs, so no false neighbours
    E = n_expert
    # sorted by (workload, layer, expert, token): a lookup is shared with the previous token
    # exactly when the key before it is one less
    ks = np.sort(((wl * n_lay + lay) * E + exp) * T + tok)
    shared = np.zeros(len(ks), dtype=bool)
    shared[1:] = ks[1:] == ks[:-1] + 1
    grp = (ks // (E * T)) * T + ks % T                   # (workload, layer, token)
    order = np.argsort(grp, kind="stable")
    g = grp[order]
    first = np.ones(len(g), dtype=bool)
    first[1:] = g[1:] != g[:-1]
    starts = np.flatnonzero(first)
    groups = g[starts]
    n = np.diff(np.append(starts, len(g)))
    sh = np.add.reduceat(shared[order].astype(np.int64), starts) if len(starts) else np.zeros(0, np.int64)
    has_prev = np.zeros(len(groups), dtype=bool)
    has_prev[1:] = groups[1:] == groups[:-1] + 1          # token t - 1 of the same (workload, layer)
    wl_lay = groups[has_prev] // T
    size = n_wl * n_lay
    pairs = np.bincount(wl_lay, minlength=size)
    ov = np.bincount(wl_lay, weights=sh[has_prev] / n[has_prev], minlength=size)
    return pairs, ov, n_lay


def consecutive_overlap(trace: Trace) -> pd.DataFrame:
    """Per workload and layer: the mean share of a token's top-k also selected by the previous token.

    Only token pairs ``(t-1, t)`` that are both in ``trace`` count. Columns ``workload, layer,
    pairs, overlap`` (overlap in [0, 1]; NaN where there is no pair).
    """
    wl, tok, layer, exp = _codes(trace)
    layers, lay = np.unique(layer, return_inverse=True)
    pairs, ov, n_lay = _overlap_sums(wl, tok, lay.astype(np.int64), exp, trace.meta.n_expert)
    names = list(trace.frame["workload"].cat.categories)
    w_idx = np.repeat(np.arange(len(names)), n_lay)
    pairs, ov = pairs[:len(w_idx)], ov[:len(w_idx)]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(pairs > 0, ov / np.maximum(pairs, 1), np.nan)
    out = pd.DataFrame({"workload": [str(names[i]) for i in w_idx], "layer": np.tile(layers, len(names)),
                        "pairs": pairs.astype(int), "overlap": mean})
    present = set(trace.workloads)
    return out[out["workload"].isin(present)].reset_index(drop=True)


def mean_overlap(trace: Trace) -> dict[str, float]:
    """Per workload: the consecutive-token overlap averaged over all token pairs of all layers (NaN if none)."""
    ov = consecutive_overlap(trace)
    res = {}
    for w, g in ov.groupby("workload", sort=False):
        p = g["pairs"].to_numpy()
        res[str(w)] = float(np.nansum(g["overlap"].to_numpy() * p) / p.sum()) if p.sum() else float("nan")
    return res


#: Upper edges (tokens) of the reuse-distance bins; the last bin is open.
REUSE_BINS = (1, 2, 4, 8, 16, 32, 64)


def reuse_distances(trace: Trace) -> np.ndarray:
    """Per lookup (frame order): tokens since the same (workload, layer, expert) was last selected.

    ``int64 [rows]``; 0 for a first use (cold).
    """
    wl, tok, lay, exp = _codes(trace)
    order = np.lexsort((tok, exp, lay, wl))
    t = tok[order]
    grp = ((wl * (trace.meta.n_layer + 1) + lay) * (trace.meta.n_expert + 1) + exp)[order]
    d = np.zeros(len(t), dtype=np.int64)
    same = np.r_[False, grp[1:] == grp[:-1]]
    d[same] = (t[1:] - t[:-1])[same[1:]]
    out = np.empty_like(d)
    out[order] = d
    return out


def reuse_histogram(trace: Trace) -> pd.DataFrame:
    """The reuse-distance distribution: columns ``distance`` (bin label), ``lookups``, ``share``, ``cum_share``.

    Bins: ``cold`` (first use), then 1, 2, 3-4, 5-8, ... (see :data:`REUSE_BINS`) and ``>64``.
    ``cum_share`` accumulates over the warm bins only (the share reusable within that distance).
    """
    d = reuse_distances(trace)
    labels, counts = ["cold"], [int((d == 0).sum())]
    lo = 1
    for hi in REUSE_BINS:
        labels.append(str(hi) if hi == lo else f"{lo}-{hi}")
        counts.append(int(((d >= lo) & (d <= hi)).sum()))
        lo = hi + 1
    labels.append(f">{REUSE_BINS[-1]}")
    counts.append(int((d > REUSE_BINS[-1]).sum()))
    n = max(len(d), 1)
    share = np.asarray(counts) / n
    cum = np.r_[0.0, np.cumsum(share[1:])]
    return pd.DataFrame({"distance": labels, "lookups": counts, "share": share, "cum_share": cum})


def _hot_sets(counts: np.ndarray, size: int) -> np.ndarray:
    """Per layer, a bool mask [L, E] of the ``size`` most frequent experts (ties: lower id)."""
    L, E = counts.shape
    order = np.lexsort((np.broadcast_to(np.arange(E), (L, E)), -counts), axis=1)
    hot = np.zeros((L, E), dtype=bool)
    np.put_along_axis(hot, order[:, :size], True, axis=1)
    return hot


def static_coverage(trace: Trace, sizes: Sequence[int] | None = None) -> pd.DataFrame:
    """Static hot-set coverage in sample versus out of sample: the "exploitable static skew" test.

    For each evaluation split and hot-set size ``s`` (experts per layer), the hot set of each
    layer is its ``s`` most frequent experts, learned either from the split itself
    (``in_sample``) or from held-out data (``out_of_sample``): with two or more workloads, the
    other workloads (leave one out); with one, its first half of tokens predicts the second.
    ``uniform`` = ``s / n_expert`` is what a hot set without skew covers. Columns ``split,
    slots_per_layer, in_sample, out_of_sample, uniform, lift`` (lift = out_of_sample / uniform).
    Raises :class:`ValueError` for a size outside 1 .. n_expert.
    """
    E, L = trace.meta.n_expert, trace.meta.n_layer
    k = trace.meta.n_expert_used
    if sizes is None:
        sizes = sorted({max(1, s) for s in (k, E // 8, E // 4, E // 2) if s < E} or {1})
    for s in sizes:
        if not 1 <= s <= E:
            raise ValueError(f"hot-set size {s}; accepted: 1 .. {E}")
    wl, tok, lay, exp = _codes(trace)

    def counts(mask: np.ndarray) -> np.ndarray:
        return np.bincount(lay[mask] * E + exp[mask], minlength=L * E).reshape(L, E)

    splits: list[tuple[str, np.ndarray, np.ndarray]] = []
    names = trace.workloads
    if len(names) >= 2:
        for i, n in enumerate(names):
            ev = wl == trace.frame["workload"].cat.categories.get_loc(n)
            splits.append((n, ev, ~ev))
    else:
        toks = np.unique(tok)
        mid = toks[len(toks) // 2] if len(toks) > 1 else toks[0] + 1
        splits.append((f"{names[0]}[2nd half]", tok >= mid, tok < mid))
    rows = []
    for name, ev, train in splits:
        c_ev, c_tr = counts(ev), counts(train)
        n_ev = max(int(ev.sum()), 1)
        for s in sizes:
            cov_in = float((c_ev * _hot_sets(c_ev, s)).sum() / n_ev)
            cov_out = float((c_ev * _hot_sets(c_tr, s)).sum() / n_ev)
            rows.append({"split": name, "slots_per_layer": s, "in_sample": cov_in, "out_of_sample": cov_out,
                         "uniform": s / E, "lift": cov_out / (s / E)})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class TraceStats:
    """The locality statistics of one phase of a trace (each a tidy DataFrame; see the functions)."""

    phase: str
    summary: pd.DataFrame      # one row per workload: tokens, lookups, distinct entries, overlap, mean gini
    gini: pd.DataFrame         # frequency_gini
    overlap: pd.DataFrame      # consecutive_overlap
    reuse: pd.DataFrame        # reuse_histogram
    static: pd.DataFrame       # static_coverage

    def format(self) -> str:
        """A plain-text report of every table."""
        fmt = {"float_format": lambda x: f"{x:.3f}", "index": False}
        parts = [f"phase: {self.phase}", "", "workloads", self.summary.to_string(**fmt), "",
                 "expert frequency per layer (gini 0 = uniform)", self.gini.to_string(**fmt), "",
                 "reuse distance (tokens since the same layer's expert was last selected)", self.reuse.to_string(**fmt), "",
                 "static hot set: coverage learned in sample vs out of sample (lift = out / uniform)",
                 self.static.to_string(**fmt)]
        return "\n".join(parts)


def trace_stats(trace: Trace, *, phase: str = "decode", hot_sizes: Sequence[int] | None = None) -> TraceStats:
    """All locality statistics of ``trace`` restricted to ``phase`` (``prefill``, ``decode``, ``all``).

    Raises :class:`ValueError` for an unknown phase or a phase with no rows.
    """
    t = trace.select(phase)
    if len(t.frame) == 0:
        raise ValueError(f"the trace has no {phase} rows; accepted phases here: "
                         f"{sorted(set(map(str, trace.frame['phase'].unique())))} or all")
    g = frequency_gini(t)
    ov = consecutive_overlap(t)
    mo = mean_overlap(t)
    f = t.frame
    summary = f.groupby("workload", observed=True, sort=False).agg(
        tokens=("token", "nunique"), lookups=("expert", "size")).reset_index()
    summary["workload"] = summary["workload"].astype(str)
    summary["entries"] = [int(len(np.unique(g_["layer"].to_numpy().astype(np.int64) * t.meta.n_expert + g_["expert"].to_numpy())))
                          for _, g_ in f.groupby("workload", observed=True, sort=False)]
    summary["overlap"] = summary["workload"].map(mo)
    per_wl_gini = []
    for _, g_ in f.groupby("workload", observed=True, sort=False):
        sub = replace(t, frame=g_)
        per_wl_gini.append(float(frequency_gini(sub)["gini"].mean()))
    summary["gini"] = per_wl_gini
    return TraceStats(phase, summary, g, ov, reuse_histogram(t), static_coverage(t, hot_sizes))
