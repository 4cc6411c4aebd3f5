"""Tests of pybmoe.routing.trace: the routing trace formats and statistics (CPU only, ~3 s).

Expected values are computed here by hand or from the raw granite JSON, never taken from the
implementation.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pybmoe.cli import trace as trace_cli
from pybmoe.routing import trace as tr
from pybmoe.routing.granite import GRANITE_TRACE as GRANITE  # the bundled copy (MIT notice beside it)


def small_trace(slots=None, inserts=None) -> tr.Trace:
    rows = [("a", "prefill", 0, 0, 1, 0, 3, -1), ("a", "prefill", 0, 0, 1, 1, 0, -1),
            ("a", "prefill", 0, 1, 1, 0, 2, -1), ("a", "prefill", 0, 1, 1, 1, 3, -1),
            ("a", "decode", 1, 2, 1, 0, 3, 0), ("a", "decode", 1, 2, 1, 1, 1, 1),
            ("b", "decode", 0, 0, 1, 0, 5, 1), ("b", "decode", 0, 0, 1, 1, 4, 0)]
    df = pd.DataFrame(rows, columns=tr.COLUMNS)
    return tr.from_frame(df, tr.TraceMeta(4, 8, 2, slots, inserts, {"model": "tiny"}))


# --------------------------------------------------------------------------- granite import

#: sha256 of the granite trace as published (the project's shared data holds the same bytes)
GRANITE_SHA256 = "055c3fd06dbb79cc7321caa530b015c239ed7dfd6b1e60834ddbb68231756fe9"


def test_the_bundled_granite_trace_is_the_published_one():
    """pybmoe/data/ carries the trace (with its MIT notice) so the tests run on a clean clone; its bytes
    are the published trace's (pinned sha256), and where the project's shared copy sits beside the
    checkout (../shared/data/), the same bytes as that. No skip on a clean clone (issue 17: the skip
    named a shared/data folder a user never heard of)."""
    assert GRANITE.is_file() and GRANITE.with_suffix(".NOTICE").is_file()
    assert hashlib.sha256(GRANITE.read_bytes()).hexdigest() == GRANITE_SHA256
    shared = Path(__file__).resolve().parents[3] / "shared" / "data" / GRANITE.name
    if shared.is_file():
        assert hashlib.sha256(shared.read_bytes()).hexdigest() == GRANITE_SHA256


def test_granite_import(granite, granite_raw):
    f = granite.frame
    assert granite.meta == tr.TraceMeta(24, 32, 8)
    assert granite.workloads == list(granite_raw["prompts"])
    assert list(f.columns) == list(tr.COLUMNS)
    for name, p in granite_raw["prompts"].items():
        g = f[f["workload"] == name]
        n_pre, n_dec = len(p["prefill"]), len(p["decode"])
        assert len(g) == (n_pre + n_dec) * 24 * 8
        pre, dec = g[g["phase"] == "prefill"], g[g["phase"] == "decode"]
        assert set(pre["ubatch"]) == {0} and sorted(set(pre["token"])) == list(range(n_pre))
        assert sorted(set(dec["ubatch"])) == list(range(1, n_dec + 1))
        assert sorted(set(dec["token"])) == list(range(n_pre, n_pre + n_dec))
        # decode token 5, layer 7, in router order
        row = dec[(dec["token"] == n_pre + 5) & (dec["layer"] == 7)].sort_values("rank")
        assert row["expert"].tolist() == p["decode"][5][7]
        assert row["ubatch"].tolist() == [6] * 8
    assert set(f["hit"]) == {-1}


def test_granite_bad_shape(tmp_path):
    bad = {"num_layers": 2, "num_experts": 4, "top_k": 2,
           "prompts": {"p": {"prefill": [[[0, 1], [2, 3]]], "decode": [[[0, 1]]]}}}
    path = tmp_path / "g.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(tr.TraceFormatError, match=r"prompts.p.decode has shape \(1, 1, 2\); accepted: \[tokens, 2, 2\]"):
        tr.read_trace(path)


# --------------------------------------------------------------------------- the engine CSV and Parquet

def test_engine_csv_round_trip(tmp_path):
    t = small_trace(slots=4, inserts=1)
    path = tr.write_trace(t, tmp_path / "t.csv")
    lines = path.read_text().splitlines()
    assert lines[0] == "# pybmoe-trace v1 n_layer=4 n_expert=8 n_expert_used=2 slots=4 inserts=1 model=tiny"
    assert lines[1] == "workload,phase,ubatch,token,layer,rank,expert,hit"
    assert lines[2] == "a,prefill,0,0,1,0,3,-1"
    back = tr.read_trace(path)
    assert back.meta == t.meta
    pd.testing.assert_frame_equal(back.frame, t.frame)


def test_parquet_round_trip(tmp_path):
    pytest.importorskip("pyarrow")
    t = small_trace(slots=2)
    back = tr.read_trace(tr.write_trace(t, tmp_path / "t.parquet"))
    assert back.meta == t.meta
    pd.testing.assert_frame_equal(back.frame, t.frame)


@pytest.mark.parametrize("name", ["out.txt", "out", "out.CSV.bak"])
def test_an_output_suffix_that_names_no_format_is_refused(tmp_path, capsys, name):
    """Issue 52, item 6: `pybmoe trace convert granite -o out.txt` wrote CSV into a .txt without a word. A
    suffix that is not .csv, .parquet or .pq is refused in one line naming the accepted ones, before the
    input is read, and nothing is written; the accepted ones still write (case aside)."""
    out = tmp_path / name
    assert trace_cli.main(["convert", "granite", "-o", str(out)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap.err
    assert cap.err.startswith(f"pybmoe trace: error: {out}: ") and "accepted: .csv (the engine's --moe-trace CSV), " \
        ".parquet or .pq" in cap.err
    assert not out.exists()
    assert trace_cli.synth_main(["--from", "granite", "--steps", "4", "--out", str(out)]) == 2
    assert "accepted: .csv" in capsys.readouterr().err and not out.exists()
    with pytest.raises(tr.TraceFormatError, match="accepted: .csv"):
        tr.write_trace(small_trace(), out)
    assert tr.read_trace(tr.write_trace(small_trace(), tmp_path / "t.CSV")).meta == small_trace().meta


@pytest.mark.parametrize("first,second,message", [
    ("# other-trace v1 n_layer=1", None, "line 1 is"),
    ("# pybmoe-trace v2 n_layer=1 n_expert=2 n_expert_used=1", None, "trace format 'v2'; accepted: v1"),
    ("# pybmoe-trace v1 n_layer=1 n_expert=two n_expert_used=1", None, "n_expert='two'; accepted: an integer"),
    ("# pybmoe-trace v1 n_layer=1 n_expert=2", None, r"lacks \['n_expert_used'\]"),
    ("# pybmoe-trace v1 n_layer=1 n_expert=2 n_expert_used=1", "workload,phase,token", "line 2 is"),
    ("# pybmoe-trace v1 n_layer=1 n_expert=2 n_expert_used=1", None,
     "column 'expert' has the value 5 but the header says n_expert=2; accepted: expert 0 .. 1"),
])
def test_engine_csv_errors(tmp_path, first, second, message):
    body = (second or ",".join(tr.COLUMNS)) + "\nw,decode,0,0,0,0,5,-1\n"
    path = tmp_path / "bad.csv"
    path.write_text(first + "\n" + body)
    with pytest.raises(tr.TraceFormatError, match=message):
        tr.read_engine_csv(path)


def test_frame_errors():
    df = small_trace().frame.astype({"phase": str})
    with pytest.raises(tr.TraceFormatError, match=r"phase value\(s\) \['warmup'\]; accepted: prefill, decode"):
        tr.from_frame(df.assign(phase="warmup"))
    with pytest.raises(tr.TraceFormatError, match="column 'hit' has the value 2; accepted: -1 .. 1"):
        tr.from_frame(df.assign(hit=2))
    with pytest.raises(tr.TraceFormatError, match=r"missing column\(s\) \['rank'\]"):
        tr.from_frame(df.drop(columns="rank"))
    with pytest.raises(tr.TraceFormatError, match="column 'token' has the value -3"):
        tr.from_frame(df.assign(token=-3))


# --------------------------------------------------------------------------- JSONL route logs

def test_jsonl_import(tmp_path):
    path = tmp_path / "routes.jsonl"
    lines = [{"layer": 0, "token_idx": 10, "topk_ids": [3, 1]}, {"layer": 2, "token_idx": 10, "topk_ids": [0, 5]},
             {"layer": 0, "token_idx": 12, "topk_ids": [1, 2]}, {"layer": 2, "token_idx": 12, "topk_ids": [5, 4]}]
    path.write_text("\n".join(json.dumps(o) for o in lines) + "\n")
    t = tr.read_trace(path)
    f = t.frame
    assert t.workloads == ["routes"] and set(f["phase"]) == {"decode"}
    assert t.meta == tr.TraceMeta(3, 6, 2)
    assert f["token"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]          # renumbered in token_idx order
    assert f["ubatch"].tolist() == f["token"].tolist()                # each token its own ubatch
    assert f["expert"].tolist() == [3, 1, 0, 5, 1, 2, 5, 4]
    assert f["rank"].tolist() == [0, 1] * 4
    assert tr.read_trace(path, workload="x").workloads == ["x"]
    path.write_text(json.dumps(lines[0]) + "\n" + '{"layer": 1, "token_idx": 11}\n')
    with pytest.raises(tr.TraceFormatError, match="routes.jsonl:2"):
        tr.read_trace(path)


def test_sniff_unknown(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("hello\n")
    with pytest.raises(tr.TraceFormatError, match="unknown trace format"):
        tr.read_trace(path)
    with pytest.raises(FileNotFoundError):
        tr.read_trace(tmp_path / "missing.csv")


# --------------------------------------------------------------------------- statistics

def test_gini_by_hand():
    assert tr.gini([2, 2, 2, 2]) == 0.0
    assert tr.gini([0, 0, 0, 4]) == pytest.approx(0.75)
    assert tr.gini([0, 1, 2, 3]) == pytest.approx(20 / 48)     # sum |xi - xj| / (2 n^2 mean)
    assert tr.gini([0, 0]) == 0.0


def test_overlap_and_reuse_by_hand():
    t = tr.make_trace(np.array([[[0, 1]], [[1, 2]], [[3, 4]]]), n_expert=5)
    ov = tr.consecutive_overlap(t)
    assert ov["pairs"].tolist() == [2] and ov["overlap"].tolist() == [pytest.approx(0.25)]
    t = tr.make_trace(np.array([0, 1, 0, 0, 2, 1]).reshape(6, 1, 1), n_expert=3)
    assert tr.reuse_distances(t).tolist() == [0, 0, 2, 1, 0, 4]
    h = tr.reuse_histogram(t).set_index("distance")["lookups"]
    assert (h["cold"], h["1"], h["2"], h["3-4"], h["5-8"]) == (3, 1, 1, 1, 0)


def test_static_coverage_by_hand():
    a = tr.make_trace(np.array([0, 0, 1, 2]).reshape(4, 1, 1), workload="A", n_expert=4)
    b = tr.make_trace(np.array([0, 3, 3, 3]).reshape(4, 1, 1), workload="B", n_expert=4)
    sc = tr.static_coverage(tr.concat([a, b]), sizes=[1]).set_index("split")
    assert sc.loc["A", ["in_sample", "out_of_sample", "uniform"]].tolist() == [0.5, 0.0, 0.25]
    assert sc.loc["B", ["in_sample", "out_of_sample", "uniform"]].tolist() == [0.75, 0.25, 0.25]
    with pytest.raises(ValueError, match="hot-set size 5; accepted: 1 .. 4"):
        tr.static_coverage(a, sizes=[5])


def test_granite_stats_against_the_raw_json(granite, granite_raw):
    st = tr.trace_stats(granite, phase="decode")
    summ = st.summary.set_index("workload")
    for name, p in granite_raw["prompts"].items():
        dec = p["decode"]
        shared = [len(set(dec[t][layer]) & set(dec[t - 1][layer])) / 8 for t in range(1, 64) for layer in range(24)]
        assert summ.loc[name, "overlap"] == pytest.approx(sum(shared) / len(shared))
        assert summ.loc[name, "entries"] == len({(layer, e) for tok in dec for layer, ids in enumerate(tok) for e in ids})
        assert summ.loc[name, "tokens"] == 64
    counts = np.zeros(32)
    for p in granite_raw["prompts"].values():
        for tok in p["decode"]:
            for e in tok[3]:
                counts[e] += 1
    x = np.sort(counts)
    expected = (2 * np.arange(1, 33) - 33) @ x / (32 * x.sum())
    assert st.gini.set_index("layer").loc[3, "gini"] == pytest.approx(expected)
    assert st.reuse["lookups"].sum() == 3 * 64 * 24 * 8
    assert st.reuse.set_index("distance").loc["cold", "lookups"] == summ["entries"].sum()
    assert set(st.static["split"]) == set(granite_raw["prompts"])
    assert "static hot set" in st.format()


def test_cli_convert_and_stats(tmp_path, granite, capsys):
    out = tmp_path / "g.csv"
    assert trace_cli.main(["convert", str(GRANITE), "-o", str(out)]) == 0
    assert "58368 lookups, 3 workload(s), 24 layers" in capsys.readouterr().out
    assert tr.read_trace(out).meta == granite.meta
    assert trace_cli.main([str(GRANITE), "-o", str(tmp_path / "g.parquet")]) == 0
    assert len(tr.read_trace(tmp_path / "g.parquet").frame) == 58368
    assert trace_cli.main(["stats", str(out), "--out-dir", str(tmp_path / "st")]) == 0
    text = capsys.readouterr().out
    assert "expert frequency per layer" in text and "reuse distance" in text
    assert (tmp_path / "st" / "static.csv").is_file()
    assert trace_cli.main(["stats", str(tmp_path / "missing.csv")]) == 2
    with pytest.raises(SystemExit) as e:
        trace_cli.main(["stats", "--help"])
    assert e.value.code == 0
