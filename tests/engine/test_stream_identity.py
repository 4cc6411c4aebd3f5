"""The stream tier is exact: with ``--moe-stream-cache-mb`` the logits are bit-identical to an
all-resident run (the experts memory-mapped, no flag), on a CPU-only run.

Grid: 3 architectures (qwen3moe: separate gate/up/down; gpt-oss: per-expert biases; gemma4: fused
gate_up and a down scale) x ubatch {1, 7, 32, 512} x the budgets {the mechanical minimum, below the
cycle, at the cycle, half the experts, all of them} that exist at that ubatch. Every run also
checks that the tier served every MoE layer (hits + misses > 0 per layer) and that the cliff WARN
appears exactly when the budget is below the cycle.

The model: 2 layers, 16 experts, top-3, n_embd 512, expert ff 320, Q8_0, so one (layer, expert)
entry is 0.50 MiB and a budget in whole MiB is a handful of entries.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.routing import sim

PROMPT = ("A model larger than memory streams its experts from the file: each layer reads the experts its "
          "router picked, keeps the recently used ones in RAM, and computes exactly what it would have.")
N_PREDICT = 6
SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320)
ARCHS = ["qwen3moe", "gpt-oss", "gemma4"]
UBATCHES = [1, 7, 32, 512]
MIB = 1024 * 1024


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request) -> Path:
    return models.cached_model_path(models.ModelSpec(arch=request.param, **SHAPE))


def cpu_args(ub: int) -> list[str]:
    return ["-b", "512", "-ub", str(ub), "-ngl", "0", "--no-repack"]


def budgets(model: Path, ub: int) -> dict[str, int]:
    """The budget points (MiB) that exist at this ubatch, by name."""
    entry, n_layer, n_expert, k = sim.gguf_expert_bytes(model)
    need = lambda entries: math.ceil(entries * entry / MIB)  # noqa: E731
    floor = lambda entries: math.floor(entries * entry / MIB)  # noqa: E731
    lo = need(min(n_expert, k * ub))
    out = {"min": lo, "cycle": need(n_layer * k), "half": need(n_layer * n_expert / 2), "all": need(n_layer * n_expert)}
    if floor(n_layer * k - 1) >= lo:
        out["below_cycle"] = floor(n_layer * k - 1)
    return {name: b for name, b in out.items() if b >= lo}


def run(model: Path, tmp: Path, ub: int, extra: list[str], name: str, **kw) -> engine.LogitsRun:
    return engine.run_logits(model, tmp / f"{model.stem}-{name}.bin", [*cpu_args(ub), *extra], prompt=PROMPT,
                             n_predict=N_PREDICT, ctx=512, timeout=600, **kw)


@pytest.mark.parametrize("ub", UBATCHES)
def test_streamed_logits_equal_all_resident(arch_model, ub, tmp_path):
    base = run(arch_model, tmp_path, ub, [], f"base-{ub}")
    assert base.stream_layers == {} and "moe-stream" not in base.log
    entry, n_layer, _, k = sim.gguf_expert_bytes(arch_model)
    cycle_mib = n_layer * k * entry / MIB
    seen = set()
    for name, mib in budgets(arch_model, ub).items():
        if mib in seen:
            continue
        seen.add(mib)
        r = run(arch_model, tmp_path, ub, ["--moe-stream-cache-mb", str(mib)], f"stream-{ub}-{mib}")
        assert r.tokens == base.tokens, (name, mib)
        assert r.logits == base.logits, f"{name} budget {mib} MiB at ubatch {ub}: logits differ"
        assert "moe-stream-preamble:" in r.log and "moe-stream: " in r.log
        assert len(r.stream_layers) == n_layer and all(h + m > 0 for h, m in r.stream_layers.values()), r.stream_layers
        cliff = "below the cache cycle" in r.log
        assert cliff == (mib < cycle_mib), f"{name}: budget {mib} MiB, cycle {cycle_mib:.2f} MiB, WARN {cliff}"


def test_a_budget_under_the_minimum_fails_the_load_with_the_arithmetic(tmp_path):
    """At ubatch 512 the least budget is one token's top-3 beside the expert waves' window (2 experts per
    read lane: 8 at the default 4), 11 entries of 0.498 MiB; with the waves off it is the largest step,
    the layer's 16 experts."""
    import os
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, 512, ["--moe-stream-cache-mb", "2"], "under")
    msg = str(e.value)
    assert "under the mechanical minimum of 5.5 MiB" in msg and "top-3 experts beside the expert waves' window of 8" in msg
    assert "11 experts of 0.50 MiB; give at least 6 MiB" in msg
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, 512, ["--moe-stream-cache-mb", "5"], "under-nowaves",
            env={**os.environ, "PYBMOE_MOE_STREAM_WAVES": "0"})
    msg = str(e.value)
    assert "under the mechanical minimum" in msg and "16 experts" in msg and "give at least 8 MiB" in msg


