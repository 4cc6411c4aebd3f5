"""Fuzzing of the input-file parsers (issue 16, "Files from outside"): the trace readers of
pybmoe.routing.trace (engine CSV, Parquet, granite JSON, JSONL route logs, format sniffing) and the
sweep's traffic file (pybmoe.bench.sweeps.load_traffic).

The property, for every mangled file: the parser returns a complete, valid result or raises its one
documented error (TraceFormatError / TrafficFormatError, both ValueErrors) whose message names the
file, the place (line, row, field or header) and what is accepted. Never another exception, never a
hang (each read runs under an alarm), never a silent partial read (a file that reads has every one
of its rows in the result).

CI runs a fixed, derandomized number of examples per parser (a few seconds each).
``PYBMOE_FUZZ_SECONDS=S`` instead fuzzes each parser for S seconds with fresh random seeds and
prints the number of examples run (the longer run recorded in docs/reliability.md).
The explicit examples that failed before their fix are in tests/routing/test_trace_files.py and
tests/bench/test_traffic_files.py.
"""
from __future__ import annotations

import functools
import inspect
import io
import json
import os
import re
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pybmoe.bench import sweeps  # noqa: E402
from pybmoe.routing import trace as tr  # noqa: E402

FUZZ_SECONDS = float(os.environ.get("PYBMOE_FUZZ_SECONDS", "0") or 0)
#: examples per parser in CI (derandomized: the same examples on every run)
CI_EXAMPLES = 100
#: a read of these tiny files that takes longer than this is a hang
READ_LIMIT_S = 20.0

#: a place in the message: a line (path:N:), a row, a column, a field or the header
PLACE = re.compile(r":\d+:|row \d+|line \d+|column|header|num_layers|num_experts|top_k|prompts|layer|token_idx|"
                   r"topk_ids|schema|no rows|no route lines|no prompt|no trace rows|unknown trace format|"
                   r"not a readable Parquet|request \d+|no requests|not JSON|no '")


