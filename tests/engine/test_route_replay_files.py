"""--moe-route-replay with a mangled trace file ("Files from outside"): the engine's loader
(ggml-ext/llama-moe-replay.cpp) must refuse it with the file, the line and what it expected, and
exit non-zero: never a crash (a signal), a hang, or a run on a misread routing.

The cases of ``test_a_misread_the_loader_let_through_is_refused`` were accepted silently (or
misreported) before the loader checked every field."""
from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from pybmoe import engine

COLUMNS = "workload,phase,ubatch,token,layer,rank,expert,hit\n"
# the embedded default model: 4 MoE layers, 16 experts, top-4
ROWS = "".join(f"engine,decode,0,0,{layer},{rank},{(layer + rank) % 16},-1\n" for layer in range(4) for rank in range(4))


def _replay(model, rpc, tmp_path, data: bytes):
    bad = tmp_path / "bad.csv"
    bad.write_bytes(data)
    cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(tmp_path / "l.bin"), "-m", str(model),
           "-p", "hi", "-n", "2", "-t", "2", "--fit", "off", *engine.host_experts_args(rpc.endpoint),
           "--moe-route-replay", str(bad)]
    r = subprocess.run(cmd, capture_output=True, timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode > 0, f"exit {r.returncode} (a negative one is a signal): {err[-1500:]}"
    assert f"moe-route-replay: {bad}: " in err and "cannot replay the routing trace" in err, err[-1500:]
    return err


@pytest.mark.parametrize("data, why", [
    (b"", "no trace rows"),                                                                 # an empty file
    (COLUMNS.encode(), "no trace rows"),
    ((COLUMNS + ROWS.replace(",0,0,-1\n", ",0,0,-1\n", 1) + "engine,decode,0,1,0,0,16,-1\n").encode(),
     "line 18: expert 16, but the model has 16 experts per layer"),                          # out-of-range expert id
    ((COLUMNS + ROWS + "engine,decode,0,1,0,0,-1,-1\n").encode(), "line 18: expert -1"),
    ((COLUMNS + ROWS + "engine,decode,0,1,7,0,1,-1\n").encode(), "line 18: layer 7 is not a MoE layer"),  # layer count
    ((COLUMNS + ROWS.split("engine,decode,0,0,3,")[0]).encode(), "MoE layer 3 has no rows"),  # 3 of the 4 layers
    ((COLUMNS + ROWS + "engine,decode,0,1,0,4,1,-1\n").encode(), "line 18: rank 4, but the model's top-k is 4"),
    ((COLUMNS + "".join(",".join(r.split(",")[:7]) + "\n" for r in ROWS.splitlines())).encode(),
     "is not a trace row"),                                                                 # 7 columns, no header
])
def test_a_bad_trace_is_refused_with_the_file_and_the_problem(model_q8, rpc, tmp_path, data, why):
    assert why in _replay(model_q8, rpc, tmp_path, data)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_file_of_random_bytes_is_refused(model_q8, rpc, tmp_path, seed):
    rnd = random.Random(seed)
    _replay(model_q8, rpc, tmp_path, bytes(rnd.randrange(256) for _ in range(4096)))


@pytest.mark.parametrize("data, why", [
    # another column order: was replayed with ubatch/token and expert/hit swapped
    (("workload,phase,token,ubatch,layer,rank,hit,expert\n" + ROWS).encode(),
     "line 1: the columns are 'workload,phase,token,ubatch,layer,rank,hit,expert', expected workload,phase,"),
    ((COLUMNS.replace(",hit", "") + ROWS).encode(), "line 1: the columns are"),              # a column missing
    # an expert id past 32 bits: %d wrapped 4294967297 to expert 1 and replayed it
    ((COLUMNS + ROWS + "engine,decode,0,1,0,0,4294967297,-1\n").encode(), "line 18: expert 4294967297, but the model"),
    ((COLUMNS + ROWS.replace(",-1\n", ",-1xyz\n")).encode(), "line 2: hit '-1xyz' is not an integer"),  # ignored
    ((COLUMNS + ROWS + "engine,decode,0,1,0,0,1,-1,1,1\n").encode(), "line 18 is not a trace row"),  # extra fields
    ((COLUMNS + ROWS.replace("decode", "warmup")).encode(), "line 2: phase 'warmup', expected prefill or decode"),
    ((COLUMNS + ROWS + "engine,decode,0,1,0,0,1").encode(), "line 18 has no line end: the file is cut off"),
    ((COLUMNS + ROWS + "engine,decode,0,1,0,0,1,-1\x00\n").encode(), "line 18 holds a NUL byte"),
    ((COLUMNS + ROWS + "engine,decode,0,-5,0,0,1,-1\n").encode(), "line 18: token -5, expected 0 .."),
])
def test_a_misread_the_loader_let_through_is_refused(model_q8, rpc, tmp_path, data, why):
    assert why in _replay(model_q8, rpc, tmp_path, data)


def test_a_byte_order_mark_and_crlf_lines_replay(model_q8, rpc, tmp_path):
    """A trace saved by an editor (a UTF-8 BOM, CR LF line ends) replays like the plain one: the same
    logits, bit for bit."""
    plain = tmp_path / "plain.csv"
    plain.write_text("# pybmoe-trace v1\n" + COLUMNS + ROWS)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + ("# pybmoe-trace v1\r\n" + COLUMNS + ROWS).replace("\n", "\r\n").encode())
    out = {}
    for path in (plain, bom):
        cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(tmp_path / f"{path.stem}.bin"),
               "-m", str(model_q8), "-p", "hi", "-n", "2", "-t", "2", "--fit", "off",
               *engine.host_experts_args(rpc.endpoint), "--moe-route-replay", str(path)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        log = r.stdout + r.stderr
        assert r.returncode == 0 and "moe-route-replay: 4 MoE layers take their experts from" in log, log[-1500:]
        out[path.stem] = (tmp_path / f"{path.stem}.bin").read_bytes()
    assert out["bom"] == out["plain"] and len(out["plain"]) > 0
