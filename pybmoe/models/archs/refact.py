"""``refact`` (llama.cpp's ``LLM_ARCH_REFACT``) with experts: a model whose experts are never routed.

llama.cpp's refact loader creates a router and expert tensors when the GGUF carries an expert
count (``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``, shaped by ``feed_forward_length``), but the
refact graph computes every layer's FFN with ``build_ffn`` on the dense tensors, which such a model
does not have: the experts are loaded and never used (upstream's own generated refact MoE model,
``tests/test-llama-archs.cpp``, is one). An expert cache on it caches every layer and never serves
a lookup; pybmoe says so with one WARN per layer at the first decode step. This architecture is
here to hold that WARN (``tests/engine/test_cache_sizing.py``), not to be cached.

Layout of the file, in ggml order (``ne0`` first)::

    token_embd.weight                 {n_embd, n_vocab}                 Q8_0 (F16 if n_embd % 32)
    output_norm.weight                {n_embd}                          F32
    blk.N.attn_norm.weight            {n_embd}                          F32
    blk.N.attn_q.weight               {n_embd, n_head * head_dim}       ftype
    blk.N.attn_k.weight               {n_embd, n_head_kv * head_dim}    ftype
    blk.N.attn_v.weight               {n_embd, n_head_kv * head_dim}    ftype
    blk.N.attn_output.weight          {n_head * head_dim, n_embd}       ftype (Q8_0 / F16 fallback)
    blk.N.ffn_norm.weight             {n_embd}                          F32
    blk.N.ffn_gate_inp.weight         {n_embd, n_expert}                F32
    blk.N.ffn_gate_exps.weight        {n_embd, n_ff_exp, n_expert}      ftype
    blk.N.ffn_up_exps.weight          {n_embd, n_ff_exp, n_expert}      ftype
    blk.N.ffn_down_exps.weight        {n_ff_exp, n_embd, n_expert}      ftype

Attention uses ALiBi (no RoPE); the output projection is tied to ``token_embd``.
"""
from __future__ import annotations

from pybmoe.models.writer import QT, ArchDef, ModelSpec, _plan_qwen3moe, register_arch

ARCH = "refact"


def plan(spec: ModelSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], QT]]:
    # qwen3moe's tensors without the per-head q/k norms, which refact does not have
    return [t for t in _plan_qwen3moe(spec, n_vocab) if not t[0].endswith(("attn_q_norm.weight", "attn_k_norm.weight"))]


def add_kvs(spec: ModelSpec, w) -> None:
    # refact shapes its expert tensors by feed_forward_length (not expert_feed_forward_length)
    w.add_feed_forward_length(spec.n_ff_exp)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)


REFACT = register_arch(ArchDef(
    ARCH, plan, add_kvs,
    doc="experts loaded but never routed (the graph is dense): a cache on it never serves, and says so"))