class Hang(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise Hang in the main thread when the body runs longer than ``seconds``."""
    def on_alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_COUNTS: dict[str, int] = {}


def given_fuzz(name: str, *strategies):
    """``@given(*strategies)``, run CI_EXAMPLES times (derandomized), or for PYBMOE_FUZZ_SECONDS with fresh seeds."""
    def deco(fn):
        @functools.wraps(fn)
        def counted(*a, **k):
            _COUNTS[name] = _COUNTS.get(name, 0) + 1
            return fn(*a, **k)
        common = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)
        if not FUZZ_SECONDS:
            return settings(max_examples=CI_EXAMPLES, derandomize=True, **common)(given(*strategies)(counted))
        inner = settings(max_examples=500, **common)(given(*strategies)(counted))

        def run(*a, **k):
            t0 = time.monotonic()
            while time.monotonic() - t0 < FUZZ_SECONDS:
                inner(*a, **k)
            print(f"\nfuzz {name}: {_COUNTS.get(name, 0)} examples in {time.monotonic() - t0:.0f} s")
        run.__name__, run.__qualname__, run.__doc__, run.__module__ = fn.__name__, fn.__qualname__, fn.__doc__, fn.__module__
        run.__signature__ = inspect.signature(inner)
        return run
    return deco


# --------------------------------------------------------------------------- the property

def check_error(e: ValueError, path: Path, error_type=tr.TraceFormatError) -> None:
    msg = str(e)
    assert type(e) is error_type, f"{type(e).__name__}: {msg}"
    assert str(path) in msg, f"the message does not name the file: {msg}"
    assert PLACE.search(msg), f"the message names no place: {msg}"
    assert "accepted" in msg or "needs" in msg, f"the message does not say what is accepted: {msg}"


def read_or_refuse(read, path: Path):
    """``read(path)``: the Trace, or None when it was refused as the property allows."""
    try:
        with time_limit(READ_LIMIT_S):
            t = read(path)
    except tr.TraceFormatError as e:
        check_error(e, path)
        return None
    check_trace(t)
    return t


def check_trace(t: tr.Trace) -> None:
    """A returned trace is complete and valid: canonical columns and dtypes, values in range."""
    f = t.frame
    assert list(f.columns)[:8] == list(tr.COLUMNS) and len(f) > 0
    assert set(map(str, f["phase"].unique())) <= set(tr.PHASES)
    assert f["workload"].notna().all()
    for c in ("ubatch", "token", "layer", "rank", "expert"):
        assert f[c].min() >= 0
    assert f["hit"].isin([-1, 0, 1]).all()
    m = t.meta
    assert 1 <= m.n_layer and 1 <= m.n_expert and 1 <= m.n_expert_used
    assert f["layer"].max() < m.n_layer and f["expert"].max() < m.n_expert and f["rank"].max() < m.n_expert_used


# --------------------------------------------------------------------------- mutations

NASTY = ["", " ", "-1", "-0", "+3", "1.5", "1e400", "nan", "NaN", "inf", "-inf", "99999999999999999999", "2147483648",
         "32768", "0x1", "\x00", "\ufeff", '"', '""', "decode", "prefill", "warmup", "true", "null", "[]", "{}", ",",
         "\n", "\r", "é", "\udcff"[:0] + "\u2028", "1 2", "١"]


@st.composite
def routing(draw):
    t = draw(st.integers(1, 4))
    L = draw(st.integers(1, 3))
    k = draw(st.integers(1, 3))
    E = draw(st.integers(k, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return np.stack([np.stack([rng.permutation(E)[:k] for _ in range(L)]) for _ in range(t)]), E


def valid_csv_bytes(r, E, slots=None) -> bytes:
    t = tr.make_trace(r, n_expert=E)
    if slots is not None:
        t = tr.Trace(t.frame, tr.TraceMeta(t.meta.n_layer, E, t.meta.n_expert_used, slots, 1), "")
    buf = io.StringIO()
    buf.write(t.meta.header_line() + "\n")
    t.frame.to_csv(buf, index=False, lineterminator="\n")
    return buf.getvalue().encode()


@st.composite
def mutated(draw, data: bytes, textual: bool = True) -> bytes:
    """``data`` with 0 to 3 mutations: byte-level (cut, flip, insert, delete, random bytes) and, for text,
    field-level (a field replaced by a nasty value, a field dropped or added, a line doubled or dropped,
    a BOM, another encoding)."""
    for _ in range(draw(st.integers(0, 3))):
        kinds = ["cut", "flip", "insert", "delete", "random"]
        if textual:
            kinds += ["field", "drop_field", "add_field", "dup_line", "drop_line", "bom", "utf16", "crlf", "swap_lines"]
        kind = draw(st.sampled_from(kinds))
        n = len(data)
        if kind == "cut":
            data = data[:draw(st.integers(0, n))]
        elif kind == "flip" and n:
            i = draw(st.integers(0, n - 1))
            data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
        elif kind == "insert":
            i = draw(st.integers(0, n))
            data = data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
        elif kind == "delete" and n:
            i = draw(st.integers(0, n - 1))
            data = data[:i] + data[i + draw(st.integers(1, 8)):]
        elif kind == "random":
            data = draw(st.binary(max_size=200))
        elif kind == "bom":
            data = b"\xef\xbb\xbf" + data
        elif kind == "utf16":
            data = data.decode("utf-8", "replace").encode("utf-16")
        elif kind == "crlf":
            data = data.replace(b"\n", b"\r\n")
        else:
            lines = data.split(b"\n")
            i = draw(st.integers(0, len(lines) - 1))
            if kind == "dup_line":
                lines.insert(i, lines[i])
            elif kind == "drop_line":
                del lines[i]
            elif kind == "swap_lines":
                j = draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
            else:
                sep = b"," if b"," in lines[i] or not lines[i].strip().startswith(b"{") else b" "
                fields = lines[i].split(sep)
                j = draw(st.integers(0, len(fields) - 1))
                if kind == "field":
                    fields[j] = draw(st.sampled_from(NASTY)).encode("utf-8", "surrogatepass")
                elif kind == "drop_field":
                    del fields[j]
                else:
                    fields.insert(j, draw(st.sampled_from(NASTY)).encode("utf-8", "surrogatepass"))
                lines[i] = sep.join(fields)
            data = b"\n".join(lines)
    return data


def data_lines(data: bytes, skip: int) -> int:
    """Non-blank lines after the first ``skip`` (the rows a reader must return, one per line)."""
    return sum(1 for ln in data.split(b"\n")[skip:] if ln.strip())


# --------------------------------------------------------------------------- engine CSV

@given_fuzz("engine-csv", st.data())
def test_fuzz_engine_csv(tmp_path_factory, data):
    r, E = data.draw(routing())
    good = valid_csv_bytes(r, E, slots=data.draw(st.none() | st.integers(0, 4)))
    raw = data.draw(mutated(good))
    path = tmp_path_factory.mktemp("csv") / "t.csv"
    path.write_bytes(raw)
    t = read_or_refuse(tr.read_engine_csv, path)
    if t is not None:
        # no silent partial read: every line after the two header lines is a row of the result
        assert len(t.frame) == data_lines(raw.removeprefix(b"\xef\xbb\xbf"), 2), raw[:300]
        if raw == good:
            assert t.frame["expert"].tolist() == r.ravel().tolist()


# --------------------------------------------------------------------------- Parquet

@given_fuzz("parquet", st.data())
def test_fuzz_parquet_bytes(tmp_path_factory, data):
    r, E = data.draw(routing())
    path = tmp_path_factory.mktemp("pq") / "t.parquet"
    tr.write_trace(tr.make_trace(r, n_expert=E), path)
    good = path.read_bytes()
    raw = data.draw(mutated(good, textual=False))
    path.write_bytes(raw)
    t = read_or_refuse(tr.read_parquet, path)
    if t is not None and raw == good:
        assert t.frame["expert"].tolist() == r.ravel().tolist()


CELL = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                 st.text(max_size=4), st.sampled_from(["prefill", "decode", "w0"]))


@given_fuzz("parquet-columns", st.data())
def test_fuzz_parquet_columns(tmp_path_factory, data):
    """Columns of the wrong type, missing or extra, with odd values and odd schema metadata."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = data.draw(st.integers(0, 4))
    cols = data.draw(st.lists(st.sampled_from(list(tr.COLUMNS) + ["ram_hit", "extra"]), unique=True, max_size=10))
    table = {}
    for c in cols:
        kind = data.draw(st.sampled_from(["good", "cells", "floats", "strings"]))
        if kind == "good":
            v = {"workload": ["w"] * n, "phase": ["decode"] * n}.get(c, [data.draw(st.integers(-1, 3)) for _ in range(n)])
        elif kind == "floats":
            v = [data.draw(st.floats()) for _ in range(n)]
        elif kind == "strings":
            v = [data.draw(st.text(max_size=3)) for _ in range(n)]
        else:
            cell = data.draw(st.sampled_from([st.integers(-2**40, 2**40), st.booleans(), st.text(max_size=4),
                                              st.sampled_from(["prefill", "decode"]),
                                              st.lists(st.sampled_from(["decode", "w"]), max_size=2),
                                              st.lists(st.integers(0, 3), max_size=2)]))
            v = [data.draw(cell | st.none()) for _ in range(n)]
        table[c] = v
    try:
        t = pa.table(table)
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        return
    md = data.draw(st.sampled_from([None, b"# pybmoe-trace v1 n_layer=4 n_expert=4 n_expert_used=2",
                                    b"# pybmoe-trace v1 n_layer=x", b"\xff\xfe", b"garbage"]))
    if md is not None:
        t = t.replace_schema_metadata({b"pybmoe-trace": md})
    path = tmp_path_factory.mktemp("pqc") / "t.parquet"
    pq.write_table(t, path)
    got = read_or_refuse(tr.read_parquet, path)
    if got is not None:
        assert len(got.frame) == n


# --------------------------------------------------------------------------- granite JSON

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=3),
                 st.lists(st.integers(-3, 40), max_size=3), st.just({}))


