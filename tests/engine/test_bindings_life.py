"""pybmoe.Llama's life as llama_cpp.Llama users expect it: freed at `del`, quiet at verbose=False,
errors a Python user can act on, and no hang when the RPC server goes away (docs/loopback.md)."""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
import weakref
from pathlib import Path

import pytest

from pybmoe import engine, models

bindings = pytest.importorskip("pybmoe.engine.bindings", reason="the llama_cpp bindings are not installed")

ROOT = Path(__file__).resolve().parents[2]
#: the tiers each case runs with: (moe_expert_cache, moe_stream_cache_mb)
TIERS = {"off": (0, 0), "cache": (8, 0), "both": (8, 4)}


def _llama(model, endpoint, tiers="cache", **kw):
    cache, stream = TIERS[tiers]
    return bindings.Llama(model, n_gpu_layers=99, cpu_moe=True, repack=False, rpc_servers=endpoint,
                          moe_expert_cache=cache, moe_stream_cache_mb=stream, n_ctx=256, verbose=False, **kw)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("tiers", ["off", "cache", "both"])
def test_del_frees_the_llama_without_the_collector(model_q8, rpc, tiers):
    """Before: a closure in the model class held the Llama, so `del` left it alive until gc.collect()."""
    llm = _llama(model_q8, rpc.endpoint, tiers)
    llm("Hi", max_tokens=2, temperature=0)
    stats = [llm.moe_cache_stats()] if TIERS[tiers][0] else []
    stats += [llm.moe_stream_stats()] if TIERS[tiers][1] else []
    w = weakref.ref(llm)
    gc.disable()
    try:
        del llm
        assert w() is None
    finally:
        gc.enable()
    assert all(s.hits + s.misses > 0 for s in stats)  # stats objects outlive it: they hold no reference


def test_the_context_manager_and_close_free_at_once(model_q8, rpc):
    with _llama(model_q8, rpc.endpoint) as llm:
        assert llm("Hi", max_tokens=2, temperature=0)["choices"][0]["text"] is not None
        assert llm.moe_cache_stats().n_slots == 8
        model = llm._model
    assert llm not in bindings._live and vars(model)["model"] is None and llm.closed  # freed at the block's end
    llm.close()  # a second close is harmless
    w = weakref.ref(llm)
    del llm
    assert w() is None


def test_the_rpc_servers_memory_comes_back_after_del(model_q8, tmp_path):
    """The weights and slots on the device are freed at `del`, not at the next collection or exit."""
    with engine.RpcServer(threads=1, log_dir=tmp_path) as srv:
        time.sleep(0.3)
        base = _rss_kib(srv.proc.pid)
        llm = _llama(model_q8, srv.endpoint)
        llm("Hi", max_tokens=2, temperature=0)
        loaded = _rss_kib(srv.proc.pid)
        assert loaded - base > 8 * 1024, (base, loaded)  # the model's weights live there
        gc.disable()
        try:
            del llm
            deadline = time.monotonic() + 10
            while _rss_kib(srv.proc.pid) - base > (loaded - base) // 4 and time.monotonic() < deadline:
                time.sleep(0.1)
            after = _rss_kib(srv.proc.pid)
        finally:
            gc.enable()
        assert after - base <= (loaded - base) // 4, (base, loaded, after)


def test_a_stock_llama_beside_keeps_llama_cpps_classes_and_params(tmp_path):
    """pybmoe's load steps run in its own Llama only. Before, each load put a class of its own in
    place of llama_cpp._internals.LlamaModel for the process (under a lock), so a stock llama_cpp.Llama
    made on another thread meanwhile loaded through it. (In a child: a stock Llama offloads to every
    registered device, and this process's tests leave RPC devices whose servers are gone.)"""
    rc, out, err = _child(tmp_path, """
        import llama_cpp
        import llama_cpp._internals as internals
        cls = internals.LlamaModel
        with bindings.Llama(m, cpu_moe=True, repack=False, n_ctx=256, verbose=False) as llm:
            # the --cpu-moe override and --no-repack went into this Llama's params
            print("pybmoe", internals.LlamaModel is cls, type(llm._model) is cls,
                  bool(llm.model_params.tensor_buft_overrides), llm.model_params.use_extra_bufts)
            stock = llama_cpp.Llama(str(m), n_ctx=256, verbose=False)
            print("stock", type(stock._model) is cls, stock.model_params.tensor_buft_overrides,
                  stock.model_params.use_extra_bufts, llama_cpp.llama_model_default_params().use_extra_bufts)
            print("text", stock("Hi", max_tokens=2, temperature=0)["choices"][0]["text"] is not None)
            stock.close()
        print("after", internals.LlamaModel is cls)
    """)
    assert rc == 0, err[-3000:]
    assert out.splitlines() == ["pybmoe True True True False", "stock True None True True", "text True",
                                "after True"], (out, err[-3000:])


