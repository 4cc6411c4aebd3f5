"""Mangled trace files that the readers of pybmoe.routing.trace mishandled before issue 16: each
raised another exception (UnicodeDecodeError, OverflowError, RecursionError, AttributeError, ...),
read a wrong value silently, or refused with a message that named no line. Each example here failed
before its fix; tests/routing/test_fuzz_parsers.py is the fuzzing that found most of them."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from pybmoe.routing import trace as tr

HEAD = "# pybmoe-trace v1 n_layer=2 n_expert=4 n_expert_used=2\nworkload,phase,ubatch,token,layer,rank,expert,hit\n"
ROW = "a,decode,0,0,0,0,1,-1\n"


@pytest.mark.parametrize("name, data, message", [
    # not UTF-8: was a bare UnicodeDecodeError without the file
    ("bytes.csv", HEAD.encode() + b"\xff\xfe\x00\n", r"bytes.csv:3: byte 0xff at column 1 is not UTF-8 text"),
    # a row of 7 fields: pandas' "invalid literal for int()" with no line
    ("short.csv", HEAD + ROW + "a,decode,0,0,0,1,1\n", r"short.csv:4: 7 fields; accepted: 8"),
    # an extra field on the first row: pandas took the first field for an index, shifting every column
    ("extra.csv", HEAD + "a,decode,0,0,0,0,1,-1,9\n", r"extra.csv:3: 9 fields; accepted: 8"),
    # cut in the middle of a number: "17" read as "1", silently
    ("cut.csv", HEAD + "a,decode,0,0,0,0,1,-1\na,decode,0,0,0,1,3", r"cut.csv:4: the last line has no line end"),
    # a number beyond int64: OverflowError
    ("huge.csv", HEAD + "a,decode,0,0,0,0,99999999999999999999999,-1\n",
     r"huge.csv:3: column 'expert' has the value 99999999999999999999999 but the header says n_expert=4"),
    ("inf.csv", HEAD + "a,decode,0,0,0,0,1e400,-1\n", r"inf.csv:3: column 'expert' has the non-integer value '1e400'"),
    # an unmatched quote swallowed the rows up to the next quote into a workload name
    ("quote.csv", HEAD + '"a,decode,0,0,0,0,1,-1\n' + ROW * 3 + 'b",decode,0,1,0,0,1,-1\n', r"quote.csv:3: not a CSV row"),
    # a bare carriage return split a line for pandas but not for the line count
    ("cr.csv", HEAD + "\r" + ROW, r"cr.csv:3: a carriage return inside a line"),
    # a header key given twice: the message quoted the first value as the bad one
    ("dup.csv", HEAD.replace("n_expert_used=2", "n_expert_used=2 n_layer=x"), r"header key 'n_layer' is given twice"),
    # a negative count: "accepted: layer 0 .. -3"
    ("neg.csv", HEAD.replace("n_layer=2", "n_layer=-2"), r"header n_layer='-2'; accepted: an integer 1 .. 32768"),
    ("topk.csv", HEAD.replace("n_expert_used=2", "n_expert_used=5"), r"n_expert_used=5 with n_expert=4"),
    ("version.csv", "# pybmoe-trace v\n", r"header: trace format 'v'; accepted: v1"),
])
def test_a_mangled_engine_csv_is_refused_with_its_line(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(tr.TraceFormatError, match=message):
        tr.read_trace(path)


def test_a_byte_order_mark_is_skipped(tmp_path):
    """A CSV saved with a UTF-8 BOM (as some editors do) was 'unknown trace format'; it reads now."""
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEAD + ROW).encode())
    assert tr.read_trace(path).frame["expert"].tolist() == [1]
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"layer": 0, "token_idx": 0, "topk_ids": [1]}).encode() + b"\n")
    assert tr.read_trace(path).frame["expert"].tolist() == [1]


def g(**kw):
    doc = {"num_layers": 1, "num_experts": 4, "top_k": 2, "prompts": {"p": {"prefill": [[[0, 1]]], "decode": []}}}
    doc.update(kw)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("data, message", [
    (b"[1, 2]", r"the document is an array; accepted: an object"),
    (g(num_layers="x"), r"num_layers is 'x' \(a string\); accepted: an integer 1 .. 32768"),    # was ValueError
    (g(num_layers=2.5), r"num_layers is 2.5"),                                                    # was read as 2
    (b'{"num_layers": 1e400, "num_experts": 4, "top_k": 2, "prompts": {}}', r"num_layers is inf"),  # OverflowError
    (g(prompts=[1]), r"prompts is an array"),                                                     # AttributeError
    (g(prompts={"p": 3}), r"prompts.p is an integer"),                                            # TypeError
    (g(prompts={"p": {"prefill": [[[1.5, 2]]], "decode": []}}), r"prompts.p.prefill\[0\]\[0\]\[0\] is 1.5"),  # read as 1
    (g(prompts={"p": {"prefill": [[[1], [2, 3]]], "decode": []}}), r"prompts.p.prefill is not a rectangular array"),
    (g(prompts={"p": {"prefill": [[[0, 9]]], "decode": []}}), r"prompts.p.prefill\[0\]\[0\]\[1\] is 9; accepted: an expert id 0 .. 3"),
    (g(prompts={"p": {"prefill": [[[0, 10**30]]], "decode": []}}), r"prompts.p.prefill\[0\]\[0\]\[1\] is 1000000000000000000000000000000"),
    (g(top_k=5), r"top_k is 5 \(an integer\); accepted: an integer 1 .. 4"),
    (b'{"num_layers": 1, \xff}', r"g.json:1: byte 0xff at column 19 is not UTF-8"),               # UnicodeDecodeError
    (b'{"a":' + b"[" * 100000, r"JSON nested too deeply"),                                        # RecursionError
])
def test_a_mangled_granite_json_is_refused_with_its_field(tmp_path, data, message):
    path = tmp_path / "g.json"
    path.write_bytes(data)
    with pytest.raises(tr.TraceFormatError, match=message):
        tr.read_granite_json(path)


@pytest.mark.parametrize("line, message", [
    (b'{"layer": 1.7, "token_idx": 0, "topk_ids": [1, 2]}', r"r.jsonl:1: layer is 1.7"),           # read as 1
    (b'{"layer": "1", "token_idx": 0, "topk_ids": [1, 2]}', r"r.jsonl:1: layer is '1' \(a string\)"),
    (b'{"layer": 1e400, "token_idx": 0, "topk_ids": [1, 2]}', r"r.jsonl:1: layer is inf"),         # OverflowError
    (b'{"layer": 1, "token_idx": 0, "topk_ids": [1, 100000000000000000000000000]}', r"r.jsonl:1: topk_ids\[1\] is"),
    (b'{"layer": 1, "token_idx": true, "topk_ids": [1, 2]}', r"r.jsonl:1: token_idx is True \(a boolean\)"),
    (b'{"layer": 1, "token_idx": 0, "topk_ids": 3}', r"r.jsonl:1: topk_ids is an integer"),
    (b'[1, 2]', r"r.jsonl:1: the line is an array"),
    (b'{"layer": 1, \xff "token_idx": 0, "topk_ids": [1, 2]}', r"r.jsonl:1: byte 0xff at column 14"),  # UnicodeDecodeError
    (b'{"layer": 1, "token_idx": 0, "topk_ids": ' + b"[" * 100000, r"r.jsonl:1: JSON nested too deeply"),  # RecursionError
])
def test_a_mangled_jsonl_line_is_refused_with_its_line(tmp_path, line, message):
    path = tmp_path / "r.jsonl"
    path.write_bytes(line + b"\n")
    with pytest.raises(tr.TraceFormatError, match=message):
        tr.read_trace(path, fmt="jsonl")


def test_a_mangled_parquet_is_refused(tmp_path, granite):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    tr.write_trace(granite, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])          # cut: pyarrow's ArrowInvalid without the file
    with pytest.raises(tr.TraceFormatError, match=r"t.parquet: not a readable Parquet trace"):
        tr.read_trace(path)
    frame = granite.frame.head(4).astype({"phase": str, "workload": str})
    for bad, message in [
        (frame.assign(expert=[[1]] * 4), r"column 'expert' has the type|non-integer value"),      # lists: TypeError
        (frame.assign(phase=[["decode"]] * 4), r"row 0: phase value"),                            # unhashable
        (frame.assign(expert=[1.0, float("inf"), 2.0, 3.0]), r"row 1: column 'expert' has the non-integer value inf"),
        (frame.assign(hit=[True] * 4), r"column 'hit' has the type bool"),
        (frame.assign(workload=["a", None, "b", "c"]), r"row 1: column 'workload' has a missing value"),
        (frame.assign(extra=1), r"unknown column\(s\) \['extra'\]"),
    ]:
        pq.write_table(pa.Table.from_pandas(bad, preserve_index=False), path)
        with pytest.raises(tr.TraceFormatError, match=message):
            tr.read_trace(path)
    table = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata({b"pybmoe-trace": b"\xff"})
    pq.write_table(table, path)
    with pytest.raises(tr.TraceFormatError, match=r"schema metadata 'pybmoe-trace' is not UTF-8"):
        tr.read_trace(path)


def test_a_uint64_beyond_int64_is_not_wrapped():
    """A uint64 column was cast to int64 first, so 2**64 - 1 was reported as the value -1."""
    df = pd.DataFrame({"workload": ["w"], "phase": ["decode"], "ubatch": [0], "token": [0], "layer": [0], "rank": [0],
                       "expert": pd.Series([2**64 - 1], dtype="uint64"), "hit": [-1]})
    with pytest.raises(tr.TraceFormatError, match=r"row 0: column 'expert' has the value 18446744073709551615"):
        tr.from_frame(df)
