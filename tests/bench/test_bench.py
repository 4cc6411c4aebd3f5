"""pybmoe sweep: a tiny real sweep on the embedded model with a loopback RPC device.

Only the shape of the output and the cache's counters are asserted, never timings.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pybmoe import cli
from pybmoe.bench import sweeps as bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_sweep(model_q8, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    rc = cli.main(["sweep", "-m", str(model_q8), "--slots", "0,8", "--repeats", "2", "--out", str(out),
                   "-p", "16", "-n", "16", "--threads", "1", "--rpc-threads", "1", "--backend", "rpc",
                   "--no-progress"])
    assert rc == 0
    return out


def test_sweep_writes_tidy_csv(tiny_sweep):
    runs = pd.read_csv(tiny_sweep / "sweep.csv")
    # llama-bench's own columns, then ours
    for c in ("n_prompt", "n_gen", "n_threads", "n_ubatch", "avg_ts", "avg_ns", "model_filename", *bench.CACHE_COLUMNS):
        assert c in runs.columns, c
    assert len(runs) == 2 * 2 * 2                        # slots x repeats x modes
    assert sorted(runs.groupby(["mode", "slots"]).size().tolist()) == [2, 2, 2, 2]
    assert set(runs["repeat"]) == {0, 1}
    pp, tg = runs[runs["mode"] == "pp"], runs[runs["mode"] == "tg"]
    assert (pp["n_prompt"] == 16).all() and (pp["n_gen"] == 0).all()
    assert (tg["n_prompt"] == 0).all() and (tg["n_gen"] == 16).all()
    assert not runs["overflow"].any()
    assert (runs["avg_ts"] > 0).all()


def test_sweep_cache_columns(tiny_sweep):
    runs = pd.read_csv(tiny_sweep / "sweep.csv")
    off, on = runs[runs["slots"] == 0], runs[runs["slots"] == 8]
    assert off["hit_pct"].isna().all()
    assert (off["uploads"] == 0).all() and (off["resident_mib"] == 0).all()
    tg_on = on[on["mode"] == "tg"]
    assert (tg_on["hit_pct"] > 0).all()
    assert (tg_on["uploads"] > 0).all()
    assert (tg_on["resident_mib"] > 0).all()
    # the tiny model: 4 layers x 16 experts, top-4; 8 slots of 0.1992 MiB per layer -> 6.4 MiB resident when full
    assert (tg_on["resident_mib"] <= 6.4 + 1e-6).all()
    assert np.allclose(tg_on["slot_mib"], 0.1992)
    # every decode step of warm-up + 16 tokens is served (one graph per token)
    assert (tg_on["steps"] >= 16).all()
    # prompt batches use the stock graph: no lookups, no uploads
    pp_on = on[on["mode"] == "pp"]
    assert (pp_on["hit_pct"] == 0).all() and (pp_on["uploads"] == 0).all()


def test_sweep_summary_and_plots(tiny_sweep):
    s = pd.read_csv(tiny_sweep / "sweep-summary.csv")
    assert len(s) == 4
    assert (s["n"] == 2).all()
    off = s[s["slots"] == 0]
    assert np.allclose(off["ratio"], 1.0)
    base = off.set_index("mode")["median_ts"]
    assert np.allclose(s["baseline_ts"], s["mode"].map(base))
    assert np.allclose(s["ratio"], s["median_ts"] / s["baseline_ts"])
    assert (s[(s["slots"] == 8) & (s["mode"] == "tg")]["median_hit_pct"] > 0).all()
    for mode in ("pp", "tg"):
        png = tiny_sweep / f"sweep-{mode}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert png.stat().st_size > 10_000


def test_default_against_sync_in_one_sweep(model_q8, tmp_path):
    """--sync off,on runs both upload modes at each cached point, interleaved; the CSV carries the
    upload counters per step and the summary the ratio of the default mode to sync mode."""
    out = tmp_path / "sync"
    rc = cli.main(["sweep", "-m", str(model_q8), "--slots", "4", "--sync", "off,on", "--repeats", "1", "--out",
                   str(out), "-p", "8", "-n", "16", "--modes", "tg", "--threads", "1", "--rpc-threads", "1",
                   "--backend", "rpc", "--no-progress"])
    assert rc == 0
    runs = pd.read_csv(out / "sweep.csv")
    on = runs[runs["slots"] == 4]
    assert sorted(on["sync"].tolist()) == [False, True] and (runs[runs["slots"] == 0]["sync"] == False).all()  # noqa: E712
    assert (on["h2d"] > 0).all() and (on["h2d_per_step"] == on["h2d"] / on["steps"]).all()
    assert (on[~on["sync"]]["waits"] == 0).all() and (on[~on["sync"]]["upload_wait_ms"] == 0).all()
    s = pd.read_csv(out / "sweep-summary.csv")
    default = s[(s["slots"] == 4) & ~s["sync"]]
    sync = s[(s["slots"] == 4) & s["sync"]]
    assert len(default) == len(sync) == 1
    assert np.isclose(default["ratio_to_sync"].iloc[0], default["median_ts"].iloc[0] / sync["median_ts"].iloc[0])
    assert sync["ratio_to_sync"].isna().all()


def test_floor_marks_overflow(model_q8, tmp_path):
    # a floor above the device's free memory: every run's buffers "spill"; rows are marked, not dropped
    res = bench.sweep(model_q8, tmp_path, slots=[0, 8], repeats=1, n_prompt=8, n_gen=8, modes=["tg"], threads=[1],
                      backends=["rpc"], rpc_threads=1, floor_mib=1e9, progress=False, plots=False)
    assert len(res.runs) == 2
    assert res.runs["overflow"].all()
    assert res.runs["overflow_reason"].str.contains("MiB free").all()
    assert res.summary["overflow"].all()


def test_overflow_reason_lines():
    # the engine's own lines (ggml-ext/llama-moe-vram-init.cpp, ggml-cuda.cu) mark a spill ...
    assert "cannot allocate" in bench.overflow_reason(
        "llama_moe_cache_init_impl: moe-cache: cannot allocate 96 slots per layer in CUDA0; the cache is OFF\n")
    assert "cudaMalloc failed" in bench.overflow_reason(
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000.00 MiB on device 0: cudaMalloc failed: "
        "out of memory\n")
    assert bench.overflow_reason("moe-cache: WARNING auto resolved to 0 slots on CUDA0: 10.0 MiB left\n")
    assert "need" in bench.overflow_reason(
        "llama_moe_cache_init: moe-cache: 96 slots/layer need 4100.0 MiB on CUDA0 (28 layers x (96 slots + 2 staging "
        "+ 1 zero) x 1.479 MiB), but it has 3000 MiB free and --moe-expert-cache-floor-mb keeps 1024 MiB free\n")
    # ... while experts placed on the host by -ncmoe are the normal case
    assert bench.overflow_reason(
        "done_getting_tensors: tensor 'blk.0.ffn_gate_exps.weight' (q8_0) (and 11 others) cannot be used with "
        "preferred buffer type RPC0[127.0.0.1:5], using CPU instead\n") is None
    log = ("llama_prepare_model_devices: using device CUDA0 (NVIDIA H200) (0000:00:00.0) - 1000 MiB free\n"
           "load_tensors:        CUDA0 model buffer size =   700.00 MiB\n"
           "llama_kv_cache:        CUDA0 KV buffer size =   100.00 MiB\n"
           "sched_reserve:      CUDA0 compute buffer size =   150.00 MiB\n")
    assert bench.overflow_reason(log) is None
    assert "CUDA0" in bench.overflow_reason(log, floor_mib=100)


def test_max_batch_puts_prefill_through_the_cache(model_q8, tmp_path):
    """--max-batch 16 with -ub 16: llama-bench's pp ubatches go through the cache (lookups and
    uploads in the pp rows), where the default (1 token) leaves them on the stock graph."""
    res = bench.sweep(model_q8, tmp_path, slots=[0, 8], max_batch=[0, 16], ubatch=[16], repeats=1, n_prompt=32,
                      n_gen=4, modes=["pp"], threads=[1], backends=["rpc"], rpc_threads=1, progress=False,
                      plots=False)
    runs = res.runs.set_index(["slots", "max_batch"])
    assert sorted(runs.index) == [(0, 0), (8, 0), (8, 16)]
    assert runs.loc[(8, 0), "hit_pct"] == 0 and runs.loc[(8, 0), "uploads"] == 0
    assert runs.loc[(8, 16), "steps"] >= 2            # the two 16-token ubatches of the pp32 run (and warm-up)
    assert runs.loc[(8, 16), "uploads"] > 0 and runs.loc[(8, 16), "hit_pct"] >= 0
    assert not res.runs["overflow"].any()


@pytest.fixture(scope="module")
def server_sweep(model_q8, tmp_path_factory):
    """The server runner: 3 requests of the bundled traffic (a question, a document, code to
    rewrite), cache off and 8 slots, no speculation and n-gram speculation, one repeat.

    ngram-simple's defaults look up a 12-token n-gram and need 12 tokens to copy, which the tiny
    model's short loops never give; a 1-token lookup drafts on them."""
    out = tmp_path_factory.mktemp("server-sweep")
    rc = cli.main(["sweep", "-m", str(model_q8), "--runner", "server", "--spec", "off,ngram-simple",
                   "--slots", "0,8", "--repeats", "1", "--requests", "3", "-n", "24", "--threads", "1",
                   "--rpc-threads", "1", "--backend", "rpc", "--out", str(out), "--no-progress",
                   "--server-args", "--spec-ngram-simple-size-n 1 --spec-ngram-simple-size-m 4"])
    assert rc == 0
    return out