def test_a_misspelt_tier_keyword_is_a_type_error_naming_the_closest(model_q8):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'moe_stream_cache'; did you mean "
                                        r"'moe_stream_cache_mb'\?"):
        bindings.Llama(model_q8, moe_stream_cache=64, verbose=False)
    with pytest.raises(TypeError, match=r"'dense_weight'; did you mean 'dense_weights'\?"):
        bindings.Llama(model_q8, dense_weight="anon", verbose=False)
    with pytest.raises(TypeError, match=r"'moe_expert_cach'; did you mean 'moe_expert_cache'\?"):
        bindings.Llama(model_q8, moe_expert_cach=8, verbose=False)


@pytest.mark.parametrize("case", ["truncated", "not a gguf", "directory"])
@pytest.mark.parametrize("verbose", [False, True])
def test_a_model_that_does_not_load_carries_the_loaders_reason(model_q8, tmp_path, case, verbose):
    """Issue 43, item 1: at verbose=False a truncated GGUF, a non-GGUF file and a directory raised only
    `Failed to load model from file: PATH`; the loader's own line showed only at verbose=True."""
    path = tmp_path / "m.gguf"
    if case == "truncated":
        path.write_bytes(model_q8.read_bytes()[: model_q8.stat().st_size // 2])
    elif case == "not a gguf":
        path.write_text("this is not a model\n" * 100)
    else:
        path.mkdir()
    with pytest.raises(ValueError) as e:
        bindings.Llama(path, n_ctx=256, verbose=verbose)
    msg = str(e.value)
    if case == "directory":
        assert msg == f"model_path {path} is a directory; accepted: a GGUF file (the first file of a split GGUF)"
        return
    assert msg.startswith(f"Failed to load model from file: {path}; the engine said: "), msg
    why = {"truncated": "tensor 'token_embd.weight' data is not within the file bounds, model is corrupted or "
                        "incomplete",
           "not a gguf": "invalid magic characters: 'this', expected 'GGUF'"}
    assert why[case] in msg.split("the engine said: ", 1)[1], msg


def test_a_closed_llama_raises_instead_of_crashing(tmp_path):
    """Issue 43, item 4: any call on a Llama after close() or its with block was a segfault (exit 139),
    as with stock llama_cpp.Llama 0.3.36; now each raises RuntimeError saying the Llama is closed."""
    rc, out, err = _child(tmp_path, """
        llm = bindings.Llama(m, n_ctx=256, verbose=False)
        llm("Hi", max_tokens=2, temperature=0)
        llm.close()
        calls = {"call": lambda: llm("Hi", max_tokens=2), "tokenize": lambda: llm.tokenize(b"Hi"),
                 "detokenize": lambda: llm.detokenize([1, 2]), "n_ctx": llm.n_ctx, "eval": lambda: llm.eval([1]),
                 "chat": lambda: llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2),
                 "save_state": llm.save_state, "embed": lambda: llm.embed("Hi"),
                 "moe_cache_stats": llm.moe_cache_stats, "set_moe_cache_slots": lambda: llm.set_moe_cache_slots(1),
                 "moe_stream_stats": llm.moe_stream_stats}
        with bindings.Llama(m, n_ctx=256, verbose=False) as llm2:
            pass
        calls["after with"] = lambda: llm2("Hi", max_tokens=2)
        for name, call in calls.items():
            try:
                call()
                print(name, "returned")
            except RuntimeError as e:
                print(name, e)
        print("closed", llm.closed, llm2.closed)
        llm.close()  # a second close is harmless
    """)
    assert rc == 0, (rc, err[-3000:])
    lines = out.splitlines()
    assert lines[-1] == "closed True True"
    assert lines[:-1] == [f"{name} {bindings.CLOSED}" for name in
                          ("call", "tokenize", "detokenize", "n_ctx", "eval", "chat", "save_state", "embed",
                           "moe_cache_stats", "set_moe_cache_slots", "moe_stream_stats", "after with")], out


def test_a_tier_that_does_not_engage_carries_the_engines_reason(model_q8):
    """verbose=False: the message used to say "the engine's log says why", with no log to read."""
    with pytest.raises(ValueError) as e:
        bindings.Llama(model_q8, n_ctx=256, moe_stream_cache_mb=1, verbose=False)
    msg = str(e.value)
    assert "moe_stream_cache_mb=1 is under the mechanical minimum at n_ubatch=512; the engine said: " in msg
    assert re.search(r"moe-stream: .*MiB", msg.split("the engine said: ", 1)[1]), msg


def test_an_inert_tier_is_a_python_warning(rpc, tmp_path):
    m = _dense_with_expert_count(tmp_path)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        llm = bindings.Llama(m, n_ctx=256, moe_stream_cache_mb=8, verbose=False)
        llm.close()
    msgs = [(str(w.message), w.filename) for w in got if issubclass(w.category, RuntimeWarning)]
    # the warning points at the caller's line, not into pybmoe or llama_cpp
    assert ("moe_stream_cache_mb=8 is inert: the model has no MoE layers", __file__) in msgs, msgs


def _dense_with_expert_count(tmp_path: Path) -> Path:
    """A dense qwen3 whose GGUF carries an expert count, as upstream's ernie4_5 and paddleocr do."""
    from pybmoe.models import writer
    dense = writer.ARCHES["qwen3"]

    def kvs(spec, w):
        dense.add_kvs(spec, w)
        w.add_expert_count(8)
        w.add_expert_used_count(2)

    saved = writer.ARCHES["qwen3"]
    writer.ARCHES["qwen3"] = writer.ArchDef("qwen3", dense.plan, kvs, moe=False)
    try:
        return models.make_model(tmp_path / "dense-e.gguf", arch="qwen3", n_layer=2, n_embd=64, n_ff_exp=64, n_head=2, n_head_kv=1, head_dim=32)  # 16 MiB
    finally:
        writer.ARCHES["qwen3"] = saved


def test_llama_server_shows_the_inert_line_at_its_default_verbosity(rpc, tmp_path):
    """It was an INFO line, which llama-server does not show unless -v."""
    m = _dense_with_expert_count(tmp_path)
    srv = engine.LlamaServer(["-m", str(m), "--rpc", rpc.endpoint, "-ngl", "99", "--moe-expert-cache", "8",
                              "-c", "256"])
    with srv:
        srv.completion("Hi", n_predict=2)
    log = srv.stop()
    assert log.count("model has no MoE layers; --moe-expert-cache is inert") == 1, log[-3000:]


# --- child processes: what must never hang or abort the interpreter ---

CHILD_HEAD = """
import sys, time
from pybmoe import engine, models
from pybmoe.engine import bindings
m = models.default_model_path("Q8_0")
"""


def _child(tmp_path: Path, body: str, timeout_s: float = 30) -> tuple[int, str, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD_HEAD + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s, env=env,
                       cwd=tmp_path)
    return p.returncode, p.stdout, p.stderr


def test_verbose_false_prints_nothing(tmp_path):
    """Load with both tiers on the loopback device, generate, delete: not one line on stdout or stderr
    (the cache's load line, preamble and summary used to print at any verbosity)."""
    rc, out, err = _child(tmp_path, """
        with engine.RpcServer(threads=1) as rpc:
            llm = bindings.Llama(m, n_gpu_layers=99, cpu_moe=True, repack=False, rpc_servers=rpc.endpoint,
                                 moe_expert_cache=8, moe_stream_cache_mb=4, n_ctx=256, verbose=False)
            llm("Hello", max_tokens=8, temperature=0)
            st = llm.moe_cache_stats()
            assert st.hits + st.misses > 0
            del llm
    """)
    assert rc == 0 and out == "" and err == "", (rc, out, err)


def test_the_log_callback_is_the_first_llamas_not_the_imports(tmp_path):
    """Importing pybmoe.engine.bindings replaced llama_cpp's log callback for the whole process. The
    import now leaves llama_cpp's in place (a stock llama_cpp.Llama made after it logs through
    llama_cpp's, none of its lines reach pybmoe's); the first pybmoe.Llama installs pybmoe's."""
    rc, out, err = _child(tmp_path, """
        import ctypes
        import llama_cpp
        from llama_cpp import _logger

        def installed():
            cb, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
            llama_cpp.llama_log_get(ctypes.byref(cb), ctypes.byref(user_data))
            return ctypes.cast(cb, ctypes.c_void_p).value

        def address(cb):
            return ctypes.cast(cb, ctypes.c_void_p).value

        print("import", installed() == address(_logger.llama_log_callback),
              installed() == address(bindings._log_callback))
        stock = llama_cpp.Llama(str(m), n_ctx=256, verbose=False)
        print("stock", len(bindings._log_recent))
        stock.close()
        llm = bindings.Llama(m, n_ctx=256, verbose=False)
        print("pybmoe", installed() == address(bindings._log_callback), len(bindings._log_recent) > 0)
        llm.close()
    """)
    assert rc == 0, err[-3000:]
    assert out.splitlines() == ["import True False", "stock 0", "pybmoe True True"], (out, err[-3000:])


def test_a_wrong_rpc_endpoint_is_a_value_error_naming_it(tmp_path):
    """It used to abort the interpreter (exit 134) with an 86-line backtrace."""
    port = engine.free_port()
    rc, out, err = _child(tmp_path, f"""
        try:
            bindings.Llama(m, rpc_servers="127.0.0.1:{port}", moe_expert_cache=8, verbose=False)
        except ValueError as e:
            print(e)
    """)
    assert rc == 0, err[-3000:]
    assert out.strip() == (f"rpc server 127.0.0.1:{port} is not reachable: nothing accepts connections there "
                           "(start ggml-rpc-server on that host and port, or fix rpc_servers)")
    assert err == ""


LOST_LOAD = """
cache, stream = {cache}, {stream}
rpc = engine.RpcServer(threads=1).start()
llm = bindings.Llama(m, n_gpu_layers=99, cpu_moe=True, repack=False, rpc_servers=rpc.endpoint,
                     moe_expert_cache=cache, moe_stream_cache_mb=stream, n_ctx=256, verbose=False)
llm("Hi", max_tokens=4, temperature=0)
print("endpoint", rpc.endpoint, flush=True)
"""
LOST_CASES = {
    # the server goes away, then: close(), then the script ends
    "close": """
        rpc.proc.kill(); rpc.proc.wait()
        llm.close()
        print("pybmoe-test: closed", file=sys.stderr)
    """,
    # the server goes away, then: del (the model is freed here), then the script ends
    "del": """
        rpc.proc.kill(); rpc.proc.wait()
        del llm
        print("pybmoe-test: deleted", file=sys.stderr)
    """,
    # the server goes away and the script ends with the Llama alive (freed at exit)
    "exit": """
        rpc.proc.kill(); rpc.proc.wait()
        print("pybmoe-test: exiting", file=sys.stderr)
    """,
    # the server goes away between generations: the next one raises
    "between": """
        rpc.proc.kill(); rpc.proc.wait(); time.sleep(0.3)
        try:
            llm("Hello there", max_tokens=4, temperature=0)
        except RuntimeError as e:
            print(f"RuntimeError: {e}", file=sys.stderr)
    """,
    # the server goes away while tokens stream
    "during": """
        try:
            for i, _ in enumerate(llm("Hello", max_tokens=200, temperature=0, stream=True)):
                if i == 3:
                    rpc.proc.kill()
        except RuntimeError as e:
            print(f"RuntimeError: {e}", file=sys.stderr)
    """,
}
LAST_LINE = {"close": "pybmoe-test: closed", "del": "pybmoe-test: deleted", "exit": "pybmoe-test: exiting"}


@pytest.mark.parametrize("tiers", ["off", "cache", "both"])
@pytest.mark.parametrize("case", list(LOST_CASES))
def test_a_lost_rpc_server_never_hangs(tmp_path, case, tiers):
    """Before: with the server killed, `del` and the script's end waited for ever in
    rpc_dispatcher::send (the cache's uploader too), and close() aborted. Each case now ends within
    30 s with the documented status and last stderr line (docs/loopback.md)."""
    cache, stream = TIERS[tiers]
    t0 = time.monotonic()
    rc, out, err = _child(tmp_path, LOST_LOAD.format(cache=cache, stream=stream) + textwrap.dedent(LOST_CASES[case]))
    assert time.monotonic() - t0 < 30
    endpoint = re.search(r"^endpoint (\S+)$", out, re.M).group(1)
    last = err.strip().splitlines()[-1] if err.strip() else ""
    why = f"rc={rc}\n{err[-3000:]}"
    lost = f"ggml-rpc: RPC server {endpoint} is lost: its commands fail from now on"
    if case == "exit":  # freed at exit, after the script's last line: the loss may be logged then
        assert rc == 0 and last in (LAST_LINE[case], lost), why
        return
    if case in LAST_LINE:
        assert rc == 0 and last == LAST_LINE[case], why
        return
    raised = f"RuntimeError: llama_decode returned -3; the engine said: ggml-rpc: RPC server {endpoint} is lost: "
    if case == "between":
        assert rc == 0 and last.startswith(raised), why
        return
    # during a generation: a step that had not computed yet raises; one whose read was in flight aborts
    # with one line naming the server (no error path returns from a tensor read)
    aborted = f"ggml-rpc: RPC server {endpoint} was lost during a read; aborting"
    assert (rc == 0 and last.startswith(raised)) or (rc == -6 and last == aborted), why


def test_a_socket_error_after_the_loss_is_not_shown(tmp_path):
    """Before: with the cache's uploader sending, a `send failed ... RPC server HOST:PORT` line could
    come after the generation's RuntimeError and be the last stderr line. At verbose=False a transport
    line about a server the engine has already reported lost is kept (an error's reason) but not shown;
    one about another server, or before the loss, is shown."""
    rc, out, err = _child(tmp_path, """
        from llama_cpp import _logger
        _logger.set_verbose(False)
        log = lambda level, text: bindings._log_callback(level, text.encode(), None)
        log(4, "send failed (bytes_sent=0, size_to_send=1): RPC server 10.0.0.1:9\\n")
        log(4, "ggml-rpc: RPC server 10.0.0.1:9 is lost: its commands fail from now on\\n")
        log(4, "send failed (bytes_sent=0, size_to_send=1): RPC server 10.0.0.1:9\\n")
        log(4, "recv failed: RPC server 10.0.0.1:9 closed the connection\\n")
        log(4, "recv failed (bytes_recv=0, size_to_recv=8): RPC server 10.0.0.2:9\\n")
        print(bindings._log_reasons(0))
    """)
    assert rc == 0, err
    assert err.splitlines() == ["send failed (bytes_sent=0, size_to_send=1): RPC server 10.0.0.1:9",
                                "ggml-rpc: RPC server 10.0.0.1:9 is lost: its commands fail from now on",
                                "recv failed (bytes_recv=0, size_to_recv=8): RPC server 10.0.0.2:9"]
    assert "recv failed: RPC server 10.0.0.1:9 closed the connection" in out  # still a reason


def test_the_stats_carry_the_summary_lines_fields(tmp_path):
    """verbose=False hides the engine's summary line, so the stats call must hold what it said: the
    same figures, field by field, as the line a verbose run prints at close."""
    rc, out, err = _child(tmp_path, """
        import dataclasses, json
        with engine.RpcServer(threads=1) as rpc:
            llm = bindings.Llama(m, n_gpu_layers=99, cpu_moe=True, repack=False, rpc_servers=rpc.endpoint,
                                 moe_expert_cache=8, n_ctx=256, verbose=True)
            llm("Hello", max_tokens=12, temperature=0)
            time.sleep(0.5)  # the last step's uploads land (they run behind decode)
            s = llm.moe_cache_stats()
            print(json.dumps(dict(dataclasses.asdict(s), hit_rate=s.hit_rate, upload_gbps=s.upload_gbps)), flush=True)
            llm.close()
    """)
    assert rc == 0, err[-3000:]
    import json
    st = json.loads(out.strip().splitlines()[-1])
    line = engine.parse_cache_summaries(err)[-1]
    assert st["hits"] + st["misses"] > 0 and st["uploads"] > 0
    # slots per layer: one device, no pool, its counts the cache's; the line names no pool
    (dev,) = st["devices"]
    assert dev["banks"] == 0 and (dev["hits"], dev["misses"]) == (st["hits"], st["misses"]) and line.pools == ()
    assert line.hit_pct == pytest.approx(100 * st["hit_rate"], abs=0.05)
    assert line.resident_mib == pytest.approx(st["resident_mib"], abs=0.05)
    assert (line.uploads, line.steps, line.h2d, line.publishes, line.waits, line.warmup_uploads) == \
        (st["uploads"], st["steps"], st["h2d"], st["publishes"], st["waits"], st["warmup_uploads"])
    assert line.upload_mib == pytest.approx(st["upload_mib"], abs=0.05)
    assert line.layer_demand_mib == pytest.approx(st["layer_demand_mib"], abs=0.005) and st["layer_demand_mib"] > 0
    assert line.token_demand_mib == pytest.approx(st["token_demand_mib"], abs=0.005) and st["token_demand_mib"] > 0
    assert line.upload_gbps == pytest.approx(st["upload_gbps"], abs=0.005)
    assert line.upload_file_mib == pytest.approx(st["upload_file_mib"], abs=0.05)
    assert line.upload_wait_ms == pytest.approx(1000 * st["upload_wait_s"], abs=0.05)
