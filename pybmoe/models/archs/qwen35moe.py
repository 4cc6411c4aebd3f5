"""``qwen35moe``: a tiny Qwen3.5/3.6-style hybrid MoE (``LLM_ARCH_QWEN35MOE``) with one MTP block.

The trunk alternates gated-delta-net ("linear attention") blocks with gated full-attention blocks;
every block, and the multi-token-prediction (MTP / "nextn") block after the trunk, has a softmax
router over ``n_expert`` experts plus one shared expert scaled by a sigmoid gate. The MTP block is
what llama.cpp's ``draft-mtp`` speculative mode runs to draft tokens; the main pass never runs it.

**Block count.** ``ModelSpec.n_layer`` is the GGUF ``qwen35moe.block_count`` and, as in
llama.cpp (``n_layer_all``), it *includes* the MTP block: blocks ``0 .. n_layer-2`` are the trunk
(``n_trunk = n_layer - 1``, llama.cpp's ``hparams.n_layer()``) and block ``n_layer-1`` is the MTP
block (``qwen35moe.nextn_predict_layers = 1``). So the default ``n_layer=4`` is 3 trunk blocks + 1 MTP.

Derived hyper-parameters (values at the ModelSpec defaults ``n_layer=4, n_embd=256, n_ff_exp=256,
n_head=4, n_head_kv=2, head_dim=64``), see :func:`derived`:

==================================  ================================  =======
key / quantity                       rule                              default
==================================  ================================  =======
nextn_predict_layers                 1 (llama.cpp's graph takes 1)     1
n_trunk (blocks the main pass runs)  n_layer - 1                       3
full_attention_interval              min(4, n_trunk) (real: 4)         3
gated-delta-net blocks i             i < n_trunk, (i+1) % interval > 0 0, 1
full-attention trunk blocks          the other trunk blocks            2
rope.dimension_count (n_rot)         head_dim // 4 (partial RoPE 1/4)  16
rope.dimension_sections              [s, s, n_rot/2 - 2s, 0],          [3,3,2,0]
                                     s = (n_rot/2 + 2) // 3 (IMRoPE)
ssm.conv_kernel                      4 (as the real models)            4
ssm.state_size (linear head dim)     head_dim (key and value heads)    64
ssm.group_count (linear key heads)   n_head_kv                         2
ssm.time_step_rank (lin. value hds)  n_head                            4
ssm.inner_size                       n_head * head_dim                 256
expert_shared_feed_forward_length    n_ff_exp (as Qwen3.5-35B-A3B)     256
expert_feed_forward_length           n_ff_exp                          256
feed_forward_length                  n_ff_exp * n_expert_used          1024
==================================  ================================  =======

With ``L = head_dim``, ``nk = n_head_kv``, ``nv = n_head``, ``C = (2*nk + nv) * L`` (the conv
channels: q, k, v of the linear block), ``Fs = n_ff_exp``, the file is, in ggml order (``ne0``
first; numpy shapes are reversed)::

    token_embd.weight                 {n_embd, n_vocab}                 Q8_0 (embd_qtype)
    output_norm.weight                {n_embd}                          F32
    (no output.weight: the output head is tied to token_embd; the MTP head uses it too)
  every block N (trunk and MTP):
    blk.N.attn_norm.weight            {n_embd}                          F32
    blk.N.post_attention_norm.weight  {n_embd}                          F32
  gated-delta-net trunk block:
    blk.N.attn_qkv.weight             {n_embd, C}                       ftype
    blk.N.attn_gate.weight            {n_embd, nv * L}                  ftype (the z gate)
    blk.N.ssm_conv1d.weight           {4, C}                            F32
    blk.N.ssm_dt.bias                 {nv}                              F32 (ones)
    blk.N.ssm_a                       {nv}                              F32 (-A, A ~ U[1, 16))
    blk.N.ssm_beta.weight             {n_embd, nv}                      ftype
    blk.N.ssm_alpha.weight            {n_embd, nv}                      ftype
    blk.N.ssm_norm.weight             {L}                               F32
    blk.N.ssm_out.weight              {nv * L, n_embd}                  ftype (_fit)
  full-attention trunk block and the MTP block:
    blk.N.attn_q.weight               {n_embd, 2 * n_head * head_dim}   ftype (query + output gate)
    blk.N.attn_k.weight               {n_embd, n_head_kv * head_dim}    ftype
    blk.N.attn_v.weight               {n_embd, n_head_kv * head_dim}    ftype
    blk.N.attn_output.weight          {n_head * head_dim, n_embd}       ftype (_fit)
    blk.N.attn_q_norm.weight          {head_dim}                        F32
    blk.N.attn_k_norm.weight          {head_dim}                        F32
  every block N (trunk and MTP):
    blk.N.ffn_gate_inp.weight         {n_embd, n_expert}                F32 (the router)
    blk.N.ffn_gate_exps.weight        {n_embd, n_ff_exp, n_expert}      ftype
    blk.N.ffn_up_exps.weight          {n_embd, n_ff_exp, n_expert}      ftype
    blk.N.ffn_down_exps.weight        {n_ff_exp, n_embd, n_expert}      ftype
    blk.N.ffn_gate_inp_shexp.weight   {n_embd}                          F32 (sigmoid gate)
    blk.N.ffn_gate_shexp.weight       {n_embd, Fs}                      ftype
    blk.N.ffn_up_shexp.weight         {n_embd, Fs}                      ftype
    blk.N.ffn_down_shexp.weight       {Fs, n_embd}                      ftype
  the MTP block only (N = n_layer - 1):
    blk.N.nextn.eh_proj.weight        {2 * n_embd, n_embd}              ftype
    blk.N.nextn.enorm.weight          {n_embd}                          F32
    blk.N.nextn.hnorm.weight          {n_embd}                          F32
    blk.N.nextn.shared_head_norm.weight {n_embd}                        F32
    (no nextn.embed_tokens / nextn.shared_head_head: both fall back to token_embd, as for the
    real Qwen3.5 checkpoints, whose MTP block shares the embedding and LM head)

Gate and up experts are separate tensors: the pinned converter splits the checkpoints' fused
``gate_up_proj`` into ``ffn_gate_exps`` / ``ffn_up_exps`` (``conversion/qwen.py:104-117``) and only
fuses with ``--fuse-gate-up-exps``; the loader takes either (``create_tensor_gate_up_exps``,
``src/llama-model.cpp:3387``). At the defaults the file is about 60 MiB (Q8_0).

What the pinned llama.cpp expects (paths under ``vendor/src/<pin>/vendor/llama.cpp``):

- ``src/llama-model.cpp:1335-1338``: ``block_count`` -> ``n_layer_all``, ``nextn_predict_layers`` ->
  ``n_layer_nextn``; ``src/llama-hparams.cpp:348``: ``n_layer() = n_layer_all - n_layer_nextn``.
- ``src/models/qwen35moe.cpp:4-33``: hparams (expert / shared-expert FFN lengths, RMS eps, required
  ``rope.dimension_sections``, the five ``ssm.*`` keys, recurrent layers from
  ``full_attention_interval`` with the MTP block forced non-recurrent, line 24).
- ``src/models/qwen35moe.cpp:36-147``: tensors; the trunk (``load_block_trunk``, line 54; the linear
  block's head dims are ``ssm.state_size`` for keys *and* values, so ``ssm.inner_size`` must be
  ``state_size * time_step_rank``) and the MTP block (``load_block_mtp``, line 106), whose tensors
  are ``TENSOR_SKIP`` unless the model is loaded with ``load_mtp`` (line 41) -- i.e. they are
  loaded only under ``--spec-type draft-mtp`` (``common/common.cpp:1685``) and logged as "unused
  tensor ... ignoring" otherwise.
- ``src/models/qwen35moe.cpp:149-154, 550-741``: the ``LLM_GRAPH_TYPE_DECODER_MTP`` graph (asserts
  exactly one nextn block, line 554); ``src/llama-model.cpp:2668-2723, 2800-2811``: the MTP
  context gets a plain attention KV cache over the MTP block, the main context a hybrid
  (KV + recurrent) one over the trunk only.
- ``src/llama-arch.cpp``: key strings (``%s.nextn_predict_layers`` line 226,
  ``%s.full_attention_interval`` line 250, ``%s.ssm.*`` lines 347-351) and tensor names (lines
  464-500, ``blk.%d.nextn.*`` lines 588-593).
- ``ggml/src/ggml-cuda/gated_delta_net.cu:190-219``: the CUDA gated delta net exists only for a
  value head size of 16, 32, 64 or 128 (hence the ``head_dim`` check of :func:`validate`).

Draft-MTP speculation on a generated file (greedy; ``--spec-type draft-mtp`` needs no draft model:
the MTP block of the same GGUF is the draft; ``--spec-draft-n-max`` drafts per step, default 3)::

    llama-server -m q35.gguf -c 512 -t 2 --fit off --spec-type draft-mtp --spec-draft-n-max 3 \\
        --temp 0 --port PORT
    curl -s localhost:PORT/completion -d '{"prompt": "Hello there", "n_predict": 32,
        "temperature": 0, "top_k": 1}'         # "timings": {"draft_n": ..., "draft_n_accepted": ...}

``llama-cli`` takes the same flags (``llama-cli -m q35.gguf -c 512 -t 2 --fit off --spec-type draft-mtp
--spec-draft-n-max 3 --temp 0 -p "Hello there" -n 16 -st --simple-io``) but prints no draft counts.

Without ``--spec-type draft-mtp`` the MTP tensors are not loaded, so ``--moe-expert-cache`` sees
``n_layer - 1`` MoE layers; with it the MTP block's experts are cached too (``n_layer`` layers) and
the MTP draft context shares the target model's cache.

Errors: :func:`validate` raises :class:`ValueError` naming the value and the accepted range.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from pybmoe.models.writer import ArchDef, ModelSpec, _fit, embd_qtype, register_arch

ARCH = "qwen35moe"

#: MTP blocks after the trunk; llama.cpp's qwen35moe MTP graph supports exactly one.
N_NEXTN = 1
#: Gated-delta-net causal conv width (``ssm.conv_kernel``), as in the real Qwen3.5 models.
SSM_CONV_KERNEL = 4
#: Full-attention interval of the real models; shrunk to the trunk length for short trunks.
FULL_ATTENTION_INTERVAL = 4
#: Value head sizes the CUDA gated-delta-net kernel is instantiated for.
LINEAR_HEAD_DIMS = (16, 32, 64, 128)


@dataclass(frozen=True)
class Qwen35MoeDims:
    """The hyper-parameters :mod:`pybmoe.models.archs.qwen35moe` derives from a :class:`ModelSpec`.

    Units: ``n_trunk`` / ``n_nextn`` blocks; ``rope_dim`` and ``rope_sections`` rotated dimensions
    (sections in dimension pairs); ``linear_head_dim``, ``ssm_inner``, ``conv_channels`` and
    ``n_ff_shexp`` elements; ``linear_k_heads`` / ``linear_v_heads`` heads; ``recurrent`` has one
    flag per GGUF block (``n_layer`` of them, the MTP block last and never recurrent).
    """

    n_trunk: int
    n_nextn: int
    full_attention_interval: int
    recurrent: tuple[bool, ...]
    rope_dim: int
    rope_sections: tuple[int, int, int, int]
    ssm_conv_kernel: int
    linear_head_dim: int
    linear_k_heads: int
    linear_v_heads: int
    ssm_inner: int
    conv_channels: int
    n_ff_shexp: int


def derived(spec: ModelSpec) -> Qwen35MoeDims:
    """The derived hyper-parameters of ``spec`` (see the module docstring's table)."""
    n_trunk = spec.n_layer - N_NEXTN
    interval = min(FULL_ATTENTION_INTERVAL, n_trunk)
    recurrent = tuple(i < n_trunk and (i + 1) % interval != 0 for i in range(spec.n_layer))
    rope_dim = spec.head_dim // 4
    pairs = rope_dim // 2
    s = (pairs + 2) // 3
    lin = spec.head_dim
    return Qwen35MoeDims(
        n_trunk=n_trunk,
        n_nextn=N_NEXTN,
        full_attention_interval=interval,
        recurrent=recurrent,
        rope_dim=rope_dim,
        rope_sections=(s, s, pairs - 2 * s, 0),
        ssm_conv_kernel=SSM_CONV_KERNEL,
        linear_head_dim=lin,
        linear_k_heads=spec.n_head_kv,
        linear_v_heads=spec.n_head,
        ssm_inner=spec.n_head * lin,
        conv_channels=(2 * spec.n_head_kv + spec.n_head) * lin,
        n_ff_shexp=spec.n_ff_exp,
    )


def validate(spec: ModelSpec) -> None:
    """Raise :class:`ValueError` for a shape qwen35moe cannot take.

    ``n_layer`` (GGUF blocks, MTP included) must be >= 3, so the trunk has a gated-delta-net and a
    full-attention block; ``head_dim`` (also the linear-attention head size) must be 16, 32, 64 or
    128 (the CUDA gated-delta-net kernels; it also gives RoPE ``head_dim // 4`` dimensions split in
    three non-empty IMRoPE sections). Non-integer fields are left to :class:`ModelSpec`'s checks.
    """
    vals = (spec.n_layer, spec.head_dim)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in vals):
        return
    if spec.n_layer < 2 + N_NEXTN:
        raise ValueError(
            f"n_layer={spec.n_layer} is too small for {ARCH}: it counts the {N_NEXTN} MTP block too and the trunk "
            f"needs a gated-delta-net and a full-attention block; accepted: >= {2 + N_NEXTN}")
    if spec.head_dim not in LINEAR_HEAD_DIMS:
        raise ValueError(
            f"head_dim={spec.head_dim} is not supported by {ARCH} (it is also the gated-delta-net head size); "
            f"accepted: {', '.join(map(str, LINEAR_HEAD_DIMS))}")


