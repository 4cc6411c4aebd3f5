"""The expert cache sized in MiB per device (issue 42): ``--moe-expert-cache-mb N``, upstream's spelling
``--moe-cache-mib N`` and their env twins are one option and give the same residency (the pool the MiB
hold: the bytes of the most slots per layer that fit, as one bank; tests/engine/test_cache_pool.py holds
the pool itself); a budget the device cannot hold, or one under a slot per layer, is refused in one line
naming the range that fits; a count that is not one is refused naming the range; the bindings speak the
same unit.

The loopback RPC server is the device (its free memory is its host's); sync mode makes the hits and
misses a function of the routing, so two runs that hold the same slots count the same."""
from __future__ import annotations

import math
import os
import re
import subprocess

import pytest

from pybmoe import engine, models

MIB_LINE = re.compile(r"moe-cache: (\d+) MiB on (\S+) -> (\d+) slots/layer for (\d+) layers \(([\d.]+) MiB per slot")
POOL_LINE = re.compile(r"in (\S+): one pool of (\d+) slots over \(layer, expert\)")


def _logits(model, rpc, tmp_path, extra, env=None, name="l.bin"):
    out = tmp_path / name
    cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(out), "-m", str(model),
           "-p", "Hello there", "-n", "12", "-t", "2", "-c", "256", "--fit", "off",
           "--rpc", rpc.endpoint, "-ngl", "99", "--cpu-moe", "--no-repack", "--moe-expert-cache-sync", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {})))
    return r, r.stdout + r.stderr, out


def _residency(log: str) -> tuple:
    """The slots and staging the cache held and what its lookups did (the preamble and summary lines)."""
    rec = engine.cache_record(log)
    assert rec["hit_pct"] is not None, log[-2000:]
    return rec["slots"], rec["staging"], rec["hit_pct"], rec["uploads"], rec["resident_mib"]


def _budget_for_3_slots(model, rpc, tmp_path) -> tuple[int, float]:
    """The MiB that hold 3 slots per layer with their staging and zero slot (rounded up), and one slot's
    MiB over every layer, read from a fixed run's preamble."""
    spec = models.read_spec(model)
    r, log, _ = _logits(model, rpc, tmp_path, ["--moe-expert-cache", "3"], name="probe.bin")
    assert r.returncode == 0, log[-2000:]
    per_slot = spec.n_layer * engine.cache_record(log)["slot_mib"]
    return math.ceil((3 + min(spec.n_expert_used, spec.n_expert - 3) + 1) * per_slot), per_slot


def test_the_mib_flag_upstreams_spelling_and_their_env_twins_give_the_same_residency(model_q8, rpc, tmp_path):
    spec = models.read_spec(model_q8)
    mib, per_slot = _budget_for_3_slots(model_q8, rpc, tmp_path)
    runs = {
        "--moe-expert-cache-mb": _logits(model_q8, rpc, tmp_path, ["--moe-expert-cache-mb", str(mib)], name="a.bin"),
        "--moe-cache-mib": _logits(model_q8, rpc, tmp_path, ["--moe-cache-mib", str(mib)], name="b.bin"),
        "LLAMA_ARG_MOE_CACHE_MIB": _logits(model_q8, rpc, tmp_path, [], env={"LLAMA_ARG_MOE_CACHE_MIB": str(mib)},
                                           name="c.bin"),
        "LLAMA_ARG_MOE_EXPERT_CACHE_MB": _logits(model_q8, rpc, tmp_path, [],
                                                 env={"LLAMA_ARG_MOE_EXPERT_CACHE_MB": str(mib)}, name="d.bin"),
    }
    slots = set()
    for how, (r, log, _) in runs.items():
        assert r.returncode == 0, (how, log[-2000:])
        m = MIB_LINE.search(log)
        assert m, (how, log[-2000:])
        assert int(m.group(1)) == mib and int(m.group(4)) == spec.n_layer, (how, m.group(0))
        slots.add(int(m.group(3)))
    assert len(slots) == 1, slots
    s = slots.pop()
    # the most slots that fit: s's slots, staging and zero slot fit the MiB, one more would not
    fits = lambda c: (c + min(spec.n_expert_used, spec.n_expert - c) + 1) * per_slot  # noqa: E731
    assert 3 <= s < spec.n_expert and fits(s) <= mib + 0.01 and fits(s + 1) > mib - 0.01, (s, mib, per_slot)
    # one pool in those bytes: its slots, staging (top-k per layer) and one zero slot
    pools = {int(POOL_LINE.search(log).group(2)) for _, log, _ in runs.values()}
    assert len(pools) == 1, pools
    P = pools.pop()
    n, k = spec.n_layer, min(spec.n_expert_used, spec.n_expert)
    room = n * (s + min(spec.n_expert_used, spec.n_expert - s) + 1)
    phys = lambda c: c + min(n * k, n * spec.n_expert - c) + 1  # noqa: E731  (slots, staging, zero)
    assert phys(P) <= room and (P == n * spec.n_expert or phys(P + 1) > room), (P, room)
    # the same residency for every spelling, and the logits of the cache off
    r, log, out = _logits(model_q8, rpc, tmp_path, [], name="off.bin")
    assert r.returncode == 0, log[-2000:]
    first = _residency(runs["--moe-expert-cache-mb"][1])
    for how, (_, log2, out2) in runs.items():
        assert _residency(log2) == first, (how, _residency(log2), first)
        assert out2.read_bytes() == out.read_bytes(), how


