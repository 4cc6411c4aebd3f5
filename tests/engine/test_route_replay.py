"""--moe-route-replay: MoE layers take their experts from a routing trace; it changes routing and
nothing else."""
from __future__ import annotations

import subprocess

import pytest

from pybmoe import engine, models

pd = pytest.importorskip("pandas")


def _run(model, rpc, tmp_path, extra, prompt="Hello there", n_predict=24, name="l.bin"):
    run = engine.run_logits(model, tmp_path / name, [*engine.host_experts_args(rpc.endpoint), *extra],
                            prompt=prompt, n_predict=n_predict)
    return run.log, run.logits


def _lines(log, *prefixes):
    return [l for l in log.splitlines() if l.startswith(prefixes)]


def _routing(path) -> dict[tuple[int, int], tuple[int, ...]]:
    df = pd.read_csv(path, comment="#")
    return {k: tuple(g.sort_values("rank").expert) for k, g in df.groupby(["token", "layer"])}


@pytest.mark.parametrize("slots", [0, 6])
def test_replaying_the_models_own_trace_reproduces_it(model_q8, rpc, tmp_path, slots):
    """Greedy tokens, raw logits and the cache's per-layer hit/miss counts are all the same."""
    cache = engine.cache_args(slots, sync=True)  # the counts are compared: deterministic visibility
    trace = tmp_path / "own.csv"
    log_a, logits_a = _run(model_q8, rpc, tmp_path, [*cache, "--moe-trace", str(trace)])
    log_b, logits_b = _run(model_q8, rpc, tmp_path, [*cache, "--moe-route-replay", str(trace)])
    assert "moe-route-replay: 4 MoE layers take their experts from" in log_b
    assert logits_a == logits_b
    assert _lines(log_a, "token ") == _lines(log_b, "token ")
    # the summary comes from the log thread and the per-layer lines from stdout: compare them as sets
    # of lines, since the two streams interleave in no fixed order
    stats_a = sorted(_lines(log_a, "moe-cache-layer"))
    assert stats_a == sorted(_lines(log_b, "moe-cache-layer"))
    assert len(stats_a) == (4 if slots else 0)
    sums = [[s.without_timings() for s in engine.parse_cache_summaries(log)] for log in (log_a, log_b)]
    assert sums[0] == sums[1] and len(sums[0]) == (1 if slots else 0)
    if slots:
        assert engine.parse_cache_summaries(log_b)[-1].hit_pct > 0


def test_a_foreign_trace_changes_the_routing_to_exactly_it(model_q8, rpc, tmp_path):
    """Replay a trace of another prompt: every row the engine computes routes to the replayed
    experts (layers that compute only the output row take the trace's row of that token, or the
    previous one the trace has); the cache stays exact under replay."""
    foreign = tmp_path / "foreign.csv"
    _run(model_q8, rpc, tmp_path, ["--moe-trace", str(foreign)], prompt="Something else entirely, and longer")
    seen = tmp_path / "seen.csv"
    log_off, logits_off = _run(model_q8, rpc, tmp_path, ["--moe-route-replay", str(foreign), "--moe-trace", str(seen)])
    src, got = _routing(foreign), _routing(seen)
    n_src = 1 + max(t for t, _ in src)
    k = models.read_spec(model_q8).n_expert_used

    def expected(t, layer):
        s = t % n_src
        while s >= 0 and (s, layer) not in src:
            s -= 1
        return src[(s, layer)] if s >= 0 else tuple(range(k))

    assert len(got) > 4 * 20
    assert all(got[key] == expected(*key) for key in got)
    # the router's own routing differs, so replay did change something
    _, logits_plain = _run(model_q8, rpc, tmp_path, [])
    assert logits_plain != logits_off
    # and the cache's split stays exact under replayed routing
    _, logits_on = _run(model_q8, rpc, tmp_path, ["--moe-route-replay", str(foreign), *engine.cache_args(4)])
    assert logits_on == logits_off


