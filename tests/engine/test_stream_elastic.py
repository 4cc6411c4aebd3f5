"""Memory that follows the work: under the disk tier a context's host KV cache commits memory as its
cells fill, freed cells give their pages back, and the budget follows the memory at run time (the
governor, ggml-ext/llama-moe-governor.h).

The oracles:

- the pages the KV cache holds, as the kernel's page tables say (``/proc/self/pagemap``, read by the
  engine): a 16384-token context costs nothing at creation and what its cells touched after;
- a sequence removed gives its pages back (the engine's count of released bytes, and the committed
  figure falling back);
- a run that fills 92 % of its context gives the tokens and logits of an all-resident run and of the
  static plan (``PYBMOE_MOE_STREAM_ELASTIC=0``), with and without flash attention (whose V is transposed);
- on a fake ``/proc`` tree (``PYBMOE_MEM_ROOT``), memory taken by another process makes the budget yield
  by the rule's arithmetic, recomputed here from the figures its line gives, and it grows back when the
  memory returns.
"""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import pytest

from conftest import write_meminfo
from pybmoe import engine, models
from pybmoe.engine import bindings

SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320, n_ctx_train=16384)
MIB = 2**20
PAGE = os.sysconf("SC_PAGESIZE")
TEXT = ("The stream tier reads experts from the file as the layers need them, and keeps the recent ones. "
        "A context commits memory only as its cells fill, so the experts keep the rest. ")


@pytest.fixture(scope="module")
def model() -> Path:
    return models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))


def test_a_context_commits_its_kv_cache_as_it_fills_and_a_removed_sequence_gives_it_back(model):
    kw = dict(n_gpu_layers=0, n_ubatch=512, n_batch=512, verbose=False, seed=0, flash_attn=True)
    llm = bindings.Llama(model, n_ctx=16384, moe_stream_cache_mb="auto", **kw)
    st = llm.moe_stream_stats()
    assert st.elastic and st.kv_capacity_mib > 8, st
    # the whole capacity exists, none of it is written (the kernel's page tables, /proc/self/pagemap)
    assert st.kv_committed_mib < 0.1, st
    tokens = llm.tokenize((TEXT * 40).encode())[:2048]
    llm.eval(tokens)
    filled = llm.moe_stream_stats()
    per_token = filled.kv_capacity_mib * MIB / 16384
    # each of the 2 layers' K and V holds the written cells' rows, page-rounded at both ends
    assert filled.kv_committed_mib * MIB == pytest.approx(len(tokens) * per_token, abs=2 * 2 * 2 * PAGE), filled
    # removing the sequence gives its pages back
    mem = llm._ctx.memory
    import llama_cpp
    assert llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1)
    emptied = llm.moe_stream_stats()
    assert emptied.kv_committed_mib * MIB <= 2 * 2 * PAGE, emptied
    assert (emptied.kv_released_mib - filled.kv_released_mib) * MIB >= (filled.kv_committed_mib - 0.05) * MIB
    # and the cells fill again, exactly as a fresh context: the same next-token logits
    llm.eval(tokens[:64])
    again = list(llm.scores[63])
    fresh = bindings.Llama(model, n_ctx=16384, moe_stream_cache_mb="auto", **kw)
    fresh.eval(tokens[:64])
    assert again == list(fresh.scores[63])


@pytest.mark.parametrize("fa", ["on", "off"])
def test_a_context_filled_to_92_percent_is_exact(model, tmp_path, fa):
    args = ["-ngl", "0", "--no-repack", "-fa", fa]
    stream = [*args, "--moe-stream-cache-mb", "auto"]
    base = engine.run_logits(model, tmp_path / "base.bin", args, n_predict=470, ctx=512)
    r = engine.run_logits(model, tmp_path / "elastic.bin", stream, n_predict=470, ctx=512)
    static = engine.run_logits(model, tmp_path / "static.bin", stream, n_predict=470, ctx=512,
                               env=dict(os.environ, PYBMOE_MOE_STREAM_ELASTIC="0"))
    assert len(r.tokens) == 470
    assert r.tokens == base.tokens and r.logits == base.logits
    assert static.tokens == base.tokens and static.logits == base.logits
    m = re.search(r"KV caches ([\d.]+) of ([\d.]+) MiB committed", r.log)
    assert m, r.log[-2000:]
    committed, capacity = float(m.group(1)), float(m.group(2))
    assert capacity > 0 and 0.85 * capacity <= committed <= capacity, m.group(0)
    # the static plan commits the whole capacity at creation and has no lazy KV cache to count
    assert re.search(r"KV caches 0\.0 of 0\.0 MiB committed", static.log), static.log[-2000:]