def _attention(spec: ModelSpec, p: str) -> list[tuple[str, tuple[int, ...], QT]]:
    q, E = spec.qtype, spec.n_embd
    nq, nkv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    return [
        (p + "attn_q.weight", (E, 2 * nq), q),
        (p + "attn_k.weight", (E, nkv), q),
        (p + "attn_v.weight", (E, nkv), q),
        (p + "attn_output.weight", (nq, E), _fit(q, nq)),
        (p + "attn_q_norm.weight", (spec.head_dim,), QT.F32),
        (p + "attn_k_norm.weight", (spec.head_dim,), QT.F32),
    ]


def _linear_attention(spec: ModelSpec, d: Qwen35MoeDims, p: str) -> list[tuple[str, tuple[int, ...], QT]]:
    q, E = spec.qtype, spec.n_embd
    nv = d.linear_v_heads
    return [
        (p + "attn_qkv.weight", (E, d.conv_channels), q),
        (p + "attn_gate.weight", (E, d.ssm_inner), q),
        (p + "ssm_conv1d.weight", (d.ssm_conv_kernel, d.conv_channels), QT.F32),
        (p + "ssm_dt.bias", (nv,), QT.F32),
        (p + "ssm_a", (nv,), QT.F32),
        (p + "ssm_beta.weight", (E, nv), q),
        (p + "ssm_alpha.weight", (E, nv), q),
        (p + "ssm_norm.weight", (d.linear_head_dim,), QT.F32),
        (p + "ssm_out.weight", (d.ssm_inner, E), _fit(q, d.ssm_inner)),
    ]


