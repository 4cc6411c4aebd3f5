"""Sizing that cannot silently fail: fixed slots that do not fit, --fit accounting, auto's context
reserve, layers that cannot be cached, and slots on more than one device.

Free device memory comes from the backend's own query (the loopback RPC server reports its host's
memory); the tests force each branch with the floor and the ceiling."""
from __future__ import annotations

import math
import re
import subprocess

import pytest

from pybmoe import engine, models


def _logits(model, endpoints: str, tmp_path, extra, n_predict=12, name="l.bin"):
    out = tmp_path / name
    cmd = [str(engine.find_binary("pybmoe-logits")), "--logits-out", str(out), "-m", str(model),
           "-p", "Hello there", "-n", str(n_predict), "-t", "2",
           "--rpc", endpoints, "-ngl", "99", "--cpu-moe", "--no-repack", *extra]
    if "-c" not in extra:
        cmd += ["-c", "256"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return r, r.stdout + r.stderr, out


def test_fixed_slots_on_a_device_too_small_fail_the_load(model_q8, rpc, tmp_path):
    r, log, _ = _logits(model_q8, rpc.endpoint, tmp_path,
                        ["--fit", "off", "--moe-expert-cache", "4", "--moe-expert-cache-floor-mb", "99999999"])
    assert r.returncode != 0, log[-2000:]
    assert "the device is too small for even one slot per layer" in log
    assert "--moe-expert-cache 4 does not fit device memory" in log
    # the message states the arithmetic: layers x (slots + staging + zero) x expert MiB
    spec = models.read_spec(model_q8)
    assert f"{spec.n_layer} layers x (4 slots + {spec.n_expert_used} staging + 1 zero)" in log
    assert not re.search(r"^token ", r.stdout, re.M)  # nothing was generated


def _fit_log(model, rpc, tmp_path, slots):
    r, log, _ = _logits(model, rpc.endpoint, tmp_path, ["--fit", "on", "-v", *engine.cache_args(slots)])
    assert r.returncode == 0, log[-2000:]
    m = re.search(r"projected to use (\d+) MiB of device memory", log)
    assert m, log[-3000:]
    return log, int(m.group(1))


def test_fit_counts_fixed_slots(model_q8, rpc, tmp_path):
    log8, used8 = _fit_log(model_q8, rpc, tmp_path, 8)
    _, used0 = _fit_log(model_q8, rpc, tmp_path, 0)
    counted = float(re.search(r"--fit counts ([\d.]+) MiB of expert slots", log8).group(1))
    allocated = float(re.search(r"moe-cache:\s+([\d.]+) MiB of expert slots for", log8).group(1))
    # the probe counts exactly the slot tensors the real load then allocates (tables aside)
    assert counted == pytest.approx(allocated, abs=0.02)
    spec = models.read_spec(model_q8)
    slot_mib = engine.cache_record(log8)["slot_mib"]
    assert counted == pytest.approx(spec.n_layer * (8 + spec.n_expert_used + 1) * slot_mib, abs=0.02)
    # and the fitter's projection grows by that much (it prints whole MiB)
    assert abs((used8 - used0) - counted) <= 1.0, (used8, used0, counted)


def test_fit_with_auto_gives_the_cache_what_is_left(model_q8, rpc, tmp_path):
    """--fit on with auto: the probes count no slots (the fitter's projection equals the cache
    off), and the real load then sizes the cache from what is left, minus the floor."""
    _, used0 = _fit_log(model_q8, rpc, tmp_path, 0)
    r, log, _ = _logits(model_q8, rpc.endpoint, tmp_path,
                        ["--fit", "on", "-v", "--moe-expert-cache", "auto", "--moe-expert-cache-ceil-mb", "8"])
    assert r.returncode == 0, log[-2000:]
    used_auto = int(re.search(r"projected to use (\d+) MiB of device memory", log).group(1))
    assert used_auto == used0
    assert "--fit counts" not in log
    (line,) = re.findall(r"auto on \S+: ([\d.]+) MiB free - ([\d.]+) MiB reserved for contexts - 1024 MiB floor, "
                         r"ceil 8 MiB -> (\d+) slots/layer", log)
    assert float(line[0]) - float(line[1]) - 1024 > 8  # the ceiling binds, not the free memory
    rec = engine.cache_record(log)
    assert rec["slots"] == int(line[2]) > 0
    assert 0 < rec["budget_mib"] <= 8


def _reserve(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"MiB free - ([\d.]+) MiB reserved for contexts", log)]