def test_a_default_context_keeps_its_full_size_where_it_fits_beside_the_minimum(model, tmp_path, mem_root):
    """Room for the full default context (16384 tokens) and the tier's minimum, not for the cycle beside
    it: the static plan shrinks the context, the elastic one keeps it and lends its room while it is empty."""
    from test_stream_fit import FLOOR, ctx_mib, fit_line, run
    import gguf
    r = gguf.GGUFReader(str(model))
    dense = sum(int(t.n_bytes) for t in r.tensors if "_exps.weight" not in t.name)
    probe = run(model, tmp_path, None, ["--moe-stream-cache-mb", "auto"], "probe")
    full = ctx_mib(probe.log, 16384)
    least = float(re.search(r"least_mb=([\d.]+)", probe.log).group(1))
    cycle = float(re.search(r"cache_cycle_mb=([\d.]+)", probe.log).group(1))
    avail_mib = (dense + FLOOR) / MIB + full + least + 1.0
    assert least + 1.0 < cycle * 1.1, (least, cycle)
    root = mem_root(tmp_path, avail_mib=avail_mib, total_mib=1000)
    static = run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "static")
    assert "-> shrunk to" in fit_line(static.log), fit_line(static.log)
    el = run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "elastic", elastic=True)
    line = fit_line(el.log)
    assert "the default context (16384 tokens)" in line and ": kept" in line, line
    now, when_full = (float(x) for x in re.search(r"budget ([\d.]+) MiB now .*?, ([\d.]+) MiB when every context is "
                                                   r"full", line).groups())
    assert least <= when_full < cycle * 1.1 and now > when_full, line
    assert re.search(r"^n_ctx 16384 n_seq", el.log, re.M), el.log[-2000:]
    base = run(model, tmp_path, None, [], "base", ctx=16384)
    assert el.tokens == base.tokens and el.logits == base.logits


def metrics(srv: engine.LlamaServer) -> dict[str, float]:
    out = {}
    for line in srv.get("/metrics").splitlines():
        m = re.match(r"llamacpp:(moe_stream_\w+) ([\d.e+]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_the_budget_yields_to_another_process_and_grows_back(model, tmp_path, mem_root):
    root = mem_root(tmp_path, avail_mib=600, total_mib=1000)
    srv = engine.LlamaServer(["-m", str(model), "-ngl", "0", "--no-repack", "-c", "4096", "-np", "1", "-t", "2",
                              "--moe-stream-cache-mb", "auto", "--metrics"], env={"PYBMOE_MEM_ROOT": str(root)})
    with srv:
        srv.completion(TEXT, n_predict=8)
        m0 = metrics(srv)
        assert m0["moe_stream_free_bytes"] == 600 * MIB and m0["moe_stream_yields_total"] == 0, m0
        # another process takes all but the floor (64 MiB under a 1000 MiB MemTotal) and 2 MiB
        write_meminfo(root, 66, total_mib=1000)
        srv.completion(TEXT, n_predict=8)
        m1 = metrics(srv)
        write_meminfo(root, 600, total_mib=1000)
        srv.completion(TEXT, n_predict=8)
        m2 = metrics(srv)
    log = srv.stop()
    assert m1["moe_stream_free_bytes"] == 66 * MIB
    assert m1["moe_stream_yields_total"] >= 1 and m1["moe_stream_budget_bytes"] < m0["moe_stream_budget_bytes"], (m0, m1)
    # the rule, from the figures its line gives (MiB, rounded): the budget gave what the slack lacked, plus half
    # a step, in whole entries; never under the minimum
    line = next(ln for ln in log.splitlines() if "moe-stream: budget yields to" in ln)
    g = re.search(r"from ([\d.]+) MiB at the last line\): (\d+) MiB free now, (\d+) MiB of it still to be filled by "
                  r"the tier, (\d+) MiB kept free", line)
    assert g, line
    was, free, unfilled, reserve = float(g.group(1)), *(int(x) for x in g.group(2, 3, 4))
    assert free == 66 and reserve >= 64
    entry = float(re.search(r"entry_mb=([\d.]+)", log).group(1))
    least = float(re.search(r"least_mb=([\d.]+)", log).group(1))
    step = float(re.search(r"steps of ([\d.]+) MiB", line).group(1))
    lack = unfilled + reserve - free + step / 2
    want = max(least, was - lack)
    got = float(re.search(r"budget yields to ([\d.]+) MiB", line).group(1))
    assert got == pytest.approx(want, abs=2 * entry + 1.5), (line, want)
    # the memory came back: the budget grows back to what auto gives beside the context
    assert m2["moe_stream_grows_total"] >= 1 and m2["moe_stream_budget_bytes"] == m0["moe_stream_budget_bytes"], (m0, m2)
    assert "moe-stream: budget grows to" in log


def test_the_stats_carry_the_elastic_fields():
    names = {f for f, _ in bindings.MoeStreamStatsC._fields_}
    assert {"kv_committed_bytes", "kv_capacity_bytes", "kv_released_bytes", "free_bytes", "n_yields", "n_grows",
            "elastic"} <= names
    assert ctypes.sizeof(bindings.MoeStreamStatsC) % 8 == 0
