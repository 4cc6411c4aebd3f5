"""``gemma4``: llama.cpp's ``LLM_ARCH_GEMMA4`` in its MoE form (the 26B-A4B layout), tiny.

What sets it apart for an expert cache, all present in every layer:

* the routed experts' gate and up halves are ONE fused tensor, ``ffn_gate_up_exps``
  (``ne1 = 2 * n_ff_exp``: rows ``0 .. n_ff_exp-1`` are the gate, the rest the up
  projection), with a GELU-gated (GEGLU) activation instead of SwiGLU;
* a per-expert output scale, ``ffn_down_exps.scale`` (``{n_expert}`` F32), multiplied onto
  each selected expert's down-projection output before the routing weight;
* a dense "shared expert" (``ffn_gate`` / ``ffn_up`` / ``ffn_down``) that runs beside the
  routed experts on every token; both branches get their own post-norm and are summed;
* a router that reads the un-normed residual: ``logits = ffn_gate_inp @ (rms_norm(x) /
  sqrt(n_embd) * ffn_gate_inp.scale)``, softmax, top-k, renormalised.

Layout of the file, in ggml order (``ne0`` first; numpy shapes are reversed). ``E = n_embd``,
``F = n_ff_exp``, ``X = n_expert``, ``D = head_dim``, ``q = spec.ftype``::

    token_embd.weight              {E, n_vocab}              Q8_0 (F16 if E % 32); tied output head
    output_norm.weight             {E}                       F32, ones
    rope_freqs.weight              {D / 2}                   F32, ones (full-attention layers only)
    blk.N.attn_norm.weight         {E}                       F32, ones
    blk.N.attn_q.weight            {E, n_head * D}           q
    blk.N.attn_k.weight            {E, n_head_kv * D}        q
    blk.N.attn_v.weight            {E, n_head_kv * D}        q
    blk.N.attn_output.weight       {n_head * D, E}           q, else Q8_0, else F16 (row fit)
    blk.N.attn_q_norm.weight       {D}                       F32, ones
    blk.N.attn_k_norm.weight       {D}                       F32, ones
    blk.N.post_attention_norm.weight {E}                     F32, ones
    blk.N.layer_output_scale.weight {1}                      F32, 1.0
    blk.N.ffn_norm.weight          {E}                       F32, ones (shared-expert input norm)
    blk.N.ffn_gate.weight          {E, F}                    q   (shared expert)
    blk.N.ffn_up.weight            {E, F}                    q   (shared expert)
    blk.N.ffn_down.weight          {F, E}                    q   (shared expert)
    blk.N.post_ffw_norm.weight     {E}                       F32, ones (after shared + routed)
    blk.N.ffn_gate_inp.weight      {E, X}                    F32 (the router), std 2/sqrt(E)
    blk.N.ffn_gate_inp.scale       {E}                       F32, sqrt(E) (router input scale)
    blk.N.pre_ffw_norm_2.weight    {E}                       F32, ones (routed-expert input norm)
    blk.N.post_ffw_norm_1.weight   {E}                       F32, ones (shared-expert output norm)
    blk.N.post_ffw_norm_2.weight   {E}                       F32, ones (routed-expert output norm)
    blk.N.ffn_gate_up_exps.weight  {E, 2 * F, X}             q   (fused gate | up)
    blk.N.ffn_down_exps.weight     {F, E, X}                 q
    blk.N.ffn_down_exps.scale      {X}                       F32, 1 + expert_id (1, 2, ..., X)

Matmul weights are normal with std ``1/sqrt(ne0)`` from the ``rng`` of
:func:`pybmoe.models.write_model`, so the same spec gives a byte-identical file. The
down scales are ``1 + expert_id`` so that applying the scale zero times or twice (or to the
wrong expert) changes the logits: every MoE output is RMS-normed by ``post_ffw_norm_2``
and the logits are soft-capped at 30, so these values keep the logits finite. The router
input scale is ``sqrt(E)``: it cancels llama.cpp's ``1/sqrt(E)`` so the router sees a
unit-RMS input and its logits have std ~2 (a non-degenerate top-k, like qwen3moe's router).

Derived hyperparameters (metadata keys under ``gemma4.``):

    feed_forward_length            = n_ff_exp   (the shared expert's FF length)
    expert_feed_forward_length     = n_ff_exp
    expert_count / expert_used_count = n_expert / n_expert_used
    attention.sliding_window       = 128 tokens (:data:`SLIDING_WINDOW`)
    attention.sliding_window_pattern = per layer, True = sliding-window layer: layer i is
                                     full attention when i % 6 == 5 or i == n_layer - 1, else
                                     sliding (5 local : 1 global as in the real model, and the
                                     last layer global); n_layer=4 -> [T, T, T, F]
    attention.key_length(_swa)     = head_dim for both kinds of layer (value_length(_swa) too);
                                     the real model has wider global heads, kept equal here so
                                     every layer has a head size the CUDA flash-attention
                                     kernels take
    rope.dimension_count(_swa)     = head_dim (full rotation)
    rope.freq_base                 = 1e6 (full-attention layers; shared key of models/writer.py)
    rope.freq_base_swa             = 1e4 (sliding layers)
    embedding_length_per_layer_input = 0 (no per-layer embeddings: the MoE variant has none)
    final_logit_softcapping        = 30.0
    attention.shared_kv_layers     = not written (0: every layer has its own K/V)

Shapes it cannot take (:func:`validate` raises :class:`ValueError`): ``n_layer < 2``.

What the pinned llama.cpp expects (``vendor/src/<pin>/vendor/llama.cpp``):

* ``src/models/gemma4.cpp:4-35`` hparams: ``attention.sliding_window_pattern`` (an array,
  required), ``attention.sliding_window``, ``embedding_length_per_layer_input``,
  ``attention.key_length_swa`` / ``value_length_swa`` and ``layer_norm_rms_epsilon`` are
  required; ``expert_feed_forward_length``, ``rope.freq_base_swa``,
  ``final_logit_softcapping`` and ``attention.shared_kv_layers`` are optional;
  ``f_attention_scale`` is fixed at 1.0 (no 1/sqrt(head_dim): the q/k norms do the scaling).
* ``src/models/gemma4.cpp:37-142`` tensors: the shared expert and ``post_ffw_norm`` are
  required in every layer (:104-108); a layer is MoE when ``ffn_gate_inp`` exists (:111-112)
  and then needs ``ffn_gate_inp.scale``, ``pre_ffw_norm_2``, ``post_ffw_norm_1/2``, and
  ``ffn_gate_up_exps`` or else separate ``ffn_gate_exps`` + ``ffn_up_exps`` (:123-128);
  ``rope_freqs.weight`` is required once a full-attention layer exists (:94-98);
  ``layer_output_scale`` and ``attn_v`` are optional (:84, :92).
* ``src/llama-model.cpp:1691-1692``: ``ffn_down_exps.scale`` ``{n_expert}`` is picked up by
  the generic per-expert-scale pass for any architecture with ``ffn_down_exps`` (no
  ``ffn_gate_up_exps.scale`` is loaded: ``up_exps_s`` needs a separate ``ffn_up_exps``).
* ``src/models/gemma4.cpp:292-345`` graph: shared-expert GEGLU, router, ``build_moe_ffn``
  with ``LLM_FFN_GELU`` and softmax gating; ``src/llama-graph.cpp:2202-2219`` splits the
  fused output gate-first, ``src/llama-graph.cpp:1568-1575`` multiplies the down scale per
  selected expert.
* ``src/llama-model.cpp:2788-2797``: the KV-cache reuse callback asserts at least 2
  layers; ``src/llama-model.cpp:2815`` (iswa cache) needs at least one sliding layer.
* names: ``src/llama-arch.cpp:444-482`` (tensors), ``:198, :236, :276-304, :325-329`` (keys).
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from pybmoe.models import writer as models

#: Tokens a sliding-window layer attends back over.
SLIDING_WINDOW = 128
#: One full-attention layer every this many layers (the rest slide), plus the last layer.
SWA_PERIOD = 6
#: RoPE base of the sliding-window layers (the full layers use :data:`pybmoe.models.ROPE_FREQ_BASE`).
ROPE_FREQ_BASE_SWA = 10_000.0
#: ``logits = c * tanh(logits / c)``.
FINAL_LOGIT_SOFTCAPPING = 30.0


def sliding_window_pattern(n_layer: int) -> list[bool]:
    """Per layer, True for a sliding-window layer: False at ``i % 6 == 5`` and at the last layer."""
    return [not (i % SWA_PERIOD == SWA_PERIOD - 1 or i == n_layer - 1) for i in range(n_layer)]


def validate(spec: "models.ModelSpec") -> None:
    """Raise :class:`ValueError` for shapes gemma4 cannot take: ``n_layer < 2`` (llama.cpp's
    gemma4 KV cache needs two layers and at least one sliding-window layer)."""
    n = spec.n_layer
    if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n < 2:
        raise ValueError(f"n_layer={n} is out of range for arch='gemma4' (its KV cache needs 2 layers, one of "
                         f"them sliding-window); accepted: >= 2")


def plan(spec: "models.ModelSpec", n_vocab: int) -> list[tuple[str, tuple[int, ...], QT]]:
    """Every tensor as ``(name, ggml shape (ne0 first), type)``, in file order (see the module table)."""
    q = spec.qtype
    E, F, X, D = spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.head_dim
    nq, nkv = spec.n_head * D, spec.n_head_kv * D
    out: list[tuple[str, tuple[int, ...], QT]] = [
        ("token_embd.weight", (E, n_vocab), models.embd_qtype(spec)),
        ("output_norm.weight", (E,), QT.F32),
        ("rope_freqs.weight", (D // 2,), QT.F32),
    ]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (E,), QT.F32),
            (p + "attn_q.weight", (E, nq), q),
            (p + "attn_k.weight", (E, nkv), q),
            (p + "attn_v.weight", (E, nkv), q),
            (p + "attn_output.weight", (nq, E), models._fit(q, nq)),
            (p + "attn_q_norm.weight", (D,), QT.F32),
            (p + "attn_k_norm.weight", (D,), QT.F32),
            (p + "post_attention_norm.weight", (E,), QT.F32),
            (p + "layer_output_scale.weight", (1,), QT.F32),
            # shared expert (a dense GEGLU FFN of n_ff_exp)
            (p + "ffn_norm.weight", (E,), QT.F32),
            (p + "ffn_gate.weight", (E, F), q),
            (p + "ffn_up.weight", (E, F), q),
            (p + "ffn_down.weight", (F, E), models._fit(q, F)),
            (p + "post_ffw_norm.weight", (E,), QT.F32),
            # routed experts
            (p + "ffn_gate_inp.weight", (E, X), QT.F32),
            (p + "ffn_gate_inp.scale", (E,), QT.F32),
            (p + "pre_ffw_norm_2.weight", (E,), QT.F32),
            (p + "post_ffw_norm_1.weight", (E,), QT.F32),
            (p + "post_ffw_norm_2.weight", (E,), QT.F32),
            (p + "ffn_gate_up_exps.weight", (E, 2 * F, X), q),
            (p + "ffn_down_exps.weight", (F, E, X), q),
            (p + "ffn_down_exps.scale", (X,), QT.F32),
        ]
    return out


def add_kvs(spec: "models.ModelSpec", w) -> None:
    """The gemma4 keys (module docstring); key strings are llama.cpp's (``src/llama-arch.cpp``)."""
    a = "gemma4"
    u32, f32 = VT.UINT32, VT.FLOAT32
    w.add_key_value(f"{a}.feed_forward_length", spec.n_ff_exp, u32)
    w.add_key_value(f"{a}.expert_feed_forward_length", spec.n_ff_exp, u32)
    w.add_key_value(f"{a}.expert_count", spec.n_expert, u32)
    w.add_key_value(f"{a}.expert_used_count", spec.n_expert_used, u32)
    w.add_key_value(f"{a}.attention.sliding_window", SLIDING_WINDOW, u32)
    w.add_key_value(f"{a}.attention.sliding_window_pattern", sliding_window_pattern(spec.n_layer), VT.ARRAY,
                    sub_type=VT.BOOL)
    w.add_key_value(f"{a}.attention.key_length_swa", spec.head_dim, u32)
    w.add_key_value(f"{a}.attention.value_length_swa", spec.head_dim, u32)
    w.add_key_value(f"{a}.rope.dimension_count", spec.head_dim, u32)
    w.add_key_value(f"{a}.rope.dimension_count_swa", spec.head_dim, u32)
    w.add_key_value(f"{a}.rope.freq_base_swa", ROPE_FREQ_BASE_SWA, f32)
    w.add_key_value(f"{a}.embedding_length_per_layer_input", 0, u32)
    w.add_key_value(f"{a}.final_logit_softcapping", FINAL_LOGIT_SOFTCAPPING, f32)


_ONES = ("norm.weight", "norm_1.weight", "norm_2.weight", "rope_freqs.weight", "layer_output_scale.weight")


def init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
    """float32 values (numpy shape = reversed ggml ``shape``) of the tensors that are not plain
    normal matmul weights: norms, rope factors and the layer scale are 1, the router input scale is
    ``sqrt(n_embd)``, ``ffn_down_exps.scale`` is ``1 + expert_id``; ``None`` for the rest."""
    if name.endswith("ffn_down_exps.scale"):
        return np.arange(1, shape[0] + 1, dtype=np.float32)
    if name.endswith("ffn_gate_inp.scale"):
        return np.full(shape[::-1], math.sqrt(shape[0]), dtype=np.float32)
    if name.endswith(_ONES):
        return np.ones(shape[::-1], dtype=np.float32)
    return None


ARCH = models.register_arch(models.ArchDef(
    "gemma4", plan, add_kvs, init=init, validate=validate,
    doc="fused gate_up experts (GEGLU), per-expert down scale, shared expert, 5:1 sliding-window attention"))
