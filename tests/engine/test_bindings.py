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


@pytest.mark.parametrize("kw,msg", [
    ({"model_path": None}, r"^model_path=None is invalid; accepted: the path of a GGUF file \(a str or path-like"),
    ({"model_path": ""}, r"^model_path='' is invalid; accepted: the path of a GGUF file"),
    ({"rpc_servers": 12345}, r"^rpc_servers=12345 is invalid; accepted: a str of host:port endpoints, comma-separated"),
    ({"rpc_servers": ["127.0.0.1:50052"]}, r"^rpc_servers=\['127.0.0.1:50052'\] is invalid; accepted: a str"),
    ({"cpu_moe": "yes"}, r"^cpu_moe='yes' is invalid; accepted: True or False$"),
    ({"cpu_moe": 1}, r"^cpu_moe=1 is invalid; accepted: True or False$"),
    ({"repack": "no"}, r"^repack='no' is invalid; accepted: True or False$"),
])
def test_a_keyword_of_the_wrong_kind_names_the_value_and_what_is_accepted(model_q8, kw, msg):
    """Issue 52, item 6: rpc_servers=12345 raised AttributeError ('int' object has no attribute 'split'),
    model_path=None a TypeError from os.stat, and cpu_moe="yes" was taken as True: each is a ValueError
    naming the value and what is accepted, raised before anything loads."""
    kw = {"model_path": str(model_q8), **kw}
    with pytest.raises(ValueError, match=msg):
        bindings.Llama(verbose=False, **kw)


@pytest.mark.parametrize("kw,msg", [({"moe_stream_cache_mb": 10**12}, r"moe_stream_cache_mb=1000000000000 is invalid; "
                                                                      r"accepted: an integer in 0 \.\. 2147483647"),
                                    ({"moe_stream_cache_mb": 2**31}, r"an integer in 0 \.\. 2147483647 or 'auto'"),
                                    ({"moe_stream_floor_mb": -3}, r"moe_stream_floor_mb=-3 is invalid"),
                                    # issue 43, item 5: the lanes' real range (it said 0 .. 2147483647)
                                    ({"moe_stream_io_threads": -3},
                                     r"^moe_stream_io_threads=-3 is invalid; accepted: "
                                     rf"an integer in 1 \.\. {bindings.LLAMA_MOE_STREAM_IO_THREADS_MAX}$"),
                                    ({"moe_stream_io_threads": bindings.LLAMA_MOE_STREAM_IO_THREADS_MAX + 1},
                                     rf"accepted: an integer in 1 \.\. {bindings.LLAMA_MOE_STREAM_IO_THREADS_MAX}$"),
                                    ({"dense_weights": "ram"}, r"dense_weights='ram' is invalid; accepted: mmap, warm, "
                                                               r"anon, auto")])
def test_stream_values_out_of_range_name_the_range(model_q8, kw, msg):
    """A budget past the engine's int32 MiB used to wrap to a negative budget; now it is refused with the
    real range before anything loads."""
    with pytest.raises(ValueError, match=msg):
        bindings.Llama(str(model_q8), verbose=False, **kw)


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
        # more than were allocated: the message names the range (issue 17: it used to say "see the log")
        with pytest.raises(ValueError, match=r"n_slots=99 is out of range; accepted: 0 \.\. 8 "):
            llm.set_moe_cache_slots(99)
        # issue 43, item 5: a negative count named 0 .. 2147483647, not the slots allocated
        with pytest.raises(ValueError, match=r"^n_slots=-1 is invalid; accepted: an integer in 0 \.\. 8 \(the slots "
                                             r"allocated at load\)$"):
            llm.set_moe_cache_slots(-1)
        assert llm.set_moe_cache_slots(8) == 8
    finally:
        llm.close()  # before the RPC device goes away


def _local_gpus() -> list[str]:
    return [d.name for d in bindings.registry_devices()
            if d.type in (bindings.GGML_BACKEND_DEVICE_TYPE_GPU, bindings.GGML_BACKEND_DEVICE_TYPE_IGPU)
            and d.backend != "RPC"]


def test_a_cache_that_cannot_engage_raises(model_q8, rpc):
    # everything on the CPU: no MoE layer has a device-resident router, though there is a device
    with pytest.raises(ValueError, match=r"did not engage on RPC\d+ .*give n_gpu_layers and cpu_moe"):
        bindings.Llama(str(model_q8), n_gpu_layers=0, moe_expert_cache=4, rpc_servers=rpc.endpoint, verbose=False)


def test_a_second_llama_does_not_use_the_first_ones_rpc_device(model_q8, rpc):
    """The backend registry keeps an RPC device for the life of the process, and llama.cpp offloads to
    every registered device by default; so a second Llama without rpc_servers used the first one's
    device (its cache engaged there) instead of raising. Each Llama now offloads to its own only."""
    if _local_gpus():
        pytest.skip(f"this build has a local device ({', '.join(_local_gpus())}): a cache always has one")
    first = bindings.Llama(model_q8, n_gpu_layers=99, cpu_moe=True, repack=False, rpc_servers=rpc.endpoint,
                           moe_expert_cache=8, n_ctx=256, verbose=False)
    try:
        assert first.moe_cache_stats().n_slots == 8
        with pytest.raises(ValueError, match="needs a device to hold the slots, and this model has none") as e:
            bindings.Llama(model_q8, n_gpu_layers=99, cpu_moe=True, repack=False, moe_expert_cache=8, n_ctx=256,
                           verbose=False)
        assert "rpc_servers=" in str(e.value) and "GGML_CUDA" in str(e.value)
        assert any(d.backend == "RPC" for d in bindings.registry_devices())  # the device is still registered,
        assert bindings.offload_devices([]) == []                # but not a device of a Llama without rpc_servers
        assert bindings.offload_devices([rpc.endpoint]) is None  # (llama.cpp's default is already right here)
    finally:
        first.close()