def test_server_sweep_rows_and_cache(server_sweep):
    runs = pd.read_csv(server_sweep / "sweep.csv")
    for c in ("n_prompt", "n_gen", "n_threads", "n_ubatch", "avg_ts", "avg_ns", "model_filename", "n_requests",
              "draft_n", "draft_accepted", "text_sha1", *bench.CACHE_COLUMNS):
        assert c in runs.columns, c
    assert len(runs) == 2 * 2 * 2                        # slots x specs x modes (one repeat)
    assert set(runs["runner"]) == {"server"} and set(runs["spec"]) == {"off", "ngram-simple"}
    assert (runs["n_requests"] == 3).all()
    assert (runs["avg_ts"] > 0).all() and not runs["overflow"].any()
    pp, tg = runs[runs["mode"] == "pp"], runs[runs["mode"] == "tg"]
    # every run prefills the same three prompts (cache_prompt off) and generates 3 x 24 tokens
    reqs = bench.load_traffic(None, 3, 24)
    assert pp["n_prompt"].nunique() == 1 and pp["n_prompt"].iloc[0] > sum(len(r["prompt"]) for r in reqs) // 8
    assert (pp["n_gen"] == 0).all() and (tg["n_prompt"] == 0).all()
    assert (tg["n_gen"] == 3 * 24).all()
    # greedy text does not depend on the cache (speculation's verify batches may change it; here they do not)
    assert (runs.groupby("spec")["text_sha1"].nunique() == 1).all()
    assert runs["text_sha1"].nunique() == 1
    on, off = runs[runs["slots"] == 8], runs[runs["slots"] == 0]
    assert (on["hit_pct"] > 0).all() and (on["uploads"] > 0).all() and (on["resident_mib"] > 0).all()
    assert off["hit_pct"].isna().all() and (off["uploads"] == 0).all()
    # n-gram speculation drafts and the target accepts some; no speculation drafts nothing
    spec = runs[runs["spec"] == "ngram-simple"]
    assert (spec["draft_accepted"] > 0).all() and (spec["draft_accepted"] <= spec["draft_n"]).all()
    assert spec["draft_n"].nunique() == 1  # the same greedy text drafts the same tokens, cache on or off
    assert (runs[runs["spec"] == "off"]["draft_n"] == 0).all()