@st.composite
def granite_doc(draw):
    L, K = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    E = draw(st.integers(K, 6))

    def maybe(v):
        return draw(JUNK) if draw(st.integers(0, 9)) == 0 else v

    def arr(n):
        nl = L if draw(st.integers(0, 9)) else draw(st.integers(0, 4))      # sometimes another layer count
        return [[[maybe(draw(st.integers(0, E - 1))) for _ in range(K)] for _ in range(nl)] for _ in range(n)]

    prompts = {}
    for i in range(draw(st.integers(0, 3))):
        p = {"prefill": maybe(arr(draw(st.integers(0, 3)))), "decode": maybe(arr(draw(st.integers(0, 3))))}
        if draw(st.integers(0, 9)) == 0:
            p.pop(draw(st.sampled_from(["prefill", "decode"])))
        prompts[draw(st.text(max_size=3)) + str(i)] = maybe(p)
    doc = {"num_layers": maybe(L), "num_experts": maybe(E), "top_k": maybe(K), "prompts": maybe(prompts)}
    if draw(st.integers(0, 9)) == 0:
        doc.pop(draw(st.sampled_from(list(doc))))
    return doc


@given_fuzz("granite-json", st.data())
def test_fuzz_granite_json(tmp_path_factory, data):
    doc = data.draw(granite_doc())
    good = json.dumps(doc).encode()
    raw = data.draw(mutated(good))
    path = tmp_path_factory.mktemp("g") / "g.json"
    path.write_bytes(raw)
    t = read_or_refuse(tr.read_granite_json, path)
    if t is not None:
        d = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
        want = sum(len(p[ph]) for p in d["prompts"].values() for ph in tr.PHASES) * d["num_layers"] * d["top_k"]
        assert len(t.frame) == want