def test_a_llama_offloads_to_its_own_rpc_server_only(model_q8, rpc):
    """Two RPC servers registered in one process: a Llama that names one never connects to the other."""
    with engine.RpcServer(threads=1) as other:
        theirs = bindings.add_rpc_server(other.endpoint)
        seen = other.log.read_text().count("Accepted client connection")
        llm = bindings.Llama(model_q8, n_gpu_layers=99, cpu_moe=True, repack=False, rpc_servers=rpc.endpoint,
                             moe_expert_cache=4, n_ctx=256, verbose=False)
        try:
            assert llm("Hi", max_tokens=4, temperature=0)["choices"][0]["text"] is not None
            st = llm.moe_cache_stats()
            assert st.n_slots == 4 and st.hits + st.misses > 0
        finally:
            llm.close()
        # before: llama.cpp's default selection split the model over both servers (8 connections here)
        assert other.log.read_text().count("Accepted client connection") == seen
        mine = bindings.add_rpc_server(rpc.endpoint)
        assert theirs != mine and bindings.offload_devices([rpc.endpoint])[:len(mine)] == mine
        assert not set(theirs) & set(bindings.offload_devices([rpc.endpoint]))


def _routing(path) -> dict[tuple[int, int], tuple[int, ...]]:
    import pandas as pd
    df = pd.read_csv(path, comment="#")
    return {k: tuple(g.sort_values("rank").expert) for k, g in df.groupby(["token", "layer"])}


def test_the_trace_and_route_replay_keywords_do_what_the_flags_do(model_q8, tmp_path):
    """Issue 43, item 6: pybmoe.Llama(moe_trace=...) was a TypeError suggesting moe_stream_ceil_mb; the
    bindings now take moe_trace and moe_route_replay as llama-server does. A trace of one prompt,
    replayed under another, routes every row the engine computes to exactly the replayed experts (as
    tests/engine/test_route_replay.py holds the flags to)."""
    foreign = tmp_path / "foreign.csv"
    with bindings.Llama(model_q8, n_ctx=256, moe_trace=foreign, verbose=False) as llm:
        llm("Something else entirely, and longer", max_tokens=16, temperature=0)
    assert foreign.read_text().startswith("# pybmoe-trace v1")
    src = _routing(foreign)
    spec = models.read_spec(model_q8)
    assert {layer for _, layer in src} == set(range(spec.n_layer))
    assert all(len(set(e)) == spec.n_expert_used for e in src.values())
    with bindings.Llama(model_q8, n_ctx=256, verbose=False) as llm:
        plain = llm(PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]

    seen = tmp_path / "seen.csv"
    with bindings.Llama(model_q8, n_ctx=256, moe_route_replay=foreign, moe_trace=seen, verbose=False) as llm:
        replayed = llm(PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    got = _routing(seen)
    n_src = 1 + max(t for t, _ in src)

    def expected(t, layer):
        s = t % n_src
        while s >= 0 and (s, layer) not in src:
            s -= 1
        return src[(s, layer)] if s >= 0 else tuple(range(spec.n_expert_used))

    assert len(got) > spec.n_layer * 16
    assert all(got[key] == expected(*key) for key in got)
    assert replayed != plain  # the router's own routing differs, so the replay changed the text


@pytest.mark.parametrize("kw, says", [
    ({"moe_route_replay": "missing.csv"}, r"moe_route_replay='.*missing\.csv': no such file; accepted: a --moe-trace CSV"),
    ({"moe_trace": "no/such/folder/t.csv"}, r"moe_trace='.*no/such/folder/t\.csv': the folder .* does not exist"),
    ({"moe_route_replay": "bad.csv"}, r"moe_route_replay='.*bad\.csv': the engine refused the routing trace; the engine "
                                      r"said: .*line 2 is not a trace row"),
])
def test_a_bad_trace_or_replay_is_a_value_error_naming_why(model_q8, tmp_path, kw, says):
    (tmp_path / "bad.csv").write_text("workload,phase,ubatch,token,layer,rank,expert,hit\nnot,a,trace\n")
    kw = {k: str(tmp_path / v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=says):
        bindings.Llama(model_q8, n_ctx=256, verbose=False, **kw)


def test_a_misspelt_trace_keyword_names_the_real_one(model_q8):
    with pytest.raises(TypeError, match=r"'moe_traces'; did you mean 'moe_trace'\?"):
        bindings.Llama(model_q8, moe_traces="t.csv", verbose=False)
    with pytest.raises(TypeError, match=r"'moe_route_reply'; did you mean 'moe_route_replay'\?"):
        bindings.Llama(model_q8, moe_route_reply="t.csv", verbose=False)
