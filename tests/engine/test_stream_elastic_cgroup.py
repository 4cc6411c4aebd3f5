"""Memory that follows the work, under a real memory cgroup (root; skipped elsewhere, with the reason).

The oracles are the kernel's own counts, not the engine's:

- a context's committed memory is the cgroup's anonymous memory (``memory.stat``: v1 ``total_rss``, v2
  ``anon``) before and after its cells fill: under the elastic plan a 32768-token context costs nothing at
  creation and what its filled cells hold after; the static plan (``PYBMOE_MOE_STREAM_ELASTIC=0``) pays
  the whole capacity at creation;
- a second process in the same cgroup that allocates and touches 25 % of the limit while the server
  decodes: the server is not killed (the cgroup's OOM count stays 0), the budget yields while that
  process holds its memory and grows back once it exits, and the answer is the tokens of a stock
  server without the tier and without a limit.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pybmoe import models
from pybmoe.bench import elastic, load, server
from pybmoe.engine import memlimit

# test_serve_limit's model: 2 layers, 16 experts (top-3), 4 KiB of KV cache a token
SPEC = models.ModelSpec(arch="qwen3moe", n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320,
                        n_head=8, n_head_kv=4, head_dim=128, n_ctx_train=65536)
MIB = 2**20
KV_PER_TOKEN = 2 * 2 * 4 * 128 * 2  # layers x (K, V) x heads x head_dim x F16

CHILD = r"""
import json, sys
from pathlib import Path
from pybmoe.engine import bindings, memlimit
import llama_cpp

model, cgroup, n_fill = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])

def anon():
    return memlimit.read_stat_mib(cgroup, memlimit.V1_ROOT.is_dir())["anon"] * 2**20

llm = bindings.Llama(model, n_ctx=32768, moe_stream_cache_mb="auto", n_gpu_layers=0, n_ubatch=512, n_batch=512,
                     verbose=False, seed=0, flash_attn=True)
tokens = [1000 + (i * 7919) % 29000 for i in range(n_fill)]
llm.eval(tokens[:512])          # the experts and the compute buffer touched once
llama_cpp.llama_memory_seq_rm(llm._ctx.memory, 0, -1, -1)
llm.n_tokens = 0
st0, a0 = llm.moe_stream_stats(), anon()
llm.eval(tokens)
st1, a1 = llm.moe_stream_stats(), anon()
print(json.dumps(dict(anon0=a0, anon1=a1, committed0=st0.kv_committed_mib, committed1=st1.kv_committed_mib,
                      capacity=st1.kv_capacity_mib, elastic=bool(st1.elastic))))
