"""tools/device-bench.sh (the GPU benchmark script): its shape, the bandwidth model of
pybmoe.bench.devbench, and the whole script end to end in its --cpu-smoke mode (loopback RPC device)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pybmoe import engine
from pybmoe.bench import devbench
from pybmoe.cli import devbench as devbench_cli
from pybmoe.models import shapes

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "device-bench.sh"


def test_the_gpu_shape_is_the_qwen3_30b_a3b_preset():
    out = subprocess.run([str(SCRIPT), "--shape"], capture_output=True, text=True, check=True).stdout
    kv = dict(re.findall(r"(\w+)=(\d+)", out))
    q = shapes.preset("qwen3-30b-a3b")
    assert (int(kv["BENCH_LAYERS"]), int(kv["BENCH_EXPERTS"]), int(kv["BENCH_TOP_K"])) == (q.n_layer, q.n_expert,
                                                                                              q.top_k)
    gpu = next(ln for ln in SCRIPT.read_text().splitlines() if "L=${BENCH_LAYERS:-48}" in ln)
    want = dict(E=q.n_expert, K=q.top_k, D=q.n_embd, F=q.n_ff_exp, H=q.n_head, HKV=q.n_head_kv, HD=q.head_dim)
    got = {k: int(v) for k, v in re.findall(r"\b([A-Z]+)=(\d+)", gpu)}
    assert got == want


def _folder(tmp_path: Path) -> Path:
    """A device-bench output folder with made-up runs: host, cache-8 (50% hit) and vram, tg and pp."""
    d = tmp_path / "out"
    (d / "runs").mkdir(parents=True)
    (d / "bw.txt").write_text("pybmoe-bw: host_read_gbs=100.00 h2d_pinned_gbs=50.00 h2d_pageable_gbs=20.00 "
                              "d2d_gbs=4000.00 threads=16 device=H200\n")
    (d / "synth.txt").write_text("pybmoe-make-synth: m.gguf bytes=1000000000 expert_bytes=1000000 dense_bytes=4000000 "
                                 "expert_tensors_bytes=960000000 seconds=1.0\n"
                                 "shape: n_layer=10 n_expert=96 top_k=4 n_embd=256 n_ff_exp=128 type=q4_0\n")
    rows = ["point\tmode\tslots\tplacement\trepack\trc\twall_s"]
    for point, slots, place in (("vram", 0, "vram"), ("cache-8", 8, "cache"), ("host", 0, "host")):
        for mode in ("tg", "pp"):
            rows.append(f"{point}\t{mode}\t{slots}\t{place}\t0\t0\t3")
            ts = {"host": 20.0, "cache": 30.0, "vram": 90.0}[place] * (50 if mode == "pp" else 1)
            (d / "runs" / f"{point}_{mode}.csv").write_text(
                "n_prompt,n_gen,n_ubatch,n_threads,avg_ts,stddev_ts\n"
                f"{64 if mode == 'pp' else 0},{0 if mode == 'pp' else 32},512,16,{ts},1.0\n")
            log = "load_tensors: done\n"
            if place == "cache" and mode == "tg":
                log += ("moe-cache: 50.0% hit, resident 8.0 MiB, uploads 100 (95.4 MiB), layer_demand 3.81 MiB, "
                        "token_demand 38.15 MiB, steps 100\n")
            (d / "runs" / f"{point}_{mode}.log").write_text(log)
    (d / "runs.tsv").write_text("\n".join(rows) + "\n")
    return d


def test_bandwidth_model(tmp_path):
    d = _folder(tmp_path)
    df = devbench.analyze(d)
    assert (d / "device-bench.csv").is_file()
    assert (d / "device-bench-tg.png").stat().st_size > 0 and (d / "device-bench-pp.png").stat().st_size > 0
    assert list(df["point"]) == ["host", "cache-8", "vram"] * 2 and list(df["mode"]) == ["tg"] * 3 + ["pp"] * 3
    tg = df[df["mode"] == "tg"].set_index("point")
    tok = 10 * 4 * 1_000_000                      # n_layer x top_k x expert bytes
    dense_ms = 1e3 * 4_000_000 / 4000e9
    assert tg.loc["host", "model_ms"] == pytest.approx(1e3 * tok / 100e9 + dense_ms)
    assert tg.loc["vram", "model_ms"] == pytest.approx(1e3 * tok / 4000e9 + dense_ms)
    assert tg.loc["cache-8", "model_ms"] == pytest.approx(1e3 * (tok / 2 / 100e9 + tok / 2 / 4000e9) + dense_ms)
    assert tg.loc["cache-8", "miss_bytes"] == tg.loc["cache-8", "hit_bytes"] == tok / 2
    # uploads: 95.4 MiB over 100 steps, pageable host->device at 20 GB/s
    assert tg.loc["cache-8", "upload_ms"] == pytest.approx(1e3 * 95.4 * 2**20 / 100 / 20e9)
    assert tg.loc["host", "efficiency"] == pytest.approx(20.0 / tg.loc["host", "model_ts"])
    assert math.isnan(tg.loc["host", "hit_pct"]) and tg.loc["cache-8", "hit_pct"] == 50.0
    pp = df[df["mode"] == "pp"].set_index("point")
    # every host-resident expert crosses the link once per ubatch (64 tokens here)
    x_ms = 1e3 * 960_000_000 / 20e9 + 1e3 * (960_000_000 + 4_000_000) / 4000e9
    assert pp.loc["host", "model_ts"] == pytest.approx(64 / (x_ms / 1e3))
    assert pp.loc["vram", "miss_bytes"] == 0
    assert set(df["bw_source"]) == {"measured"}
    # the smoke run's stand-in: every device figure is the host's
    s = devbench.analyze(d, stand_in=True, plots=False)
    assert (s["hbm_gbs"] == 100.0).all() and (s["h2d_gbs"] == 100.0).all()


def test_missing_files_are_errors(tmp_path, capsys):
    d = _folder(tmp_path)
    (d / "bw.txt").unlink()
    assert devbench_cli.main([str(d)]) == 2
    assert "bw.txt" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pybmoe-bw:"):
        devbench.parse_kv_line("nothing here", "pybmoe-bw:")


def test_cpu_smoke_end_to_end(tmp_path):
    """The whole script on the loopback RPC device with the tiny shape and prebuilt binaries."""
    bins = engine.find_binary("llama-bench").parent
    for name in ("pybmoe-make-synth", "pybmoe-bw", "ggml-rpc-server"):
        if not (bins / name).is_file():
            pytest.skip(f"{name} is not built next to llama-bench in {bins}")
    out = tmp_path / "smoke"
    env = dict(os.environ, OUT=str(out), BENCH_BIN_DIR=str(bins), BENCH_SLOTS="8 16", BENCH_REPS="2",
               BENCH_N_GEN="16", BENCH_N_PROMPT="32", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run([str(SCRIPT), "--cpu-smoke"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    df = pd.read_csv(out / "device-bench.csv")
    got = set(zip(df["point"], df["mode"]))
    assert {("host", "tg"), ("cache-8", "tg"), ("cache-16", "tg"), ("vram", "tg"), ("host", "pp"), ("vram", "pp"),
            ("host-repack", "tg")} <= got
    assert (df["rc"] == 0).all() and (df["avg_ts"] > 0).all()
    tg = df[df["mode"] == "tg"].set_index("point")
    assert 0 < tg.loc["cache-8", "hit_pct"] < tg.loc["cache-16", "hit_pct"] <= 100
    assert (tg["model_ts"] > 0).all() and set(df["bw_source"]) == {"stand-in (host read for every figure)"}
    # the engine's own per-token demand agrees with the model's expert bytes per token
    assert tg.loc["cache-8", "token_demand_mib"] == pytest.approx(tg.loc["cache-8", "token_expert_bytes"] / 2**20,
                                                                  abs=0.01)
    summary = (out / "summary.txt").read_text()
    assert "total:" in summary and "bandwidths" in summary
    assert (out / "device-bench-tg.png").is_file() and (out / "device-bench-pp.png").is_file()