WAVE_ARGS = ["--moe-stream-cache-mb", "3", "--moe-stream-io-threads", "1"]


@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("ub", [32, 512])
def test_a_budget_under_one_layer_step_reads_the_rest_in_waves_bit_identical(arch_model, ub, overlap, tmp_path):
    """3 MiB at ubatch 32 or 512 (the prompt's steps want most of the 16 experts; the largest step needs
    all 16, 8 MiB): the LRU holds 6 - 2 entries, the window 2 (one read lane), and each prompt step reads
    the misses it could not admit in waves while its MUL_MAT_IDs run. The logits and tokens are those of
    an all-resident run, with the reads behind compute forced off and on."""
    import os
    base = run(arch_model, tmp_path, ub, [], f"base-{ub}")
    r = run(arch_model, tmp_path, ub, WAVE_ARGS, f"waves-{ub}-{overlap}",
            env={**os.environ, "PYBMOE_MOE_STREAM_OVERLAP": overlap})
    assert "least_mb=2.49 wave_experts=2" in r.log and "is read in expert waves, 2 experts ahead" in r.log
    waves = [int(m) for m in re.findall(r"wave steps (\d+)", r.log)]
    assert waves and waves[-1] >= 1, r.log[-2000:]
    assert r.tokens == base.tokens and r.logits == base.logits
    assert all(h + m > 0 for h, m in r.stream_layers.values()), r.stream_layers


@pytest.mark.parametrize("policy", [None, "global-lru"])
@pytest.mark.parametrize("ub", [32, 512])
def test_the_engines_hits_equal_the_simulators_with_waves(tmp_path, ub, policy):
    """Under one layer step's set the LRU admits what it can, then the step's other misses pass through
    (read in waves, not admitted): the simulator's bypassed misses. The engine's own trace against
    ``simulate`` at the trace's LRU entries (the budget's 6 less the window's 2), every lookup."""
    import os
    from pybmoe.routing import trace as tr
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **{**SHAPE, "n_layer": 3}))
    p = tmp_path / f"trace-waves-{ub}.csv"
    env = {**os.environ, "PYBMOE_MOE_STREAM_POLICY": policy} if policy else None
    r = run(model, tmp_path, ub, [*WAVE_ARGS, "--moe-trace", str(p)], f"trace-waves-{ub}", env=env)
    assert int(re.findall(r"wave steps (\d+)", r.log)[-1]) >= 1
    t = tr.read_trace(p)
    assert int(t.meta.extra["stream_entries"]) == 4
    engine_hit = t.frame["ram_hit"].to_numpy()
    want = sim.simulate(t, t.meta.extra["stream_policy"], budget_entries=4, phase="all",
                        lend_entries=int(t.meta.extra["stream_lend"]))
    bad = (engine_hit != want.predicted).nonzero()[0]
    assert bad.size == 0, f"{bad.size} of {len(engine_hit)} lookups differ, first rows {bad[:5].tolist()}"
    assert int((engine_hit == 1).sum()) > 0 and int((engine_hit == 0).sum()) > 0


@pytest.mark.parametrize("value,why", [("-5", "integer in 0 .. 2147483647"), ("many", "integer in 0 .. 2147483647"),
                                       ("4294967296", "integer in 0 .. 2147483647"),
                                       ("1000000000000", "integer in 0 .. 2147483647")])
