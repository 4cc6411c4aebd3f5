"""The VRAM tier's pool (issue 42): sized in MiB per device (``--moe-expert-cache-mb N``, upstream's
``--moe-cache-mib N``, or ``auto`` from free memory), the layers of one device and expert shape share one bank of slots, and one LRU
over their (layer, expert) entries with a per-layer floor decides what it holds (docs/expert-cache.md,
"The pool").

Held here, on the loopback RPC device:
- the engine equals the simulator's replay of its own trace (policy ``pool``, sync mode), lookup for
  lookup, on one device and on two (one bank each, replayed on its own), at one-token and multi-token
  steps;
- cache-on logits are bit-identical to cache-off at ubatch 1..32, under and over the cache cycle, and
  greedy MTP speculation through the pool gives the text of no speculation;
- each device's pool is in ``moe_cache_stats().devices`` and on ``/metrics``.
"""
from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.routing import sim
from pybmoe.routing import trace as tr

PROMPT = ("The expert cache keeps the experts that were used most recently on the device, and the "
          "host computes the rest; a verify batch checks several drafted tokens at once.")
POOL_LINE = re.compile(r"moe-cache: .* MiB of expert slots for (\d+) layers in (\S+): one pool of (\d+) slots over "
                       r"\(layer, expert\) in (\d+) bank")


@pytest.fixture(scope="module")
def spec(model_q8):
    return models.read_spec(model_q8)


@pytest.fixture(scope="module")
def layer_slot_mib(model_q8, rpc, tmp_path_factory) -> float:
    """MiB of one slot in every layer (the preamble's slot_mib x layers)."""
    tmp = tmp_path_factory.mktemp("pool-probe")
    run = engine.run_logits(model_q8, tmp / "p.bin", [*engine.host_experts_args(rpc.endpoint), *engine.cache_args(1)],
                            prompt="Hello", n_predict=1, ctx=256)
    rec = engine.cache_record(run.log)
    return rec["slot_mib"] * rec["layers"]


def _mib_for(slots: int, spec, layer_slot_mib: float) -> int:
    """The MiB that hold `slots` per layer with their staging and zero slot (so the pool gets at least
    slots x layers)."""
    return math.ceil((slots + min(spec.n_expert_used, spec.n_expert - slots) + 1) * layer_slot_mib)


def _run(model: Path, endpoints: str, tmp: Path, extra: list[str], name: str, ub: int = 512, n_predict: int = 24):
    return engine.run_logits(model, tmp / f"{name}.bin",
                             ["-b", "512", "-ub", str(ub), "--rpc", endpoints, "-ngl", "99", "--cpu-moe",
                              "--no-repack", *extra],
                             prompt=PROMPT, n_predict=n_predict, ctx=512, timeout=600)


def _pool_lines(log: str) -> list[tuple[int, str, int, int]]:
    return [(int(n), dev, int(p), int(b)) for n, dev, p, b in POOL_LINE.findall(log)]


@pytest.fixture(scope="module")
def rpc2():
    with engine.RpcServer(threads=1) as a, engine.RpcServer(threads=1) as b:
        yield f"{a.endpoint},{b.endpoint}"


