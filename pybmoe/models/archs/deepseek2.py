"""``deepseek2``: llama.cpp's ``LLM_ARCH_DEEPSEEK2`` (DeepSeek-V2/V3 style), tiny and deterministic.

Multi-head latent attention (MLA, stored split for the absorbed MQA path), a leading dense
layer (from 3 layers on), routed experts plus one shared expert, DeepSeek-V3 routing: sigmoid scores, a per-expert
selection bias (``exp_probs_b``) added for the top-k choice only, grouped top-k (4 groups, the
best 2 kept), normalized top-k weights times a routed scaling factor of 2.5.

Layout of the file, in ggml order (``ne0`` first; numpy shapes are reversed). ``H`` = ``n_head``,
``D`` = ``head_dim``, ``R`` = ``n_rot``, ``N`` = ``D - R``, ``Lq`` = ``q_lora_rank``, ``Lkv`` =
``kv_lora_rank`` (derived below)::

    token_embd.weight              {n_embd, n_vocab}          Q8_0 (F16 if n_embd % 32)
    output_norm.weight             {n_embd}                   F32
    (no output.weight: the output head is tied to token_embd)
    blk.N.attn_norm.weight         {n_embd}                   F32
    blk.N.attn_q_a_norm.weight     {Lq}                       F32
    blk.N.attn_kv_a_norm.weight    {Lkv}                      F32
    blk.N.attn_q_a.weight          {n_embd, Lq}               ftype
    blk.N.attn_q_b.weight          {Lq, H * D}                fit(ftype, Lq)
    (lite layout, n_layer 26/27: blk.N.attn_q.weight {n_embd, H * D} ftype instead of the
     three attn_q_a* tensors above)
    blk.N.attn_kv_a_mqa.weight     {n_embd, Lkv + R}          ftype
    blk.N.attn_k_b.weight          {N, Lkv, H}                fit(ftype, N)
    blk.N.attn_v_b.weight          {Lkv, D, H}                fit(ftype, Lkv)
    blk.N.attn_output.weight       {H * D, n_embd}            fit(ftype, H * D)
    blk.N.ffn_norm.weight          {n_embd}                   F32
    dense layer (N < n_dense_lead):
    blk.N.ffn_gate.weight          {n_embd, n_ff_dense}       ftype
    blk.N.ffn_up.weight            {n_embd, n_ff_dense}       ftype
    blk.N.ffn_down.weight          {n_ff_dense, n_embd}       fit(ftype, n_ff_dense)
    MoE layer (every other layer):
    blk.N.ffn_gate_inp.weight      {n_embd, n_expert}         F32 (the router)
    blk.N.exp_probs_b.bias         {n_expert}                 F32 (selection bias)
    blk.N.ffn_gate_exps.weight     {n_embd, n_ff_exp, n_expert}  ftype
    blk.N.ffn_up_exps.weight       {n_embd, n_ff_exp, n_expert}  ftype
    blk.N.ffn_down_exps.weight     {n_ff_exp, n_embd, n_expert}  ftype
    blk.N.ffn_gate_shexp.weight    {n_embd, n_ff_exp}         ftype
    blk.N.ffn_up_shexp.weight      {n_embd, n_ff_exp}         ftype
    blk.N.ffn_down_shexp.weight    {n_ff_exp, n_embd}         ftype

``fit(ftype, n)`` is :func:`pybmoe.models.writer._fit`: ``ftype`` when a row of ``n`` elements fills its
blocks, else Q8_0, else F16 (e.g. at the defaults with Q4_K, ``attn_q_b``, ``attn_k_b``,
``attn_v_b`` and ``attn_output`` are Q8_0).

Derived hyperparameters (:func:`hparams`), as ``name = rule -> value at the default spec`` (``n_layer=4,
n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=256, n_head=4, n_head_kv=2, head_dim=64``)::

    key_length_mla        = head_dim                         -> 64   per-head q/k width (qk_nope + qk_rope)
    value_length_mla      = head_dim                         -> 64   per-head v width (v_head_dim)
    n_rot                 = 2 * (head_dim // 4)              -> 32   RoPE part of a q/k head (qk_rope_head_dim)
    n_nope                = head_dim - n_rot                 -> 32   qk_nope_head_dim
    kv_lora_rank          = n_head_kv * head_dim             -> 128  the KV latent is as wide as one K row
                                                                     of the GQA model of the same spec
    q_lora_rank           = max(1, n_embd // 2)              -> 128  0 (lite layout: plain attn_q) when
                                                                     n_layer is 26 or 27, or 48 with a
                                                                     128,256-token vocab: llama.cpp reads
                                                                     no q_lora_rank there
    n_dense_lead          = 1 if n_layer >= 3 else 0         -> 1    DeepSeek's first_k_dense_replace
    n_ff_dense            = n_ff_exp * (n_expert_used + 1)   -> 1280 the active FFN width of a MoE layer
    n_expert_shared       = 1 (of width n_ff_exp)            -> 1
    n_expert_groups       = 4 if grouped else 0              -> 4    grouped: n_expert % 4 == 0,
                                                                     n_expert >= 8, n_expert_used <= n_expert // 2
    n_group_used          = 2 if grouped else 0              -> 2
    expert_gating_func    = 2 (sigmoid)                      -> sigmoid
    expert_weights_norm   = true                             -> true
    expert_weights_scale  = 2.5 (DeepSeek-V3's routed_scaling_factor)

At most one leading dense layer, and only from 3 layers on: llama.cpp's last layer routes only the
output rows of a prompt, so this keeps a MoE layer that routes every token (and at least
``n_layer - 1`` MoE layers). The KV cache holds ``kv_lora_rank + n_rot`` elements per token and
layer (160 at the defaults) as K and none as V (V is a view of K's first ``kv_lora_rank``).

The extra conditions on expert groups come from llama.cpp: ``n_expert_groups < n_expert`` is
asserted, each group is scored by its best two experts, and the top-k is taken among the experts
of the ``n_group_used`` kept groups (more than that would pick masked ``-inf`` experts).

Metadata follows llama.cpp's converter for MLA (``conversion/deepseek.py:325-353``): the KV cache
is MQA with one latent head, so ``attention.head_count_kv = 1``, ``attention.key_length =
kv_lora_rank + n_rot`` and ``attention.value_length = kv_lora_rank``; the per-head sizes go to
``key_length_mla`` / ``value_length_mla``. :func:`pybmoe.models.write_model` writes those three
shared keys from :func:`_attention_lengths` (``ArchDef.attention_lengths``) instead of the spec's
``n_head_kv`` / ``head_dim``; ``n_head_kv`` is used only for ``kv_lora_rank``.

Weights: :func:`pybmoe.models.write_model`'s defaults (normal, std ``1/sqrt(ne0)``; norms 1; the
router ``2/sqrt(n_embd)``), except ``exp_probs_b``: per layer, the ``n_expert`` values
``-0.25 + 0.5 * i / (n_expert - 1)`` (``i = 0 .. n_expert-1``) in an order drawn from the rng
(:func:`_init`). Against sigmoid scores of a router with logit std ~2 that spread changes the
chosen top-k of about 70% of tokens (numpy simulation, 16 experts, top-4, random inputs) while
every expert keeps being picked.

What the pinned llama.cpp (``vendor/src/<pin>/vendor/llama.cpp``) expects:

* hparams: ``src/models/deepseek2.cpp:3-53`` (lite detection :8, ``q_lora_rank`` :13, MLA
  lengths :16-17, shared count :19, weights scale/norm :20-21, gating :22); experts, groups and
  their asserts: ``src/llama-model.cpp:1339-1382``; RoPE type NORM: ``src/llama-model.cpp:3075``.
* tensors: ``src/models/deepseek2.cpp:84-149`` (``exp_probs_b.bias`` :132, optional there, but
  an unread tensor fails the load); names ``src/llama-arch.cpp:452-585``.
* graph: ``src/models/deepseek2.cpp:417-713`` (absorbed MLA :540-592, dense FFN :646-652, MoE +
  shared expert :655-682); routing: ``src/llama-graph.cpp:2009-2170`` (sigmoid :2063, bias for
  selection only :2078-2084, grouped top-k :2097-2122, norm :2153, scale :2168); the K-only MLA
  cache: ``src/llama-kv-cache.cpp:231``, V as a view of K: ``src/llama-graph.cpp:3034``.
* keys: ``src/llama-arch.cpp:201-221,269-286,325``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from pybmoe.models.writer import ArchDef, ModelSpec, _fit, embd_qtype, register_arch

ARCH = "deepseek2"

#: DeepSeek-V3's ``routed_scaling_factor``: the normalized top-k weights are multiplied by it.
ROUTED_SCALE = 2.5
#: ``LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID`` (``src/llama-hparams.h``).
GATING_SIGMOID = 2
#: Half-width of the ``exp_probs_b`` values (they span ``[-EXP_PROBS_B_SPAN, +EXP_PROBS_B_SPAN]``).
EXP_PROBS_B_SPAN = 0.25


@dataclass(frozen=True)
class Hparams:
    """The derived deepseek2 hyperparameters of a :class:`~pybmoe.models.ModelSpec` (see the module docs).

    Units: ranks, widths and dims in elements; ``n_dense_lead`` in blocks; ``n_expert_shared``,
    ``n_expert_groups`` and ``n_group_used`` are counts; ``expert_weights_scale`` is a factor.
    """

    q_lora_rank: int        # 0: lite layout (plain attn_q)
    kv_lora_rank: int
    n_rot: int              # qk_rope_head_dim
    n_nope: int             # qk_nope_head_dim
    head_dim_k: int         # key_length_mla = n_nope + n_rot
    head_dim_v: int         # value_length_mla
    n_dense_lead: int
    n_ff_dense: int
    n_expert_shared: int
    n_expert_groups: int    # 0: no grouped top-k
    n_group_used: int
    gating_func: int
    expert_weights_norm: bool
    expert_weights_scale: float


def _is_lite(n_layer: int, n_vocab: int | None) -> bool:
    # src/models/deepseek2.cpp:8: llama.cpp reads no q_lora_rank for these and expects attn_q
    return n_layer in (26, 27) or (n_layer == 48 and n_vocab == 128256)


def hparams(spec: ModelSpec, n_vocab: int | None = None) -> Hparams:
    """The derived hyperparameters of ``spec``; ``n_vocab`` (tokens) only matters for the lite
    detection of a 48-layer model, see the module docs."""
    n_rot = 2 * (spec.head_dim // 4)
    groups = spec.n_expert % 4 == 0 and spec.n_expert >= 8 and spec.n_expert_used <= spec.n_expert // 2
    return Hparams(
        q_lora_rank=0 if _is_lite(spec.n_layer, n_vocab) else max(1, spec.n_embd // 2),
        kv_lora_rank=spec.n_head_kv * spec.head_dim,
        n_rot=n_rot,
        n_nope=spec.head_dim - n_rot,
        head_dim_k=spec.head_dim,
        head_dim_v=spec.head_dim,
        n_dense_lead=1 if spec.n_layer >= 3 else 0,
        n_ff_dense=spec.n_ff_exp * (spec.n_expert_used + 1),
        n_expert_shared=1,
        n_expert_groups=4 if groups else 0,
        n_group_used=2 if groups else 0,
        gating_func=GATING_SIGMOID,
        expert_weights_norm=True,
        expert_weights_scale=ROUTED_SCALE,
    )


def _validate(spec: ModelSpec) -> None:
    # runs before ModelSpec's own field checks: leave non-integers to them
    hd = spec.head_dim
    if not isinstance(hd, (int, np.integer)) or isinstance(hd, bool):
        return
    if hd < 4:
        raise ValueError(f"head_dim={hd} is too small for deepseek2 (RoPE and non-RoPE parts of at least "
                         f"2 elements each); accepted: an even head_dim >= 4")


def _plan(spec: ModelSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], QT]]:
    q = spec.qtype
    hp = hparams(spec, n_vocab)
    E, F, X, H, D = spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.n_head, spec.head_dim
    Lq, Lkv, R, N = hp.q_lora_rank, hp.kv_lora_rank, hp.n_rot, hp.n_nope
    plan: list[tuple[str, tuple[int, ...], QT]] = [
        ("token_embd.weight", (E, n_vocab), embd_qtype(spec)),
        ("output_norm.weight", (E,), QT.F32),
    ]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        plan.append((p + "attn_norm.weight", (E,), QT.F32))
        if Lq:
            plan.append((p + "attn_q_a_norm.weight", (Lq,), QT.F32))
        plan.append((p + "attn_kv_a_norm.weight", (Lkv,), QT.F32))
        if Lq:
            plan += [
                (p + "attn_q_a.weight", (E, Lq), q),
                (p + "attn_q_b.weight", (Lq, H * D), _fit(q, Lq)),
            ]
        else:
            plan.append((p + "attn_q.weight", (E, H * D), q))
        plan += [
            (p + "attn_kv_a_mqa.weight", (E, Lkv + R), q),
            (p + "attn_k_b.weight", (N, Lkv, H), _fit(q, N)),
            (p + "attn_v_b.weight", (Lkv, hp.head_dim_v, H), _fit(q, Lkv)),
            (p + "attn_output.weight", (H * hp.head_dim_v, E), _fit(q, H * hp.head_dim_v)),
            (p + "ffn_norm.weight", (E,), QT.F32),
        ]
        if i < hp.n_dense_lead:
            Fd = hp.n_ff_dense
            plan += [
                (p + "ffn_gate.weight", (E, Fd), q),
                (p + "ffn_up.weight", (E, Fd), q),
                (p + "ffn_down.weight", (Fd, E), _fit(q, Fd)),
            ]
            continue
        Fs = F * hp.n_expert_shared
        plan += [
            (p + "ffn_gate_inp.weight", (E, X), QT.F32),
            (p + "exp_probs_b.bias", (X,), QT.F32),
            (p + "ffn_gate_exps.weight", (E, F, X), q),
            (p + "ffn_up_exps.weight", (E, F, X), q),
            (p + "ffn_down_exps.weight", (F, E, X), q),
            (p + "ffn_gate_shexp.weight", (E, Fs), q),
            (p + "ffn_up_shexp.weight", (E, Fs), q),
            (p + "ffn_down_shexp.weight", (Fs, E), _fit(q, Fs)),
        ]
    return plan


def _put_u32(w: "gguf.GGUFWriter", method: str, suffix: str, value: int) -> None:
    """``w.<method>(value)``, or the raw ``<arch>.<suffix>`` UINT32 key on a gguf without the method."""
    fn = getattr(w, method, None)
    if fn is not None:
        fn(value)
    else:
        w.add_key_value(f"{w.arch}.{suffix}", value, VT.UINT32)


def _kvs(spec: ModelSpec, w: "gguf.GGUFWriter") -> None:
    hp = hparams(spec)
    w.add_feed_forward_length(hp.n_ff_dense)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_shared_count(hp.n_expert_shared)
    w.add_leading_dense_block_count(hp.n_dense_lead)
    if hp.q_lora_rank:
        w.add_q_lora_rank(hp.q_lora_rank)
    w.add_kv_lora_rank(hp.kv_lora_rank)
    _put_u32(w, "add_key_length_mla", "attention.key_length_mla", hp.head_dim_k)
    _put_u32(w, "add_value_length_mla", "attention.value_length_mla", hp.head_dim_v)
    w.add_rope_dimension_count(hp.n_rot)
    w.add_expert_weights_scale(hp.expert_weights_scale)
    w.add_expert_weights_norm(hp.expert_weights_norm)
    if hasattr(w, "add_expert_gating_func"):
        w.add_expert_gating_func(gguf.ExpertGatingFuncType(hp.gating_func))
    else:
        w.add_key_value(f"{w.arch}.expert_gating_func", hp.gating_func, VT.UINT32)
    if hp.n_expert_groups:
        _put_u32(w, "add_expert_group_count", "expert_group_count", hp.n_expert_groups)
        _put_u32(w, "add_expert_group_used_count", "expert_group_used_count", hp.n_group_used)


def _attention_lengths(spec: ModelSpec) -> tuple[int, int, int]:
    """MLA runs as MQA over the latent: one KV head of ``kv_lora_rank + n_rot`` keys and
    ``kv_lora_rank`` values (conversion/deepseek.py:325-351)."""
    hp = hparams(spec)
    return 1, hp.kv_lora_rank + hp.n_rot, hp.kv_lora_rank


def exp_probs_b_values(n_expert: int, rng: np.random.Generator) -> np.ndarray:
    """The selection bias of one layer: float32 of shape ``(n_expert,)``, the evenly spaced values
    ``-0.25 .. +0.25`` (all distinct) in the order ``rng.permutation(n_expert)`` draws."""
    ramp = np.linspace(-EXP_PROBS_B_SPAN, EXP_PROBS_B_SPAN, n_expert, dtype=np.float64)
    return ramp[rng.permutation(n_expert)].astype(np.float32)


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
    if name.endswith(".exp_probs_b.bias"):
        return exp_probs_b_values(shape[0], rng)
    return None


register_arch(ArchDef(
    ARCH, _plan, _kvs, init=_init, validate=_validate, attention_lengths=_attention_lengths,
    doc="DeepSeek-V2/V3: MLA attention, 1 leading dense layer, 1 shared expert, sigmoid router with "
        "exp_probs_b selection bias, grouped top-k, scaled normalized weights",
))