"""


def needs_cgroup() -> None:
    ok, why = memlimit.limit_available()
    if not ok:
        pytest.skip(why)


@pytest.fixture(scope="module")
def model() -> Path:
    return models.cached_model_path(SPEC)


def fill_in_cgroup(model: Path, tmp_path: Path, elastic_on: bool, n_fill: int) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    with memlimit.MemoryLimit(2048) as lim:
        env = {"PYBMOE_MOE_STREAM_ELASTIC": "1" if elastic_on else "0"}
        cmd = ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, str(script), str(model), str(lim.path),
               str(n_fill)]
        r = subprocess.run(lim.wrap(cmd), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_context_commits_as_it_fills_as_the_cgroup_counts_it(model, tmp_path):
    needs_cgroup()
    n_fill = 8192
    el = fill_in_cgroup(model, tmp_path, True, n_fill)
    st = fill_in_cgroup(model, tmp_path, False, n_fill)
    assert el["elastic"] and not st["elastic"], (el, st)
    filled = n_fill * KV_PER_TOKEN
    # the engine's count (its page tables) and the kernel's (the cgroup's anonymous memory) agree: the cells
    # filled, and the attention's mask over the longer context (at most 512 x 8192 x F16 = 8 MiB) beside them
    assert el["committed0"] * MIB < 1 * MIB, el
    assert el["committed1"] * MIB == pytest.approx(filled, abs=2 * MIB), el
    grew = el["anon1"] - el["anon0"]
    assert 0.9 * filled <= grew <= filled + 12 * MIB, (grew / MIB, el)
    # the static plan wrote the whole capacity (128 MiB) at creation: filling it costs the cgroup little more,
    # and before the fill it held the capacity the elastic plan did not
    assert el["capacity"] == pytest.approx(32768 * KV_PER_TOKEN / MIB, rel=0.01), el
    assert st["anon1"] - st["anon0"] <= 12 * MIB, st
    assert st["anon0"] - el["anon0"] >= 0.9 * (el["capacity"] * MIB - 512 * KV_PER_TOKEN), (st, el)


def test_a_second_process_in_the_cgroup_makes_the_budget_yield_not_the_server_die(model, tmp_path):
    needs_cgroup()
    limit = 300
    hog_mib = limit // 4
    flags = ["-c", "8192", "-np", "1"]
    req = load.Request("p", "completion", True, tuple(range(2000, 2040)), 240)
    hog: dict = {}

    def on_chunk(n: int) -> bool:
        if n == 8:
            # allocates and touches 25 % of the limit, says so, and holds it until its stdin closes
            code = (f"import sys; b = b'\\x01' * ({hog_mib} * 2**20); print('held', flush=True); sys.stdin.read()")
            hog["p"] = subprocess.Popen(lim.wrap([sys.executable, "-c", code]), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
            hog["held"] = hog["p"].stdout.readline().strip()
        if n == 40 and "p" in hog:
            # 32 tokens later: the governor has run on each one since the process took its memory (the
            # server's free memory is its governor's last reading)
            hog["during"] = elastic.Sampler(srv.url).sample()
            hog["stat"] = lim.stat_mib()
        if n == 120 and "p" in hog:
            hog["p"].stdin.close()
            hog["rc"] = hog["p"].wait(timeout=60)
        return True

    with memlimit.MemoryLimit(limit) as lim:
        with server.running_server(model, limit=lim, log_path=tmp_path / "server.log", extra=flags) as srv:
            load.send(srv.url, load.Request("warm", "completion", False, tuple(range(3000, 3064)), 8), timeout_s=300)
            before = elastic.Sampler(srv.url).sample()
            stat0 = lim.stat_mib()
            got = load.send(srv.url, req, timeout_s=600, on_chunk=on_chunk)
            after = elastic.Sampler(srv.url).sample()
            # one more request once the memory is back: the budget has grown back to what it was
            load.send(srv.url, load.Request("again", "completion", False, tuple(range(3000, 3064)), 8), timeout_s=300)
            again = elastic.Sampler(srv.url).sample()
        kills = lim.oom_kills()
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert kills == 0, log[-3000:]
    assert hog.get("held") == "held" and hog.get("rc") == 0, hog
    assert got.predicted_n == 240
    # the process's memory was seen: the kernel counts it in the cgroup's anonymous memory (with what the
    # server gave back by then), and the server's free memory fell by what the cgroup's anonymous and mapped
    # memory grew; the server's own memory moves a little between the two readings
    grew = hog["stat"]["anon"] - stat0["anon"]
    held = grew + hog["stat"]["mapped"] - stat0["mapped"]
    assert grew >= 0.8 * hog_mib, (stat0, hog)
    assert before["free_mib"] - hog["during"]["free_mib"] == pytest.approx(held, abs=8), (before, stat0, hog)
    # and the budget gave way to it
    assert after["yields"] > before["yields"], (before, after, log[-3000:])
    assert "moe-stream: budget yields to" in log
    # and took it back once the process exited
    assert after["grows"] + again["grows"] > before["grows"], (before, after, again)
    assert again["budget_mib"] >= before["budget_mib"] - 0.5, (before, again)
    # the answer is the stock engine's, without the tier and without a limit
    with server.running_server(model, limit=None, log_path=tmp_path / "stock.log", tier=(),
                                extra=[*flags, "--no-repack"]) as ref_srv:
        ref = load.send(ref_srv.url, req, timeout_s=600)
    assert got.ids == ref.ids and got.text == ref.text