def test_a_bad_value_is_refused(tmp_path, value, why):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, 1, ["--moe-stream-cache-mb", value], "bad")
    assert why in str(e.value)


def test_auto_and_a_number_are_refused_together(tmp_path):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, 1, ["--moe-stream-cache-mb", "auto", "--moe-stream-cache-mb", "4"], "mixed")
    assert "mutually exclusive" in str(e.value)


def test_a_budget_over_the_experts_is_clamped_and_auto_sizes(tmp_path):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    base = run(model, tmp_path, 1, [], "base")
    big = run(model, tmp_path, 1, ["--moe-stream-cache-mb", "100000", "-v"], "big")  # -v: INFO lines
    assert big.log.count("100000 MiB is more than every streamed expert (15.9 MiB); clamped to that") == 1
    assert "budget_mb=15.94" in big.log and big.logits == base.logits
    auto = run(model, tmp_path, 1, ["--moe-stream-cache-mb", "auto", "--moe-stream-floor-mb", "0",
                                    "--moe-stream-ceil-mb", "5"], "auto")
    assert "moe-stream: auto: MemAvailable" in auto.log and "ceil 5 MiB" in auto.log
    # the ceiling caps whole entries: 10 experts of 0.498 MiB
    assert "budget_mb=4.98" in auto.log and auto.logits == base.logits


def test_the_repack_line_is_said_once(tmp_path):
    """The tier turns CPU repack off; --fit (on by default) converts the params a second time (the
    draft model's too), which printed the line twice."""
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    r = engine.run_logits(model, tmp_path / "l.bin", ["-b", "512", "-ub", "1", "-ngl", "0", "-v",
                                                       "--moe-stream-cache-mb", "4"], prompt="hi", n_predict=1, ctx=512)
    assert r.log.count("moe-stream: CPU repack is off (as with --no-repack)") == 1, r.log[-3000:]


def test_o_direct_refused_falls_back_to_buffered_reads_with_one_warn(tmp_path):
    import os
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    base = run(model, tmp_path, 1, [], "base")
    r = run(model, tmp_path, 1, ["--moe-stream-cache-mb", "4"], "nodirect",
            env={**os.environ, "PYBMOE_MOE_STREAM_NO_ODIRECT": "1"})
    assert r.log.count("refused O_DIRECT") == 1 and "direct_io=0" in r.log
    assert r.logits == base.logits
    d = run(model, tmp_path, 1, ["--moe-stream-cache-mb", "4"], "direct")
    assert "direct_io=1" in d.log and "refused O_DIRECT" not in d.log