def test_auto_sets_aside_the_contexts_memory(model_q8, rpc, tmp_path):
    """auto sizes from free - (projected KV cache + compute buffers) - floor; a longer context
    reserves more."""
    auto = ["--fit", "off", "--moe-expert-cache", "auto", "--moe-expert-cache-ceil-mb", "8"]
    r, small, _ = _logits(model_q8, rpc.endpoint, tmp_path, [*auto, "-c", "256"])
    assert r.returncode == 0, small[-2000:]
    r, large, _ = _logits(model_q8, rpc.endpoint, tmp_path, [*auto, "-c", "4096"])
    assert r.returncode == 0, large[-2000:]
    (rs,), (rl,) = _reserve(small), _reserve(large)
    assert rs > 0 and rl > rs, (rs, rl)
    # the KV cache alone grows by n_layer x 2 (K, V) x n_embd_kv x 2 bytes (f16) per token
    d = models.ModelSpec()  # the default model's shape
    kv_per_token_mib = d.n_layer * 2 * d.n_head_kv * d.head_dim * 2 / 2**20
    assert rl - rs >= kv_per_token_mib * (4096 - 256) * 0.9, (rs, rl)


def test_router_in_host_memory_warns_why(model_q8, rpc, tmp_path):
    """A router placed in a host buffer (by -ot here; a type the device lacks does the same)
    leaves no device for the slots: one WARN naming the layers and the buffer type, then OFF."""
    r, log, _ = _logits(model_q8, rpc.endpoint, tmp_path,
                        ["--fit", "off", "-ot", "ffn_gate_inp=CPU", "--moe-expert-cache", "8"])
    assert r.returncode == 0, log[-2000:]
    spec = models.read_spec(model_q8)
    lines = [l for l in log.splitlines() if "not cached" in l]
    assert len(lines) == 1, lines
    assert f"{spec.n_layer} layer(s) not cached (0,1,2,3)" in lines[0]
    assert "is in host buffer type CPU" in lines[0] and " W " in lines[0]
    assert "the expert cache is OFF" in log
    assert engine.parse_cache_summaries(log) == []


def test_experts_in_a_cpu_buffer_without_mmap_do_not_warn(model_q8, rpc, tmp_path):
    """Without mmap the experts go to a CPU buffer here (the RPC device has no pinned host buffer):
    no buffer-type WARN, and the output is bit-identical to the cache off. The WARN's positive case,
    experts in a GPU's pinned host buffer, is tests/engine/test_vulkan.py (Vulkan_Host on lavapipe)."""
    extra = ["--fit", "off", "--load-mode", "none"]
    r, off, off_bin = _logits(model_q8, rpc.endpoint, tmp_path, extra, name="off.bin")
    assert r.returncode == 0, off[-2000:]
    r, on, on_bin = _logits(model_q8, rpc.endpoint, tmp_path, [*extra, "-v", "--moe-expert-cache", "8"], name="on.bin")
    assert r.returncode == 0, on[-2000:]
    assert "CPU model buffer size" in on and "CPU_Mapped" not in on  # not memory-mapped
    assert "are in buffer type" not in on and "not cached" not in on
    assert engine.cache_record(on)["slots"] == 8
    assert on_bin.read_bytes() == off_bin.read_bytes()


@pytest.fixture(scope="module")
def rpc2():
    with engine.RpcServer(threads=1) as a, engine.RpcServer(threads=1) as b:
        yield f"{a.endpoint},{b.endpoint}"


def test_two_devices_each_sized_and_exact(model_q8, rpc2, tmp_path):
    """Layers split over two devices: each device gets its own auto line, slots and budget, and the
    logits are bit-identical to the cache off on the same split."""
    r, off, off_bin = _logits(model_q8, rpc2, tmp_path, ["--fit", "off"], name="off.bin")
    assert r.returncode == 0, off[-2000:]
    r, on, on_bin = _logits(model_q8, rpc2, tmp_path,
                            ["--fit", "off", "--moe-expert-cache", "auto", "--moe-expert-cache-floor-mb", "0",
                             "--moe-expert-cache-ceil-mb", "4"], name="on.bin")
    assert r.returncode == 0, on[-2000:]
    auto_lines = re.findall(r"auto on (RPC\d\[[^\]]+\]): .* -> (\d+) slots/layer for (\d+) layers", on)
    assert len(auto_lines) == 2 and len({d for d, _, _ in auto_lines}) == 2, auto_lines
    spec = models.read_spec(model_q8)
    assert sum(int(n) for _, _, n in auto_lines) == spec.n_layer
    # the ceiling binds per device: fewer layers on a device -> more slots there
    by_layers = sorted((int(n), int(s)) for _, s, n in auto_lines)
    assert by_layers[0][1] >= by_layers[1][1]
    rec = engine.parse_cache_preamble(on)
    assert set(rec["budget_mib"]) == {d for d, _, _ in auto_lines}
    assert all(0 < mib <= 4 for mib in rec["budget_mib"].values())
    assert on_bin.read_bytes() == off_bin.read_bytes()
    s = engine.parse_cache_summaries(on)[-1]
    assert s.hit_pct > 0