def test_a_short_trace_wraps_with_one_warning(model_q8, rpc, tmp_path):
    full = tmp_path / "full.csv"
    _run(model_q8, rpc, tmp_path, ["--moe-trace", str(full)])
    df = pd.read_csv(full, comment="#")
    short = tmp_path / "short.csv"
    short.write_text("# pybmoe-trace v1\n" + df[df.token < 10].to_csv(index=False))
    log, _ = _run(model_q8, rpc, tmp_path, ["--moe-route-replay", str(short)], n_predict=16)
    warns = [l for l in log.splitlines() if "ran out after 10 tokens; wrapping" in l]
    assert len(warns) == 1 and "(pass 2)" in warns[0], warns
    assert len(_lines(log, "token ")) == 16


@pytest.mark.parametrize("rows, why", [
    ("engine,decode,0,0,0,7,1,-1\n", "rank 7, but the model's top-k is 4"),
    ("engine,decode,0,0,0,0,16,-1\n", "expert 16, but the model has 16 experts"),
    ("engine,decode,0,0,9,0,1,-1\n", "layer 9 is not a MoE layer"),
    ("engine,decode,0,0,0,0,1,-1\n", "MoE layer 1 has no rows; the trace is of another shape"),
    ("not,a,trace\n", "line 2 is not a trace row"),
    ("", "no trace rows"),
])
def test_a_trace_of_another_shape_is_refused(model_q8, rpc, tmp_path, rows, why):
    bad = tmp_path / "bad.csv"
    bad.write_text("workload,phase,ubatch,token,layer,rank,expert,hit\n" + rows)
    cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(tmp_path / "l.bin"), "-m", str(model_q8),
           "-p", "hi", "-n", "2", "-t", "2", "--fit", "off", *engine.host_experts_args(rpc.endpoint),
           "--moe-route-replay", str(bad)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert why in r.stderr and "cannot replay the routing trace" in r.stderr, r.stderr[-1500:]


def test_llama_bench_replays_too(model_q8, rpc, tmp_path):
    trace = tmp_path / "t.csv"
    _run(model_q8, rpc, tmp_path, ["--moe-trace", str(trace)])
    cmd = [str(engine.find_binary("llama-bench")), "-m", str(model_q8), "-p", "0", "-n", "8", "-r", "1", "-t", "2",
           "--rpc", rpc.endpoint, "-ngl", "99", "-ncmoe", "99", "--repack", "0", "-o", "csv", "-v",
           "--moe-expert-cache", "4", "--moe-route-replay", str(trace)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "moe-route-replay: 4 MoE layers take their experts from" in r.stderr
    assert engine.parse_cache_summaries(r.stdout + r.stderr)
    r = subprocess.run([*cmd[:-1], str(tmp_path / "missing.csv")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "cannot replay the routing trace" in r.stderr


def test_llama_bench_names_why_a_trace_is_refused(model_q8, tmp_path):
    """llama-bench silences the engine's log unless -v, so a refused trace printed only `cannot replay
    the routing trace FILE`; it now names the line and the reason, as llama-server does."""
    bad = tmp_path / "garbage.csv"
    bad.write_text("workload,phase,ubatch,token,layer,rank,expert,hit\nnot,a,trace\n")
    cmd = [str(engine.find_binary("llama-bench")), "-m", str(model_q8), "-p", "0", "-n", "1", "-r", "1", "-t", "2",
           "--moe-route-replay", str(bad)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-2].startswith(f"llama_model_moe_route_replay_open: moe-route-replay: {bad}: line 2 is not a trace row ("), \
        lines[-3:]
    # the apply entry's line, which names the flag's file, comes last (both are ERROR lines, which pass its log)
    assert lines[-1] == f"llama_model_moe_apply: cannot replay the routing trace {bad} (see above)", lines[-3:]
    # a file that is not there says so (it said only "cannot read FILE")
    r = subprocess.run([*cmd[:-1], str(tmp_path / "missing.csv")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f"moe-route-replay: cannot read {tmp_path / 'missing.csv'}: No such file or directory" \
        in r.stderr, r.stderr[-2000:]