# --------------------------------------------------------------------------- JSONL route logs

@st.composite
def jsonl_lines(draw):
    k = draw(st.integers(1, 3))
    lines = []
    for _ in range(draw(st.integers(0, 5))):
        o = {"layer": draw(st.integers(0, 3)), "token_idx": draw(st.integers(0, 5)),
             "topk_ids": draw(st.lists(st.integers(0, 7), min_size=k, max_size=k))}
        if draw(st.integers(0, 5)) == 0:
            key = draw(st.sampled_from(list(o)))
            o[key] = draw(JUNK)
        if draw(st.integers(0, 9)) == 0:
            o.pop(draw(st.sampled_from(list(o))))
        lines.append(json.dumps(o) if draw(st.integers(0, 19)) else json.dumps(draw(JUNK)))
    return ("\n".join(lines) + "\n").encode()


@given_fuzz("jsonl", st.data())
def test_fuzz_route_jsonl(tmp_path_factory, data):
    good = data.draw(jsonl_lines())
    raw = data.draw(mutated(good))
    path = tmp_path_factory.mktemp("j") / "r.jsonl"
    path.write_bytes(raw)
    t = read_or_refuse(tr.read_route_jsonl, path)
    if t is not None:
        lines = [json.loads(ln) for ln in raw.decode("utf-8").removeprefix("\ufeff").splitlines() if ln.strip()]
        assert len(t.frame) == sum(len(o["topk_ids"]) for o in lines)


# --------------------------------------------------------------------------- any file through read_trace

PREFIXES = [b"", b"PAR1", b"# pybmoe-trace v1 ", b"# pybmoe-trace v1 n_layer=1 n_expert=2 n_expert_used=1\n", b"{",
            b'{"layer": 0, "token_idx": 0, "topk_ids": [', b"\xef\xbb\xbf", b"\xef\xbb\xbf{"]


@given_fuzz("read-trace", st.sampled_from(PREFIXES), st.binary(max_size=300))
def test_fuzz_read_trace_random_bytes(tmp_path_factory, prefix, tail):
    path = tmp_path_factory.mktemp("any") / "x.bin"
    path.write_bytes(prefix + tail)
    read_or_refuse(tr.read_trace, path)


# --------------------------------------------------------------------------- the sweep's traffic file

REQUEST = st.fixed_dictionaries({"prompt": st.text(max_size=8)},
                                optional={"n_predict": st.integers(-2, 70) | JUNK, "name": st.text(max_size=4) | JUNK,
                                          "n_predcit": st.integers(1, 9)})


@given_fuzz("traffic", st.data())
def test_fuzz_traffic_file(tmp_path_factory, data):
    reqs = data.draw(st.lists(REQUEST | JUNK, max_size=4))
    doc = data.draw(st.sampled_from(["dict", "list", "junk"]))
    obj = {"about": "x", "requests": reqs} if doc == "dict" else reqs if doc == "list" else data.draw(JUNK)
    good = json.dumps(obj).encode()
    raw = data.draw(mutated(good))
    path = tmp_path_factory.mktemp("tr") / "traffic.json"
    path.write_bytes(raw)
    try:
        with time_limit(READ_LIMIT_S):
            got = sweeps.load_traffic(path)
    except sweeps.TrafficFormatError as e:
        check_error(e, path, sweeps.TrafficFormatError)
        return
    d = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
    want = d["requests"] if isinstance(d, dict) else d
    assert len(got) == len(want)
    for g in got:
        assert set(g) == {"name", "prompt", "n_predict"}
        assert isinstance(g["prompt"], str) and g["prompt"] and isinstance(g["name"], str)
        assert type(g["n_predict"]) is int and 1 <= g["n_predict"] <= sweeps.MAX_PREDICT
