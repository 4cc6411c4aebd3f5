"""The VRAM tier's default mode: uploads never hold decode back, and what the tier does is counted.

By default an upload is used from the first step after its bytes have arrived, so which lookups hit
depends on timing; the split stays exact whatever is resident, so the logits must still be
bit-identical to cache-off. ``--moe-expert-cache-sync`` keeps the deterministic visibility (the
replay tests run in it). Layout: layers on the loopback ggml-rpc-server, experts on the host
(--cpu-moe --no-repack), as in test_cache_identity.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.routing import trace as tr

PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"
N_PREDICT = 12
SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=256)
ARCHS = ["qwen3moe", "gpt-oss", "gemma4"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request) -> Path:
    return models.cached_model_path(models.ModelSpec(arch=request.param, **SHAPE))


def _run(model: Path, rpc, tmp: Path, ub: int, extra: list[str], name: str, mmap: bool = True) -> engine.LogitsRun:
    args = ["-b", "512", "-ub", str(ub), *engine.host_experts_args(rpc.endpoint), *extra]
    if not mmap:
        args += ["--load-mode", "none"]  # no memory map: the experts are read into a CPU buffer
    return engine.run_logits(model, tmp / f"{name}.bin", args, prompt=PROMPT, n_predict=N_PREDICT, ctx=512)


@pytest.mark.parametrize("ub", [1, 4, 9])
def test_both_modes_are_bit_identical_to_cache_off(arch_model, rpc, tmp_path, ub):
    spec = models.read_spec(arch_model)
    k, n = spec.n_expert_used, spec.n_expert
    base = _run(arch_model, rpc, tmp_path, ub, [], "off")
    for slots in (k - 1, n // 2):
        for sync in (False, True):
            trace = tmp_path / f"trace-{slots}-{int(sync)}.csv"
            r = _run(arch_model, rpc, tmp_path, ub, [*engine.cache_args(slots, sync=sync), "--moe-expert-cache-max-batch",
                                                     "16", "--moe-trace", str(trace)], f"on-{slots}-{int(sync)}")
            what = f"{arch_model.name} ub={ub} slots={slots} {'sync' if sync else 'default'}"
            assert r.logits == base.logits and r.tokens == base.tokens, f"{what}: logits differ from cache-off"
            s = engine.parse_cache_summaries(r.log)[-1]
            assert s.sync is sync, what
            # the counters add up: the trace's lookups are the tier's hits + misses, layer by layer
            t = tr.read_trace(trace).frame
            served = t[t["hit"] >= 0]
            assert len(served) > 0, what
            for il, (hits, misses) in r.layers.items():
                rows = served[served["layer"] == il]
                assert (int((rows["hit"] == 1).sum()), int((rows["hit"] == 0).sum())) == (hits, misses), (what, il)
            if not sync:
                assert s.waits == 0 and s.upload_wait_ms == 0.0, f"{what}: a default-mode step waited for uploads"


def test_one_table_publish_per_step_and_one_copy_per_merged_run(model_q8, rpc, tmp_path):
    """Per step on one device the cache issues at most one table publish (all layers' tables are one
    tensor) plus one host-to-device call per merged run of uploads: never more calls than uploads
    times projections."""
    spec = models.read_spec(model_q8)
    r = _run(model_q8, rpc, tmp_path, 1, [*engine.cache_args(4, sync=True)], "publish")
    s = engine.parse_cache_summaries(r.log)[-1]
    n_proj = 3  # qwen3moe: up, gate, down
    assert s.steps > 10 and s.uploads > 0
    assert 1 <= s.publishes <= s.steps + 1, s  # + the publish at load
    in_flight = spec.n_layer * spec.n_expert_used  # moves scheduled after the last step, never settled
    assert s.h2d - s.publishes <= (s.uploads + in_flight) * n_proj, s


@pytest.mark.parametrize("mmap", [True, False])
def test_uploads_from_host_memory_read_no_file_bytes(model_q8, rpc, tmp_path, mmap):
    """The host experts hold the GGUF layout in memory (the map, or a CPU buffer without it): the
    uploader copies from there and reads nothing from the file."""
    r = _run(model_q8, rpc, tmp_path, 1, [*engine.cache_args(4)], f"mem-{int(mmap)}", mmap=mmap)
    s = engine.parse_cache_summaries(r.log)[-1]
    assert s.uploads > 0 and s.upload_mib > 0
    assert s.upload_file_mib == 0.0, s


def test_repacked_host_experts_are_uploaded_from_the_file(rpc, tmp_path):
    """A repacked host tensor does not hold the GGUF layout: its experts are read from the file."""
    model = models.default_model_path("Q4_K")
    layout = [a for a in engine.host_experts_args(rpc.endpoint) if a != "--no-repack"]
    r = engine.run_logits(model, tmp_path / "repack.bin", [*layout, *engine.cache_args(4), "-v"], prompt=PROMPT,
                          n_predict=N_PREDICT, ctx=512)
    assert "CPU_REPACK" in r.log
    s = engine.parse_cache_summaries(r.log)[-1]
    assert s.uploads > 0 and s.upload_file_mib > 0


def test_a_bad_sync_value_is_refused_by_the_bindings(model_q8):
    from pybmoe.engine import bindings
    with pytest.raises(ValueError, match="moe_expert_cache_sync must be True or False"):
        bindings.Llama(model_q8, moe_expert_cache=4, moe_expert_cache_sync="yes")


def _cuda_supports_op_case(src: str, op: str) -> str:
    """The body of ``case GGML_OP_<op>:`` in ggml-cuda.cu's supports_op (up to the next op's case)."""
    start = src.index("static bool ggml_backend_cuda_device_supports_op")
    i = src.index(f"case GGML_OP_{op}:", start)
    j = src.find("case GGML_OP_", i + len(op) + 12)
    return src[i:j]


def test_the_batch_remap_runs_on_the_device(model_q8, rpc, tmp_path):
    """A batch's expert ids become slot ids with ops every GPU backend runs on the device: the
    scheduler puts each remap node on the device (read from GGML_SCHED_DEBUG's assignments), there
    is no I32 REPEAT any more, and the pinned CUDA backend's supports_op takes CONT and I32 GET_ROWS
    (its REPEAT would not take I32: the node fell back to the CPU)."""
    import os
    from pybmoe.build import vendor
    r = engine.run_logits(model_q8, tmp_path / "remap.bin",
                          ["-b", "512", "-ub", "4", *engine.host_experts_args(rpc.endpoint), *engine.cache_args(4),
                           "--moe-expert-cache-max-batch", "4", "-v"],
                          prompt="one two three four five six seven", n_predict=2, ctx=256,
                          env={**os.environ, "GGML_SCHED_DEBUG": "2"})
    remap = [ln for ln in r.log.splitlines() if "(  GET_ROWS)" in ln and "ffn_exps.cache" in ln]
    assert remap, "no GET_ROWS of a cache table in the graphs"
    assert all("[RPC0[" in ln.split("use=")[0] for ln in remap), remap[:3]
    conts = [ln for ln in r.log.splitlines() if "(      CONT)" in ln and "ffn_moe_topk" in ln]
    assert conts and all("[RPC0[" in ln.split("use=")[0] for ln in conts), conts[:3]  # the multi-token graphs
    assert not [ln for ln in r.log.splitlines() if "(    REPEAT)" in ln and "ffn_exps.cache" in ln]
    src = (vendor.llama_cpp_dir() / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").read_text()
    assert "GGML_TYPE_I32" in _cuda_supports_op_case(src, "GET_ROWS")
    assert "return true;" in _cuda_supports_op_case(src, "CONT")
    assert "GGML_TYPE_I32" not in _cuda_supports_op_case(src, "REPEAT")


def test_no_scheduler_synchronize_when_no_table_changes(model_q8, rpc):
    """The step after a graph waits for the device only before it publishes a changed table: once
    the cache holds what decode needs, steps go by without one."""
    from pybmoe.engine import bindings
    llm = bindings.Llama(model_q8, rpc_servers=rpc.endpoint, n_gpu_layers=99, cpu_moe=True, repack=False,
                         moe_expert_cache=12, n_ctx=256, verbose=False)
    try:
        llm("one two three one two three one two three", max_tokens=48, temperature=0)
        st = llm.moe_cache_stats()
    finally:
        llm.close()
    assert st.steps >= 40 and st.uploads > 0
    assert 0 < st.syncs < st.steps, st
    assert st.publishes <= st.syncs + 1  # every publish after the one at load followed a synchronize


def test_the_upload_budget_bounds_uploads_per_step(model_q8, rpc, tmp_path):
    """--moe-expert-cache-upload-mb 1: at most floor(1 MiB / 0.1992 MiB) = 5 experts per step over all
    layers (against up to 4 layers x 4 without it), and the output stays exact."""
    base = _run(model_q8, rpc, tmp_path, 1, [], "off")
    free = _run(model_q8, rpc, tmp_path, 1, [*engine.cache_args(4, sync=True), "-v"], "unbudgeted")
    r = _run(model_q8, rpc, tmp_path, 1, [*engine.cache_args(4, sync=True), "--moe-expert-cache-upload-mb", "1", "-v"],
             "budget")
    assert r.logits == base.logits
    assert "upload budget 1 MiB per step: 5 experts of 0.20 MiB" in r.log
    s, s_free = engine.parse_cache_summaries(r.log)[-1], engine.parse_cache_summaries(free.log)[-1]
    assert s.uploads <= 5 * s.steps and s.uploads > 0
    assert s_free.uploads > s.uploads


#: Experts of 3.19 MiB (3 x 256 x 4096 Q8_0 rows), over the 2 MiB budgets below; a narrow embedding keeps the
#: file at 95 MiB (n_embd 1024 made it 216 MiB for the same experts, the fast subset's largest model).
BIG_EXPERTS = models.ModelSpec(arch="qwen3moe", n_layer=2, n_expert=8, n_expert_used=2, n_embd=256, n_ff_exp=4096)


def test_an_upload_budget_under_one_expert_is_refused(rpc, tmp_path):
    model = models.cached_model_path(BIG_EXPERTS)
    with pytest.raises(engine.EngineError) as e:
        _run(model, rpc, tmp_path, 1, [*engine.cache_args(4), "--moe-expert-cache-upload-mb", "2"], "under")
    assert "upload budget 2 MiB refused: it must be 0 (unlimited) or at least one expert (3.19 MiB)" in str(e.value)
    assert "--moe-expert-cache-upload-mb 2 is under one expert" in str(e.value)


def test_the_bindings_refuse_an_upload_budget_under_one_expert(rpc):
    from pybmoe.engine import bindings
    model = models.cached_model_path(BIG_EXPERTS)
    with pytest.raises(ValueError, match="moe_expert_cache_upload_mb=2 is under one expert"):
        bindings.Llama(model, rpc_servers=rpc.endpoint, n_gpu_layers=99, cpu_moe=True, repack=False, verbose=False,
                       moe_expert_cache=4, moe_expert_cache_upload_mb=2)
    llm = bindings.Llama(model, rpc_servers=rpc.endpoint, n_gpu_layers=99, cpu_moe=True, repack=False, verbose=False,
                         moe_expert_cache=4, moe_expert_cache_upload_mb=7)
    try:
        assert llm.moe_cache_stats().step_moves == 2  # floor(7 / 3.19)
    finally:
        llm.close()


def test_a_bad_admission_is_refused_by_the_bindings(model_q8):
    from pybmoe.engine import bindings
    with pytest.raises(ValueError, match=r"admit='second-miss:0': expected 'always', 'second-miss'"):
        bindings.Llama(model_q8, moe_expert_cache=4, moe_expert_cache_admit="second-miss:0")


def test_the_bindings_take_the_admission(model_q8, rpc):
    """moe_expert_cache_admit='second-miss' gives the same text as the cache off, with fewer uploads
    than admitting every miss."""
    from pybmoe.engine import bindings
    kw = dict(n_gpu_layers=99, cpu_moe=True, repack=False, rpc_servers=rpc.endpoint, n_ctx=256, verbose=False,
              moe_expert_cache=4, moe_expert_cache_sync=True)
    out = {}
    for admit in ("always", "second-miss"):
        llm = bindings.Llama(model_q8, moe_expert_cache_admit=admit, **kw)
        try:
            text = llm("Once upon a time", max_tokens=24, temperature=0.0)["choices"][0]["text"]
            out[admit] = (text, llm.moe_cache_stats().uploads)
        finally:
            llm.close()
    assert out["always"][0] == out["second-miss"][0]
    assert out["second-miss"][1] < out["always"][1], out