@pytest.mark.parametrize("policy", [None, "global-lru"])
@pytest.mark.parametrize("ub,mib", [(1, 2), (1, 3), (1, 5), (4, 8), (512, 8), (512, 12)])
def test_the_engines_stream_hits_equal_the_simulators_policy(tmp_path, ub, mib, policy):
    """The engine's own trace (its ram_hit column) against ``simulate(policy=P, mib=B, model=M)``
    on that trace, every lookup, prefill and decode alike (at ubatch 512 the prompt is one step per
    layer, with repeated experts inside the step), for each policy the tier offers: the default
    (global-lru-scan, named by the trace's header) and ``PYBMOE_MOE_STREAM_POLICY=global-lru``."""
    import os
    from pybmoe.routing import trace as tr
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **{**SHAPE, "n_layer": 3}))
    p = tmp_path / f"trace-{ub}-{mib}.csv"
    env = {**os.environ, "PYBMOE_MOE_STREAM_POLICY": policy} if policy else None
    r = run(model, tmp_path, ub, ["--moe-stream-cache-mb", str(mib), "--moe-trace", str(p)], f"trace-{ub}-{mib}",
            env=env)
    t = tr.read_trace(p)
    assert "ram_hit" in t.frame.columns
    assert t.meta.extra["stream_policy"] == (policy or sim.STREAM_POLICY)
    engine_hit = t.frame["ram_hit"].to_numpy()
    assert (engine_hit >= 0).all()  # every lookup went through the tier (no VRAM tier here)
    # the prefetch window (a quarter of a layer at ubatch 4 and 512, none at 1) is lent to decode's steps
    lend = int(t.meta.extra["stream_lend"])
    assert lend == (0 if ub == 1 else 4)
    want = sim.simulate(t, t.meta.extra["stream_policy"], mib=mib, model=model, phase="all", lend_entries=lend)
    assert want.budget_entries == int(t.meta.extra["stream_entries"])
    bad = (engine_hit != want.predicted).nonzero()[0]
    assert bad.size == 0, f"{bad.size} of {len(engine_hit)} lookups differ, first rows {bad[:5].tolist()}"
    hits, misses = int((engine_hit == 1).sum()), int((engine_hit == 0).sum())
    assert sum(h for h, _ in r.stream_layers.values()) == hits and sum(m for _, m in r.stream_layers.values()) == misses
    assert hits > 0 and misses > 0
    # the summary counts the scans: prompt steps (ubatch 4 or 512) that want 8 or more of the 16 experts,
    # whose pass of 3 layers 8 or 12 MiB cannot hold; decode's 3 of 16 never are one; plain LRU has none
    scans = [int(m) for m in re.findall(r"scan steps (\d+)", r.log)]
    assert scans, r.log[-2000:]
    if policy is not None or ub == 1:
        assert scans[-1] == 0
    else:
        assert 0 < scans[-1] <= (3 if ub == 512 else 3 * math.ceil(len(PROMPT) / 4))


def test_an_unknown_stream_policy_is_refused_loudly(tmp_path):
    """PYBMOE_MOE_STREAM_POLICY names the tier's policy; another value is an error line naming the two
    accepted, and the tier is OFF with a WARN (the run goes on, all-resident, as for any tier that
    cannot engage); the load line names the policy in use."""
    import os
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    base = run(model, tmp_path, 1, [], "base")
    r = run(model, tmp_path, 1, ["--moe-stream-cache-mb", "4"], "lfu", env={**os.environ, "PYBMOE_MOE_STREAM_POLICY": "lfu"})
    assert "PYBMOE_MOE_STREAM_POLICY=lfu; accepted: global-lru-scan (the default), global-lru" in r.log
    assert "was requested but the stream tier is OFF" in r.log and "moe-stream-preamble" not in r.log
    assert r.logits == base.logits
    ok = run(model, tmp_path, 1, ["--moe-stream-cache-mb", "4"], "default")
    assert "policy global-lru-scan, " in ok.log and ok.logits == base.logits


@pytest.mark.parametrize("policy,line", [("warm", "dense warm-up: "), ("anon", "dense weights into anonymous memory: ")])
def test_the_dense_policies_change_no_logit(tmp_path, policy, line):
    model = models.cached_model_path(models.ModelSpec(arch="gpt-oss", **SHAPE))
    base = run(model, tmp_path, 7, [], "base")
    r = run(model, tmp_path, 7, ["--moe-stream-cache-mb", "8", "--dense-weights", policy], policy)
    assert r.log.count(line) == 1 and r.logits == base.logits and r.tokens == base.tokens
    alone = run(model, tmp_path, 7, ["--dense-weights", policy], f"{policy}-alone")  # without the stream tier too
    assert alone.logits == base.logits


def test_a_bad_dense_policy_is_refused(tmp_path):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, 1, ["--dense-weights", "ram"], "bad")
    assert "expects auto, mmap, warm or anon" in str(e.value)