def _moe(spec: ModelSpec, d: Qwen35MoeDims, p: str) -> list[tuple[str, tuple[int, ...], QT]]:
    q, E, F, X, Fs = spec.qtype, spec.n_embd, spec.n_ff_exp, spec.n_expert, d.n_ff_shexp
    return [
        (p + "ffn_gate_inp.weight", (E, X), QT.F32),
        (p + "ffn_gate_exps.weight", (E, F, X), q),
        (p + "ffn_up_exps.weight", (E, F, X), q),
        (p + "ffn_down_exps.weight", (F, E, X), q),
        (p + "ffn_gate_inp_shexp.weight", (E,), QT.F32),
        (p + "ffn_gate_shexp.weight", (E, Fs), q),
        (p + "ffn_up_shexp.weight", (E, Fs), q),
        (p + "ffn_down_shexp.weight", (Fs, E), _fit(q, Fs)),
    ]


def tensor_plan(spec: ModelSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], QT]]:
    """``(name, ggml shape (ne0 first), type)`` of every tensor, in file order (the module docstring's table)."""
    d = derived(spec)
    E = spec.n_embd
    plan: list[tuple[str, tuple[int, ...], QT]] = [
        ("token_embd.weight", (E, n_vocab), embd_qtype(spec)),
        ("output_norm.weight", (E,), QT.F32),
    ]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (E,), QT.F32), (p + "post_attention_norm.weight", (E,), QT.F32)]
        plan += _linear_attention(spec, d, p) if d.recurrent[i] else _attention(spec, p)
        plan += _moe(spec, d, p)
        if i >= d.n_trunk:  # the MTP block
            plan += [
                (p + "nextn.eh_proj.weight", (2 * E, E), _fit(spec.qtype, 2 * E)),
                (p + "nextn.enorm.weight", (E,), QT.F32),
                (p + "nextn.hnorm.weight", (E,), QT.F32),
                (p + "nextn.shared_head_norm.weight", (E,), QT.F32),
            ]
    return plan