def test_a_dense_model_is_inert_with_one_warn_line(rpc, tmp_path):
    dense = models.make_model(tmp_path / "dense.gguf", arch="qwen3", n_layer=2)
    with pytest.raises(ValueError, match="not a MoE model"):
        models.read_spec(dense)
    r, off, off_bin = _logits(dense, rpc.endpoint, tmp_path, ["--fit", "off"], name="off.bin")
    assert r.returncode == 0, off[-2000:]
    # at the default verbosity: the flag did nothing, and the user is told (it was an INFO line)
    r, on, on_bin = _logits(dense, rpc.endpoint, tmp_path, ["--fit", "off", "--moe-expert-cache", "8"], name="on.bin")
    assert r.returncode == 0, on[-2000:]
    assert on.count("model has no MoE layers; --moe-expert-cache is inert") == 1
    assert engine.parse_cache_preamble(on) is None and engine.parse_cache_summaries(on) == []
    assert on_bin.read_bytes() == off_bin.read_bytes()


def test_a_fitter_that_gives_up_is_reported(model_q8, rpc, tmp_path):
    r, log, _ = _logits(model_q8, rpc.endpoint, tmp_path,
                        ["--fit", "on", "--fit-target", "99999999", "--moe-expert-cache", "8"], n_predict=4)
    assert r.returncode == 0, log[-2000:]
    assert "failed to fit params to free device memory" in log
    assert "moe-cache: --fit gave up (see above), so it did not account for the expert cache" in log
    assert engine.cache_record(log)["slots"] == 8  # sized without it, and on


def test_a_cache_that_never_serves_warns_per_layer(rpc, tmp_path):
    """refact loads expert tensors (the GGUF has an expert count) but its graph computes a dense FFN:
    every layer is cached and no lookup ever happens. One WARN per layer says so, at the first decode
    step, naming the architecture; the output is the cache-off output."""
    m = models.make_model(tmp_path / "refact.gguf", arch="refact", n_layer=2)
    r, off, off_bin = _logits(m, rpc.endpoint, tmp_path, ["--fit", "off"], name="off.bin")
    assert r.returncode == 0, off[-2000:]
    r, on, on_bin = _logits(m, rpc.endpoint, tmp_path, ["--fit", "off", "-v", *engine.cache_args(8)], name="on.bin")
    assert r.returncode == 0, on[-2000:]
    assert "moe-cache: 2 of 2 MoE layers cached" in on
    for il in (0, 1):
        assert on.count(f"WARNING layer {il} of refact is cached but its decode graph does not route through "
                        "the cache") == 1, on[-3000:]
    s = engine.parse_cache_summaries(on)[-1]
    assert s.uploads == 0 and s.hit_pct == 0 and s.steps == 0  # as upstream's refact MoE model shows
    assert on_bin.read_bytes() == off_bin.read_bytes()


def test_a_cache_that_serves_has_no_routing_warn(model_q8, rpc, tmp_path):
    r, log, _ = _logits(model_q8, rpc.endpoint, tmp_path, ["--fit", "off", *engine.cache_args(8)], n_predict=4)
    assert r.returncode == 0, log[-2000:]
    assert "does not route through the cache" not in log
    assert engine.parse_cache_summaries(log)[-1].uploads > 0