@pytest.mark.parametrize("slots", [2, 8])
def test_three_tiers_on_the_rpc_device_equal_the_stock_split(rpc, tmp_path, slots):
    """Disk -> RAM -> VRAM: layers on the loopback device, experts on the host (--cpu-moe), the VRAM
    tier caching `slots` of them per layer and the stream tier the rest. The logits equal the same
    layout with both tiers off; the stream tier looked up only what the device did not hold."""
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    layout = ["-b", "512", "-ub", "1", *engine.host_experts_args(rpc.endpoint)]
    base = engine.run_logits(model, tmp_path / "base.bin", layout, prompt=PROMPT, n_predict=N_PREDICT, ctx=512)
    both = engine.run_logits(model, tmp_path / f"both-{slots}.bin",
                             [*layout, *engine.cache_args(slots), "--moe-stream-cache-mb", "4"],
                             prompt=PROMPT, n_predict=N_PREDICT, ctx=512)
    assert both.logits == base.logits and both.tokens == base.tokens
    vram_hits = sum(h for h, _ in both.layers.values())
    vram_misses = sum(m for _, m in both.layers.values())
    stream_lookups = sum(h + m for h, m in both.stream_layers.values())
    assert vram_hits > 0 and stream_lookups > 0
    # every lookup the device did not hold went to the stream tier, and no other
    assert stream_lookups == vram_misses


def test_a_model_without_moe_layers_is_inert_with_one_warn_line(tmp_path):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3", n_layer=2, n_embd=256, n_ff_exp=256))
    base = run(model, tmp_path, 1, [], "dense-base")
    r = run(model, tmp_path, 1, ["--moe-stream-cache-mb", "8"], "dense")  # the default verbosity shows it
    assert r.log.count("model has no MoE layers; --moe-stream-cache-mb is inert") == 1
    assert "moe-stream-preamble" not in r.log and r.logits == base.logits


@pytest.mark.parametrize("ub", [1, 32])
def test_reads_behind_compute_change_no_logit_and_no_hit(arch_model, ub, tmp_path):
    """With PYBMOE_MOE_STREAM_OVERLAP=1 a decode step submits its reads and the layer's MUL_MAT_IDs wait
    for each expert's bytes (patch 0033's hook; one line says so, the preamble says overlap=1); with 0
    every miss is read first (overlap=0, no line). Both are bit-identical to all-resident, with the same
    hits per layer, at the mechanical minimum (many misses per step; at ubatch 32 the prompt's steps want
    half of the layer and block, its decode steps do not)."""
    import os
    base = run(arch_model, tmp_path, ub, [], "ov-base")
    mib = budgets(arch_model, ub)["min"]
    on = run(arch_model, tmp_path, ub, ["--moe-stream-cache-mb", str(mib)], f"ov-on-{ub}",
             env={**os.environ, "PYBMOE_MOE_STREAM_OVERLAP": "1"})
    off = run(arch_model, tmp_path, ub, ["--moe-stream-cache-mb", str(mib)], f"ov-off-{ub}",
              env={**os.environ, "PYBMOE_MOE_STREAM_OVERLAP": "0"})
    assert re.search(r"overlap=1$", on.log, re.M) and re.search(r"overlap=0$", off.log, re.M)
    assert on.log.count("reads behind compute (PYBMOE_MOE_STREAM_OVERLAP=1)") == 1
    assert "reads behind compute" not in off.log and "no MUL_MAT_ID wait hook" not in on.log
    assert on.logits == base.logits and off.logits == base.logits and on.tokens == base.tokens
    assert on.stream_layers == off.stream_layers and sum(m for _, m in on.stream_layers.values()) > 0


def test_the_timed_rule_keeps_the_faster_way():
    """The auto rule's trial where every CPU computes (ggml-ext/llama-moe-overlap.h), fed made-up token
    times by tests/engine/overlap_trial.cpp, built here against ggml-ext/llama-moe-overlap.cpp: both ways
    are timed, alternately; the faster one stays (on when tokens took 70 ms with and 80 ms without, off
    at 90 against 60); a prefill ubatch and the time around it are not timed."""
    import shutil
    import subprocess
    import tempfile
    repo = Path(__file__).resolve().parents[2]
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "overlap_trial"
        subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(repo / "ggml-ext"), "-o", str(exe),
                        str(repo / "tests" / "engine" / "overlap_trial.cpp"),
                        str(repo / "ggml-ext" / "llama-moe-overlap.cpp")], check=True)
        out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok", out.stdout + out.stderr
    assert "faster with: on, medians 70000 / 80000 us" in out.stdout
    assert "faster without: off, medians 90000 / 60000 us" in out.stdout
    assert "prefill between: not timed, on, medians 10 / 20 us" in out.stdout


