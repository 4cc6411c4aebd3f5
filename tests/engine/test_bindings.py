"""pybmoe.Llama: llama_cpp.Llama with expert placement and the expert cache, bound with ctypes."""
from __future__ import annotations

import ctypes
import subprocess

import pytest

from pybmoe import engine, models
from pybmoe.engine import demo

bindings = pytest.importorskip("pybmoe.engine.bindings", reason="the llama_cpp bindings are not installed")

PROMPT = "The quick brown fox"


def test_stats_struct_layout_matches_c():
    out = subprocess.run([str(engine.find_binary("pybmoe-logits")), "--abi"], capture_output=True, text=True).stdout
    name, size, *fields = out.split()
    assert name == "llama_moe_cache_stats"
    assert int(size) == ctypes.sizeof(bindings.MoeCacheStatsC)
    offsets = dict(f.split("=") for f in fields)
    assert set(offsets) == {f for f, _ in bindings.MoeCacheStatsC._fields_}
    for f, _ in bindings.MoeCacheStatsC._fields_:
        assert int(offsets[f]) == getattr(bindings.MoeCacheStatsC, f).offset, f


@pytest.mark.parametrize("bad", [{"moe_expert_cache": -1}, {"moe_expert_cache": "lots"}, {"moe_expert_cache": 2.5},
                                 {"moe_expert_cache_inserts": -2}, {"n_cpu_moe": -1},
                                 {"override_tensor": "no-equals-sign"}, {"rpc_servers": "nohostport"}])
def test_bad_arguments_raise_value_error(model_q8, bad):
    with pytest.raises(ValueError):
        bindings.Llama(str(model_q8), verbose=False, **bad)


def test_generation_equals_llama_server_and_stats_are_counted(model_q8, rpc):
    n = 24
    # same settings on both sides: no flash attention (llama_cpp.Llama default), same batch sizes
    srv = engine.LlamaServer(demo.server_args(model_q8, rpc.endpoint, 8, 0, ["-fa", "off", "-b", "512", "-ub", "512"]))
    with srv:
        want = srv.completion(PROMPT, n_predict=n)["content"]
    srv.stop()

    # a Path, as models.default_model_path() returns it (llama_cpp.Llama itself takes a str only)
    llm = bindings.Llama(model_q8, n_gpu_layers=99, cpu_moe=True, repack=False, moe_expert_cache=8,
                         rpc_servers=rpc.endpoint, n_ctx=1024, n_threads=2, verbose=False)
    try:
        got = llm(PROMPT, max_tokens=n, temperature=0, top_k=1, repeat_penalty=1.0)["choices"][0]["text"]
        assert got == want
        st = llm.moe_cache_stats()
        spec = models.read_spec(model_q8)
        assert st.n_slots == 8 and st.n_layers == spec.n_layer
        assert st.hits + st.misses == spec.n_layer * spec.n_expert_used * st.steps and st.steps >= n - 1
        assert st.hits > 0 and st.uploads > 0 and st.resident_mib > 0 and 0 < st.hit_rate < 1
        # resize between generations: shrink to nothing, then generation is unchanged
        assert llm.set_moe_cache_slots(4) == 4 and llm.moe_cache_stats().n_slots == 4
        assert llm.set_moe_cache_slots(0) == 0
        st0 = llm.moe_cache_stats()
        assert st0.resident_mib == 0.0 and st0.n_slots == 0 and st0.hits == st.hits  # counters are cumulative
        llm.reset()
        again = llm(PROMPT, max_tokens=n, temperature=0, top_k=1, repeat_penalty=1.0)["choices"][0]["text"]
        assert again == want
        with pytest.raises(ValueError):
            llm.set_moe_cache_slots(99)
    finally:
        llm.close()  # before the RPC device goes away


def test_a_cache_that_cannot_engage_raises(model_q8):
    # everything on the CPU: no MoE layer has a device-resident router
    with pytest.raises(ValueError, match="did not engage"):
        bindings.Llama(str(model_q8), n_gpu_layers=0, moe_expert_cache=4, verbose=False)


def test_fixed_slots_that_do_not_fit_raise(model_q8, rpc):
    with pytest.raises(ValueError, match="does not fit the device's free memory"):
        bindings.Llama(str(model_q8), n_gpu_layers=99, cpu_moe=True, repack=False, rpc_servers=rpc.endpoint,
                       moe_expert_cache=4, moe_expert_cache_floor_mb=99999999, verbose=False)


def test_the_build_leaves_out_llama_cpps_amx_kernels():
    """llama.cpp's AMX kernels crash on some Sapphire Rapids machines (upstream #20824: SIGSEGV in
    ggml_backend_amx_mul_mat; here SIGSEGV, SIGILL or an abort in the first CPU graph of the arch
    tests' models), so pybmoe's build turns them off unless PYBMOE_CPU_AMX=ON (CMakeLists.txt)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert info.startswith("CPU :"), info
    assert "AMX_INT8" not in info, info