def test_a_dense_model_with_an_expert_count_is_inert_with_one_warn_line(rpc, tmp_path, monkeypatch):
    """A dense architecture whose GGUF still carries an expert count (as upstream's generated
    ernie4_5 and paddleocr do) has no MoE layer: the one WARN line (shown at the default verbosity),
    no other, no preamble."""
    from pybmoe.models import writer

    dense = writer.ARCHES["qwen3"]

    def kvs(spec, w):
        dense.add_kvs(spec, w)
        w.add_expert_count(8)
        w.add_expert_used_count(2)

    monkeypatch.setitem(writer.ARCHES, "qwen3", writer.ArchDef("qwen3", dense.plan, kvs, moe=False))
    m = models.make_model(tmp_path / "dense-e.gguf", arch="qwen3", n_layer=2, n_embd=64, n_ff_exp=64, n_head=2, n_head_kv=1, head_dim=32)  # the narrowest: 16 MiB
    assert models.read_spec(m).n_expert == 8
    r, on, _ = _logits(m, rpc.endpoint, tmp_path, ["--fit", "off", "--moe-expert-cache", "8"])
    assert r.returncode == 0, on[-2000:]
    assert on.count("model has no MoE layers; --moe-expert-cache is inert") == 1
    assert [l for l in on.splitlines() if "moe-cache" in l and "WARNING" in l] == []
    assert engine.parse_cache_preamble(on) is None


_SET_ASIDE = re.compile(r"moe-cache: (\S+): ([\d.]+) MiB set aside for the main context, ([\d.]+) MiB for (.+)$", re.M)


def _server_reserve(model, rpc, tmp_path, extra):
    """Start llama-server with auto slots (and `extra`), make one request, stop it: (its log, the
    engine's 'reserved for contexts' MiB, common's set-aside lines)."""
    args = ["-m", str(model), *engine.host_experts_args(rpc.endpoint), "--fit", "off", "-c", "512", "-np", "1",
            "-t", "2", "--moe-expert-cache", "auto", "--moe-expert-cache-ceil-mb", "8", *extra]
    with engine.LlamaServer(args, log_dir=tmp_path) as srv:
        assert srv.completion("Hello there", n_predict=8)["content"] is not None
    log = srv.log.read_text(errors="replace")
    return log, _reserve(log), _SET_ASIDE.findall(log)


def test_auto_counts_a_draft_model(model_q8, rpc, tmp_path):
    """A -md draft model is loaded after the cache: auto sets aside its weights and context on the
    device first, so the slots never take its memory. The reserve grows by the draft's measured
    memory, which is at least its offloaded weights."""
    draft = models.make_model(tmp_path / "draft.gguf", arch="qwen3", n_layer=2)
    log0, (res0,), parts0 = _server_reserve(model_q8, rpc, tmp_path / "a", [])
    assert len(parts0) == 1 and parts0[0][3] == "no draft" and float(parts0[0][2]) == 0.0
    log1, (res1,), parts1 = _server_reserve(model_q8, rpc, tmp_path / "b", ["-md", str(draft), "-ngld", "99"])
    ((dev, main_mib, draft_mib, what),) = parts1
    assert what == "the draft model" and dev.startswith("RPC")
    main_mib, draft_mib = float(main_mib), float(draft_mib)
    assert main_mib == pytest.approx(float(parts0[0][1]), abs=0.05)       # the main context is the same
    assert res1 == pytest.approx(main_mib + draft_mib, abs=1.0)           # and the engine set aside both
    assert res1 - res0 == pytest.approx(draft_mib, abs=1.0)
    # the draft's weights on the device: every tensor but the token embeddings (kept on the host)
    from pybmoe.models.writer import row_bytes
    meta = models.read_metadata(draft)
    weights_mib = sum(row_bytes(t.shape[0], t.qtype) * math.prod(t.shape[1:])
                      for t in meta.tensors if t.name != "token_embd.weight") / 2**20
    assert draft_mib >= weights_mib * 0.99, (draft_mib, weights_mib)
    assert "speculative" in log1.lower() or "draft" in log1.lower()


@pytest.mark.skipif("qwen35moe" not in models.ARCHES, reason="needs the qwen35moe generator")
def test_auto_counts_an_mtp_draft_context(rpc, tmp_path):
    """--spec-type draft-mtp: the MTP draft context runs on the main model's weights (already
    loaded), so auto sets aside its context only: more than nothing, less than the main model."""
    model = models.cached_model_path(models.ModelSpec(arch="qwen35moe", n_layer=4, n_expert=8, n_expert_used=3))
    _, (res0,), parts0 = _server_reserve(model, rpc, tmp_path / "a", ["-fa", "off"])
    _, (res1,), parts1 = _server_reserve(model, rpc, tmp_path / "b", ["-fa", "off", "--spec-type", "draft-mtp",
                                                                       "--spec-draft-n-max", "3"])
    ((_, main_mib, mtp_mib, what),) = parts1
    assert what == "the MTP draft context"
    assert 0 < float(mtp_mib) < model.stat().st_size / 2**20  # a context, not the weights again
    assert res1 - res0 == pytest.approx(float(mtp_mib), abs=1.0)
