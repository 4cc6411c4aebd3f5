"""Two contexts of one model, decoding at once from two threads, each get exactly the logits they
get alone, with the stream tier and the VRAM tier on (the tiers belong to the model, so both
contexts share them: one graph at a time per model, see llama-moe-model.h).

The contexts are made through the llama_cpp C API on the model of a pybmoe ``Llama`` (which sets
up the device, the layout and the tiers); each decodes its own token sequence one token per step.
"""
from __future__ import annotations

import ctypes
import threading

import pytest

from pybmoe import engine, models

SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320)
N_STEPS = 40


def _decode(ctx, tokens: list[int], n_vocab: int, out: list[bytes]) -> None:
    import llama_cpp
    for t in tokens:
        arr = (llama_cpp.llama_token * 1)(t)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, 1))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = llama_cpp.llama_get_logits_ith(ctx, -1)
        out.append(ctypes.string_at(logits, n_vocab * 4))


def _context(model):
    import llama_cpp
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 1, 1, 1, 1
    ctx = llama_cpp.llama_init_from_model(model, cp)
    assert ctx
    return ctx


@pytest.mark.parametrize("tiers", ["stream", "vram+stream"])
def test_two_threads_two_contexts_equal_each_alone(rpc, tiers):
    import llama_cpp
    from pybmoe.engine import bindings
    model_path = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    kw = dict(n_ctx=256, n_ubatch=1, verbose=False, repack=False, moe_stream_cache_mb=3)
    if tiers == "vram+stream":
        kw.update(rpc_servers=rpc.endpoint, n_gpu_layers=99, cpu_moe=True, moe_expert_cache=2)
    else:
        kw.update(n_gpu_layers=0)
    llm = bindings.Llama(model_path, **kw)
    model = llm._model.model
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    seqs = [[(97 * i + 13) % 2000 + 100 for i in range(N_STEPS)], [(61 * i + 7) % 2000 + 100 for i in range(N_STEPS)]]
    ctxs = [_context(model), _context(model)]
    try:
        alone = []
        for ctx, seq in zip(ctxs, seqs):
            out: list[bytes] = []
            _decode(ctx, seq, n_vocab, out)
            alone.append(out)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        together = [[], []]
        errors = []

        def run(i):
            try:
                _decode(ctxs[i], seqs[i], n_vocab, together[i])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)  # a hang (the reads of the two steps interleaved) fails here
        assert not errors and not any(t.is_alive() for t in threads), errors
        for i in range(2):
            bad = [s for s in range(N_STEPS) if together[i][s] != alone[i][s]]
            assert not bad, f"context {i}: steps {bad[:5]} differ from the context alone ({tiers})"
        st = llm.moe_stream_stats()
        assert st.hits > 0 and st.misses > 0
        if tiers == "vram+stream":
            cs = llm.moe_cache_stats()
            assert cs.hits > 0 and cs.uploads > 0
    finally:
        for ctx in ctxs:
            llama_cpp.llama_free(ctx)
        llm.close()