def test_server_sweep_summary_per_spec(server_sweep):
    s = pd.read_csv(server_sweep / "sweep-summary.csv")
    assert len(s) == 2 * 2 * 2
    off = s[s["slots"] == 0]
    assert np.allclose(off["ratio"], 1.0)
    # the baseline of each point is the cache-off median of the same speculation and mode
    base = off.set_index(["spec", "mode"])["median_ts"]
    assert np.allclose(s["baseline_ts"], [base[(sp, m)] for sp, m in zip(s["spec"], s["mode"])])
    assert s[s["spec"] == "off"]["draft_accept_pct"].isna().all()
    assert (s[s["spec"] == "ngram-simple"]["draft_accept_pct"].between(0, 100, inclusive="right")).all()
    for mode in ("pp", "tg"):
        assert (server_sweep / f"sweep-{mode}.png").read_bytes()[:8] == PNG_MAGIC


def test_traffic_file_errors(tmp_path):
    assert [r["name"] for r in bench.load_traffic()][:3] == ["short-question", "summarise-document", "rewrite-code"]
    with pytest.raises(FileNotFoundError, match="traffic file"):
        bench.load_traffic(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": [{"prompt": "", "n_predict": 4}]}')
    with pytest.raises(ValueError, match="request 0 needs a non-empty"):
        bench.load_traffic(bad)
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match="not JSON"):
        bench.load_traffic(bad)
    with pytest.raises(ValueError, match="n_requests"):
        bench.load_traffic(None, 0)


@pytest.mark.parametrize("argv, message", [
    (["--slots", "0,-8"], "slots"),
    (["--repeats", "0"], "repeats"),
    (["--backend", "tpu"], "backend"),
    (["--spec", "ngram-simple"], "llama-bench has no speculative decoding"),
    (["--runner", "server", "--spec", "medusa"], "not a speculative decoding type"),
    (["--runner", "server", "--traffic", "/nonexistent/t.json"], "traffic file"),
    (["--sync", "maybe"], "expected off, on or off,on"),
])
def test_bad_input_fails_early(model_q8, tmp_path, capsys, argv, message):
    rc = cli.main(["sweep", "-m", str(model_q8), "--out", str(tmp_path / "o"), "--no-progress", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err
    assert not (tmp_path / "o").exists()


def test_missing_model_fails_early(tmp_path, capsys):
    rc = cli.main(["sweep", "-m", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    assert f"{tmp_path / 'nope.gguf'}: no such file; accepted: a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