def test_reads_go_behind_compute_by_default_when_the_threads_leave_a_cpu(tmp_path):
    """PYBMOE_MOE_STREAM_OVERLAP unset (the default, overlap=auto in the preamble): with fewer compute
    threads than the process's CPUs a decode step's reads go behind compute, and one line says so; with
    as many, the first decode tokens alternate with and without (PYBMOE_MOE_STREAM_OVERLAP_TRIAL=2: two
    tokens each way) and the faster way stays, each in one line. Either way the logits and the hits are
    those of an all-resident run and of a forced-off run."""
    import os
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    n_cpus = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "PYBMOE_MOE_STREAM_OVERLAP"}
    env["PYBMOE_MOE_STREAM_OVERLAP_TRIAL"] = "2"
    mib = budgets(model, 1)["min"]
    flags = ["--moe-stream-cache-mb", str(mib)]
    for t in sorted({n_cpus, 1}, reverse=True):  # every core computing; one compute thread (a spare CPU)
        threads = ["-t", str(t), "-tb", str(t)]
        base = run(model, tmp_path, 1, threads, f"auto-base-{t}")
        off = run(model, tmp_path, 1, flags + threads, f"auto-off-{t}", env={**env, "PYBMOE_MOE_STREAM_OVERLAP": "0"})
        got = run(model, tmp_path, 1, flags + threads, f"auto-{t}", env=env)
        assert re.search(r"overlap=auto$", got.log, re.M)
        if t == n_cpus:
            assert f"reads behind compute: timed (auto): {t} compute thread(s) take all {n_cpus} CPUs" in got.log
            assert "reads behind compute: on (auto):" not in got.log
            said = re.findall(r"reads behind compute: (on|off) \(auto, timed\): decode tokens took ([\d.]+) ms with "
                              r"them, ([\d.]+) ms without \(medians of 2 tokens each\)", got.log)
            assert len(said) == 1, got.log
            way, with_ms, without_ms = said[0]
            assert (way == "on") == (float(with_ms) < float(without_ms))
        else:
            assert f"reads behind compute: on (auto): {t} compute thread(s) of {n_cpus} CPUs" in got.log
        assert got.logits == base.logits == off.logits and got.tokens == base.tokens
        assert got.stream_layers == off.stream_layers and sum(m for _, m in got.stream_layers.values()) > 0
    # a value the variable does not take says so and falls back to auto
    bad = run(model, tmp_path, 1, flags, "auto-bad", env={**env, "PYBMOE_MOE_STREAM_OVERLAP": "yes"})
    assert "PYBMOE_MOE_STREAM_OVERLAP=yes; accepted: 0, 1 or auto; using auto" in bad.log
    assert re.search(r"overlap=auto$", bad.log, re.M)
    bad = run(model, tmp_path, 1, flags, "trial-bad", env={**env, "PYBMOE_MOE_STREAM_OVERLAP_TRIAL": "0"})
    assert "PYBMOE_MOE_STREAM_OVERLAP_TRIAL=0; accepted: 1 .. 1000 decode tokens each way; using 4" in bad.log


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_a_gguf_truncated_after_load_stops_with_the_file_and_the_offset(tmp_path, overlap):
    """The experts are read at run time: a file cut short after the load (here without mmap, so the
    dense weights are already in RAM) makes the first read past its end fail, naming the file and
    the offset, instead of computing with missing bytes: with the reads behind compute (the layer's
    MUL_MAT_ID waits for the expert and stops there: PYBMOE_MOE_STREAM_OVERLAP=1) and without."""
    import os
    import shutil
    import subprocess
    import sys
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    copy = tmp_path / "cut.gguf"
    shutil.copy(model, copy)
    script = (
        "import os, sys\n"
        "from pybmoe.engine import bindings\n"
        "p = sys.argv[1]\n"
        "llm = bindings.Llama(p, n_gpu_layers=0, moe_stream_cache_mb=4, n_ubatch=1, use_mmap=False, verbose=False)\n"
        "os.truncate(p, os.path.getsize(p) * 6 // 10)\n"
        "llm('The stream tier reads experts', max_tokens=4, temperature=0)\n"
        "print('generated')\n")
    r = subprocess.run([sys.executable, "-c", script, str(copy)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYBMOE_MOE_STREAM_OVERLAP": overlap})
    assert r.returncode != 0 and "generated" not in r.stdout
    assert "moe-stream: short read" in r.stderr and str(copy) in r.stderr and "at offset" in r.stderr, r.stderr[-2000:]


@pytest.fixture(scope="module")
def split_model(tmp_path_factory) -> Path:
    """The qwen3moe test model written as a split GGUF of 8 tensors per file (4 files; the experts
    of the two layers sit in different files)."""
    out = tmp_path_factory.mktemp("split") / "split.gguf"
    return models.writer.write_model(models.ModelSpec(arch="qwen3moe", **SHAPE), out, split_max_tensors=8)


@pytest.mark.parametrize("ub", [1, 32])
def test_a_split_gguf_is_streamed_in_place(split_model, tmp_path, ub):
    """Each expert is read from the file that holds it, at its offset there (the loader's file index
    per tensor), not from the first file: the logits equal the all-resident run of the same split
    model and of the one-file model."""
    from gguf import GGUFReader
    files = sorted(split_model.parent.glob("split-*-of-*.gguf"))
    assert len(files) == 4
    holders = {f.name for f in files for t in GGUFReader(f).tensors if "_exps" in t.name}
    assert len(holders) >= 2, holders  # the experts really are spread over files
    one_file = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    base = run(one_file, tmp_path, ub, [], f"one-file-{ub}")
    split_base = run(split_model, tmp_path, ub, [], f"split-base-{ub}")
    assert split_base.logits == base.logits
    # the sizing reads every shard (it once read the first file only: 'has no expert tensors')
    assert sim.gguf_expert_bytes(split_model) == sim.gguf_expert_bytes(one_file)
    for mib in budgets(split_model, ub).values():
        r = run(split_model, tmp_path, ub, ["--moe-stream-cache-mb", str(mib)], f"split-{ub}-{mib}")
        assert r.logits == base.logits, f"split GGUF, budget {mib} MiB at ubatch {ub}: logits differ"
        assert all(h + m > 0 for h, m in r.stream_layers.values()) and len(r.stream_layers) == SHAPE["n_layer"]


def test_a_file_unreadable_after_load_turns_the_tier_off_loudly_naming_it(tmp_path):
    """The tier opens the GGUF again for its own reads. A file that is gone or unreadable by then (here
    renamed between the load and the tier's start, through the C API as the bindings call it) fails
    the start with an error naming the file, and the Python API raises instead of running without
    the tier."""
    import subprocess
    import sys
    import shutil
    from pybmoe.engine import bindings
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    copy = tmp_path / "gone.gguf"
    shutil.copy(model, copy)
    script = (
        "import ctypes, os, sys\n"
        "import llama_cpp\n"
        "from pybmoe.engine import bindings\n"
        "lib = bindings._llama_lib()\n"
        "p = sys.argv[1]\n"
        "llama_cpp.llama_backend_init()\n"
        "mp = llama_cpp.llama_model_default_params(); mp.n_gpu_layers = 0\n"
        "m = llama_cpp.llama_model_load_from_file(p.encode(), mp)\n"
        "assert m\n"
        "os.rename(p, p + '.moved')\n"
        "mo = lib.llama_moe_default_params(); mo.stream_mib = 4; mo.stream_floor_mib = 1536; mo.n_ubatch = 1\n"
        "mo.strict = True\n"
        "rc = lib.llama_model_moe_apply(m, ctypes.byref(mo), None)\n"
        "print('rc', rc, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", script, str(copy)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"rc {bindings.LLAMA_MOE_APPLY_ERR_STREAM_OFF}" in r.stdout, r.stdout
    assert f"moe-stream: cannot open {copy}" in r.stderr and "No such file or directory" in r.stderr
    assert "the stream tier is OFF" in r.stderr