@pytest.mark.parametrize("flag", ["--moe-expert-cache-mb", "--moe-cache-mib"])
@pytest.mark.parametrize("value", ["-1", "x", "2147483648", "1.5"])
def test_a_value_that_is_not_a_count_is_refused_naming_the_range(model_q8, rpc, tmp_path, flag, value):
    r, log, _ = _logits(model_q8, rpc, tmp_path, [flag, value])
    assert r.returncode != 0
    assert f"{flag} expects an integer in 0 .. 2147483647 (0 = off), got '{value}'" in log, log[-1500:]


def test_a_budget_under_one_slot_per_layer_is_refused_with_the_range_that_fits(model_q8, rpc, tmp_path):
    r, log, _ = _logits(model_q8, rpc, tmp_path, ["--moe-expert-cache-mb", "1"])
    assert r.returncode != 0, log[-2000:]
    line = next(ln for ln in log.splitlines() if "--moe-expert-cache-mb 1 on" in ln)
    m = re.search(r"one slot per layer needs ([\d.]+) MiB .*; give (\d+) \.\. (\d+) MiB, or auto$", line)
    assert m, line
    assert float(m.group(1)) > 1 and int(m.group(2)) == math.ceil(float(m.group(1))) and int(m.group(3)) > int(m.group(2))
    assert "--moe-expert-cache-mb 1 does not fit device memory" in log
    assert not re.search(r"^token ", r.stdout, re.M)  # nothing was generated


def test_a_budget_over_the_free_memory_is_refused_with_the_range_that_fits(model_q8, rpc, tmp_path):
    r, log, _ = _logits(model_q8, rpc, tmp_path, ["--moe-expert-cache-mb", "2000000000"])
    assert r.returncode != 0, log[-2000:]
    line = next(ln for ln in log.splitlines() if "--moe-expert-cache-mb 2000000000 on" in ln)
    assert re.search(r"it has \d+ MiB free( \(\d+ MiB set aside for contexts\))? and --moe-expert-cache-floor-mb keeps 1024 "
                     r"MiB free; give \d+ \.\. \d+ MiB, "
                     r"or auto$", line), line


def test_slots_and_mib_together_are_refused_in_one_line(model_q8, rpc, tmp_path):
    r, log, _ = _logits(model_q8, rpc, tmp_path, ["--moe-expert-cache", "4", "--moe-cache-mib", "100"])
    assert r.returncode != 0
    assert ("--moe-expert-cache 4 and --moe-expert-cache-mb 100 (--moe-cache-mib) are mutually exclusive: give one"
            in log), log[-1500:]


def test_the_flags_are_documented():
    for binary in ("llama-server", "llama-cli"):
        r = subprocess.run([str(engine.find_binary(binary)), "--help"], capture_output=True, text=True, timeout=60)
        out = r.stdout + r.stderr
        assert "--moe-expert-cache-mb" in out and "--moe-cache-mib" in out and "LLAMA_ARG_MOE_CACHE_MIB" in out, binary


def test_the_bindings_take_mib_too(model_q8, rpc, tmp_path):
    from pybmoe.engine import bindings
    mib, _ = _budget_for_3_slots(model_q8, rpc, tmp_path)
    r, log, _ = _logits(model_q8, rpc, tmp_path, ["--moe-cache-mib", str(mib)])
    assert r.returncode == 0, log[-2000:]
    P = int(POOL_LINE.search(log).group(2))
    kw = dict(rpc_servers=rpc.endpoint, n_gpu_layers=99, cpu_moe=True, repack=False, verbose=False, n_ctx=256)
    llm = bindings.Llama(model_q8, moe_expert_cache_mb=mib, **kw)
    try:
        assert llm._moe_plan.slots_allocated == P // models.read_spec(model_q8).n_layer  # the pool's share per layer
        assert llm.moe_cache_stats().devices[0].slots == P
    finally:
        llm.close()
    with pytest.raises(ValueError, match="mutually exclusive: give one"):
        bindings.Llama(model_q8, moe_expert_cache=4, moe_expert_cache_mb=mib, **kw)
    with pytest.raises(ValueError, match=r"moe_expert_cache_mb=1 does not fit .* \(or is under one slot per layer\)"):
        bindings.Llama(model_q8, moe_expert_cache_mb=1, **kw)


def test_llama_server_takes_upstreams_spelling(model_q8, rpc, tmp_path):
    """`llama-server --moe-cache-mib N` holds the pool --moe-expert-cache-mb N resolves to (the same
    lines, the same slots on /metrics) and /props gives the MiB as asked."""
    import json

    from pybmoe.engine import demo
    spec = models.read_spec(model_q8)
    mib, _ = _budget_for_3_slots(model_q8, rpc, tmp_path)
    r, log, _ = _logits(model_q8, rpc, tmp_path, ["--moe-expert-cache-mb", str(mib)])
    assert r.returncode == 0, log[-2000:]
    s = int(MIB_LINE.search(log).group(3))
    P = int(POOL_LINE.search(log).group(2))
    srv = engine.LlamaServer(demo.server_args(model_q8, rpc.endpoint, 0, 0, ["--moe-cache-mib", str(mib), "--metrics"]))
    with srv:
        srv.completion("Hello there", n_predict=4)
        text, props = srv.get("/metrics"), json.loads(srv.get("/props"))
    slog = srv.stop()
    m = MIB_LINE.search(slog)
    assert m and int(m.group(1)) == mib and int(m.group(3)) == s, slog[-2000:]
    assert int(POOL_LINE.search(slog).group(2)) == P
    slots = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith('llamacpp:moe_cache_slots{device="RPC')]
    assert slots == [P] and P >= s * spec.n_layer
    assert props["moe_expert_cache"]["mib"] == mib and props["moe_expert_cache"]["slots"] == 0