@pytest.mark.parametrize("slots_of", ["1", "half-k", "k", "half"])
def test_the_engines_pool_equals_the_replay_of_its_trace(model_q8, rpc, spec, layer_slot_mib, tmp_path, slots_of):
    """One device, one bank over every layer: the trace header names the bank (pool=P:layers) and the
    replay of policy "pool" predicts every lookup the engine recorded; the engine's counters agree."""
    k, n = spec.n_expert_used, spec.n_expert
    slots = {"1": 1, "half-k": k // 2, "k": k, "half": n // 2}[slots_of]
    mib = _mib_for(slots, spec, layer_slot_mib)
    path = tmp_path / "t.csv"
    run = _run(model_q8, rpc.endpoint, tmp_path, ["--moe-expert-cache-mb", str(mib), "--moe-expert-cache-sync",
                                                  "--moe-trace", str(path)], "on")
    (n_layers, _, P, banks), = _pool_lines(run.log)
    assert n_layers == spec.n_layer and banks == 1 and P >= slots * spec.n_layer
    t = tr.read_trace(path)
    (entries, ils), = sim.parse_pool(t.meta.extra["pool"])
    assert entries == P and ils == sorted(int(x) for x in t.layers)
    res = sim.engine_replay(t)
    assert res.policy == "pool" and res.budget_entries == P
    bad = sim.compare_with_engine(t, res)
    assert bad.empty, f"{len(bad)} lookups differ, first:\n{bad.head()}"
    f = t.frame
    decode = f[f["phase"] == "decode"]
    assert (decode["hit"] >= 0).all() and (decode["hit"] == 1).any() and (decode["hit"] == 0).any()
    for il, (hits, misses) in run.layers.items():
        d = decode[decode["layer"] == il]
        assert (int((d["hit"] == 1).sum()), int((d["hit"] == 0).sum())) == (hits, misses)


def test_the_pool_replays_exactly_on_multi_token_steps(model_q8, rpc, spec, layer_slot_mib, tmp_path):
    """Prompt chunks of 5 tokens served as one step each (max batch 8): all their lookups see the same
    residents, and the misses are scheduled in order while a slot is free."""
    path = tmp_path / "t.csv"
    mib = _mib_for(spec.n_expert_used, spec, layer_slot_mib)
    _run(model_q8, rpc.endpoint, tmp_path, ["--moe-expert-cache-mb", str(mib), "--moe-expert-cache-sync",
                                            "--moe-expert-cache-max-batch", "8", "--moe-trace", str(path)], "on", ub=5)
    t = tr.read_trace(path)
    served = t.frame[t.frame["hit"] >= 0]
    assert (served["phase"] == "prefill").any()
    bad = sim.compare_with_engine(t, sim.engine_replay(t))
    assert bad.empty, f"{len(bad)} lookups differ"


def test_two_devices_each_hold_a_pool_and_replay_exactly(model_q8, rpc2, spec, layer_slot_mib, tmp_path):
    """Layers split over two devices: each gets its own bank (a pool per device), the header names
    both, and each bank's replay predicts its layers' lookups; the logits equal the cache off."""
    mib = _mib_for(2, spec, layer_slot_mib)
    off = _run(model_q8, rpc2, tmp_path, ["--fit", "off"], "off")
    path = tmp_path / "t.csv"
    on = _run(model_q8, rpc2, tmp_path, ["--fit", "off", "--moe-expert-cache-mb", str(mib), "--moe-expert-cache-sync",
                                         "--moe-trace", str(path)], "on")
    lines = _pool_lines(on.log)
    assert len(lines) == 2 and len({dev for _, dev, _, _ in lines}) == 2, on.log[-3000:]
    assert sum(n for n, _, _, _ in lines) == spec.n_layer
    t = tr.read_trace(path)
    banks = sim.parse_pool(t.meta.extra["pool"])
    assert sorted(p for p, _ in banks) == sorted(p for _, _, p, _ in lines)
    assert sorted(il for _, ils in banks for il in ils) == sorted(int(x) for x in t.layers)
    bad = sim.compare_with_engine(t, sim.engine_replay(t))
    assert bad.empty, f"{len(bad)} lookups differ"
    assert on.logits == off.logits
    # the summary line ends with each device's pool: its slots, residents and hit rate
    pools = engine.parse_cache_summaries(on.log)[-1].pools
    assert sorted((dev, p) for dev, p, _, _ in pools) == sorted((dev, p) for _, dev, p, _ in lines)
    served = t.frame[t.frame["hit"] >= 0]
    # the header's banks, the pool lines and the summary's pools are all in the order the devices were allocated
    assert [(dev, p) for _, dev, p, _ in lines] == [(dev, p) for dev, p, _, _ in pools]
    for (_, dev_layers), (dev, p, resident, hit_pct) in zip(banks, pools):
        rows = served[served["layer"].isin(dev_layers)]
        assert 0 < resident <= p and hit_pct == pytest.approx(100 * (rows["hit"] == 1).mean(), abs=0.06)


@pytest.mark.parametrize("ub", [1, 2, 7, 8, 9, 16, 32])
def test_the_pool_is_bit_identical_at_every_small_ubatch(model_q8, rpc, spec, layer_slot_mib, tmp_path, ub):
    """ubatch 1..32, every prompt chunk served (max batch 32), pools from one slot per layer (under the
    cycle) to every expert: the logits equal the cache off."""
    k, n = spec.n_expert_used, spec.n_expert
    base = _run(model_q8, rpc.endpoint, tmp_path, [], "off", ub=ub, n_predict=12)
    for slots in (1, k, n // 2, n):
        on = _run(model_q8, rpc.endpoint, tmp_path, ["--moe-expert-cache-mb", str(_mib_for(slots, spec, layer_slot_mib)),
                                                     "--moe-expert-cache-sync", "--moe-expert-cache-max-batch", "32"],
                  f"on-{slots}", ub=ub, n_predict=12)
        assert _pool_lines(on.log), on.log[-2000:]
        assert on.logits == base.logits, f"ub={ub} slots={slots}: cache-on logits differ"
        rec = engine.cache_record(on.log)
        assert rec["steps"] - 11 >= 1  # prompt ubatches were served too
        if slots >= k:
            assert sum(h for h, _ in on.layers.values()) > 0


@pytest.mark.skipif("qwen35moe" not in models.ARCHES, reason="needs the qwen35moe generator")
def test_draft_mtp_speculation_through_the_pool(rpc):
    """draft-mtp with the pool: the MTP block is one more layer of the same bank (5 MiB: 11 slots over 4
    layers, under their token cycle of 12, so the floor acts); the greedy text equals no speculation
    and no cache."""
    from pybmoe.engine import demo
    model = models.cached_model_path(models.ModelSpec(arch="qwen35moe", n_layer=4, n_expert=8, n_expert_used=3))
    prompt = "one two three one two three one two three"
    n = 16
    base = ["-fa", "off", "--temp", "0"]
    plain = demo.run_once(model, rpc.endpoint, 0, 0, prompt, n, base)
    mtp = demo.run_once(model, rpc.endpoint, 0, 0, prompt, n,
                        [*base, "--moe-expert-cache-mb", "5", "--moe-expert-cache-sync",
                         "--spec-type", "draft-mtp", "--spec-draft-n-max", "3"])
    assert plain.tokens_predicted == n
    assert mtp.text == plain.text
    lines = _pool_lines(mtp.log)
    assert lines and lines[0][0] == 4, mtp.log[-3000:]  # 3 trunk MoE blocks + the MTP block, one bank
    assert "the MTP draft context shares the target model's expert cache" in mtp.log
    rec = engine.cache_record(mtp.log)
    assert rec["max_batch"] >= 4 and rec["steps"] > 0 and rec["hit_pct"] > 0


def test_each_devices_pool_is_in_the_stats_and_on_metrics(model_q8, rpc, spec, layer_slot_mib, tmp_path):
    """moe_cache_stats().devices and /metrics give each device's pool: its slots, banks, residents, hits
    and misses, which sum to the cache's totals."""
    from pybmoe.engine import bindings, demo
    mib = _mib_for(spec.n_expert_used, spec, layer_slot_mib)
    kw = dict(rpc_servers=rpc.endpoint, n_gpu_layers=99, cpu_moe=True, repack=False, verbose=False, n_ctx=256)
    llm = bindings.Llama(model_q8, moe_expert_cache_mb=mib, **kw)
    try:
        llm("Hello there, experts", max_tokens=8)
        st = llm.moe_cache_stats()
    finally:
        llm.close()
    (d,) = st.devices
    assert d.name.startswith("RPC") and d.banks == 1 and d.n_layers == spec.n_layer
    assert d.slots == d.slots_now >= spec.n_expert_used * spec.n_layer and 0 < d.resident <= d.slots
    assert (d.hits, d.misses) == (st.hits, st.misses) and d.hits > 0
    assert d.allocated_mib == pytest.approx(st.allocated_mib, rel=0.5)

    # a resize between generations: the bank holds n_slots x layers, evicting its least recently used
    llm = bindings.Llama(model_q8, moe_expert_cache_mb=mib, **kw)
    try:
        llm("Hello there, experts", max_tokens=8)
        assert llm.set_moe_cache_slots(1) == 1
        (small,) = llm.moe_cache_stats().devices
        assert small.slots_now == spec.n_layer and small.resident <= spec.n_layer
        llm("Hello there, experts", max_tokens=8)
        (after,) = llm.moe_cache_stats().devices
        assert 0 < after.resident <= spec.n_layer and after.slots == d.slots
    finally:
        llm.close()

    srv = engine.LlamaServer(demo.server_args(model_q8, rpc.endpoint, 0, 0, ["--moe-cache-mib", str(mib), "--metrics"]))
    with srv:
        srv.completion("Hello there", n_predict=4)
        m = engine.parse_cache_metrics(srv.get("/metrics"))
    srv.stop()
    (dev,) = m["device_banks"]
    assert m["device_banks"][dev] == 1 and m["slots"][dev] == d.slots
    assert m["device_hits"][dev] == m["hits"] and m["device_misses"][dev] == m["misses"] > 0
    assert 0 < m["device_resident"][dev] <= d.slots


def test_auto_is_a_pool_too(model_q8, rpc, spec, tmp_path):
    """--moe-expert-cache auto sizes each device from its free memory (here capped by the ceiling), and
    those bytes are one pool, replayed exactly."""
    path = tmp_path / "t.csv"
    run = _run(model_q8, rpc.endpoint, tmp_path, ["--moe-expert-cache", "auto", "--moe-expert-cache-floor-mb", "0",
                                                  "--moe-expert-cache-ceil-mb", "6", "--moe-expert-cache-sync",
                                                  "--moe-trace", str(path)], "on")
    auto = re.search(r"auto on \S+: .* -> (\d+) slots/layer for (\d+) layers", run.log)
    (n_layers, _, P, _), = _pool_lines(run.log)
    s, n = int(auto.group(1)), int(auto.group(2))
    assert n == n_layers == spec.n_layer and P >= s * n
    t = tr.read_trace(path)
    assert sim.parse_pool(t.meta.extra["pool"])[0][0] == P
    bad = sim.compare_with_engine(t, sim.engine_replay(t))
    assert bad.empty, f"{len(bad)} lookups differ"


def test_slots_per_layer_stay_each_layers_own(model_q8, rpc, tmp_path):
    """--moe-expert-cache N keeps per-layer slots: no pool line, no pool= in the trace, banks 0."""
    path = tmp_path / "t.csv"
    run = _run(model_q8, rpc.endpoint, tmp_path, [*engine.cache_args(4, sync=True), "--moe-trace", str(path)], "on",
               n_predict=4)
    assert not _pool_lines(run.log) and "pool=" not in run.log
    assert "pool" not in tr.read_trace(path).meta.extra


def test_a_pool_trace_with_an_insert_cap_is_not_replayed(model_q8, rpc, spec, layer_slot_mib, tmp_path):
    """The simulator's pool has no insert cap: replaying a pool trace taken with one is refused, not
    answered wrongly."""
    path = tmp_path / "t.csv"
    _run(model_q8, rpc.endpoint, tmp_path, ["--moe-expert-cache-mb", str(_mib_for(4, spec, layer_slot_mib)),
                                            "--moe-expert-cache-inserts", "1", "--moe-expert-cache-sync",
                                            "--moe-trace", str(path)], "on", n_predict=4)
    with pytest.raises(sim.PolicyError, match="without an insert cap"):
        sim.engine_replay(tr.read_trace(path))


def test_a_malformed_pool_header_is_refused():
    for bad in ("", "x:1", "12:", "12:1,a", "-1:0"):
        with pytest.raises(ValueError, match="expected P:il"):
            sim.parse_pool(bad)
    assert sim.parse_pool("12:0,1/8:2,3") == [(12, [0, 1]), (8, [2, 3])]


def test_a_bank_of_more_than_1024_slots_is_exact(rpc, tmp_path):
    """12 layers x 256 experts, top-8, tiny widths: a pool of half the experts is one bank of about
    1700 slots, one MUL_MAT_ID over more experts than any model layer has (upstream's limit is 512
    per layer; Vulkan's count shader hoists row ids only up to 1024). On the RPC device the logits
    equal the cache off and the replay is exact."""
    m = models.cached_model_path(models.ModelSpec(arch="qwen3moe", n_layer=12, n_expert=256, n_expert_used=8, n_embd=64,
                                                  n_ff_exp=32, head_dim=16, n_head=4, n_head_kv=2))
    base = ["-b", "512", "-ub", "8", "--rpc", rpc.endpoint, "-ngl", "99", "--cpu-moe", "--no-repack"]
    off = engine.run_logits(m, tmp_path / "off.bin", base, prompt=PROMPT, n_predict=16, ctx=512)
    probe = engine.run_logits(m, tmp_path / "p.bin", [*base, *engine.cache_args(1)], prompt="Hi", n_predict=1, ctx=256)
    rec = engine.cache_record(probe.log)
    mib = math.ceil((128 + 8 + 1) * rec["slot_mib"] * rec["layers"])
    path = tmp_path / "t.csv"
    on = engine.run_logits(m, tmp_path / "on.bin", [*base, "--moe-expert-cache-mb", str(mib), "--moe-expert-cache-sync",
                                                    "--moe-expert-cache-max-batch", "8", "--moe-trace", str(path)],
                           prompt=PROMPT, n_predict=16, ctx=512)
    (_, _, P, banks), = _pool_lines(on.log)
    assert banks == 1 and P > 1024
    assert on.logits == off.logits
    t = tr.read_trace(path)
    assert sim.compare_with_engine(t, sim.engine_replay(t)).empty