def add_kvs(spec: ModelSpec, w) -> None:
    """The qwen35moe keys of ``spec`` beyond the shared ones :func:`pybmoe.models.write_model` writes."""
    d = derived(spec)
    w.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_shared_feed_forward_length(d.n_ff_shexp)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    # exact strings of src/llama-arch.cpp (older gguf packages lack the writer methods)
    w.add_key_value(f"{ARCH}.nextn_predict_layers", d.n_nextn, VT.UINT32)
    w.add_key_value(f"{ARCH}.full_attention_interval", d.full_attention_interval, VT.UINT32)
    w.add_rope_dimension_count(d.rope_dim)
    w.add_key_value(f"{ARCH}.rope.dimension_sections", list(d.rope_sections), VT.ARRAY, sub_type=VT.INT32)
    w.add_ssm_conv_kernel(d.ssm_conv_kernel)
    w.add_ssm_inner_size(d.ssm_inner)
    w.add_ssm_state_size(d.linear_head_dim)
    w.add_ssm_time_step_rank(d.linear_v_heads)
    w.add_ssm_group_count(d.linear_k_heads)


def init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
    """Values of the gated-delta-net decay tensors (numpy shape = reversed ggml ``shape``); ``None``
    (the generator's default) for everything else.

    ``ssm_a`` is ``-A`` with ``A ~ U[1, 16)`` per value head (a decay, so the recurrent state
    stays bounded); ``ssm_dt.bias`` is ones (the Qwen3-Next initialisation).
    """
    np_shape = tuple(reversed(shape))
    if name.endswith(".ssm_a"):
        return (-rng.uniform(1.0, 16.0, size=np_shape)).astype(np.float32)
    if name.endswith(".ssm_dt.bias"):
        return np.ones(np_shape, np.float32)
    return None


ARCH_DEF = register_arch(ArchDef(
    ARCH, tensor_plan, add_kvs, init=init, validate=validate,
    doc="Qwen3.5/3.6 hybrid MoE: gated-delta-net + gated attention, shared expert, 1 MTP block (in n_layer)"))
