"""``gpt-oss`` (llama.cpp's ``LLM_ARCH_OPENAI_MOE``): biased experts, swiglu_oai, attention sinks.

What sets gpt-oss apart for an expert cache is its FFN: every expert has a bias on each of its
three projections (``ffn_{gate,up,down}_exps.bias``, one row per expert, added with
``ggml_add_id`` by the routed expert id), the activation is ``swiglu_oai``
(``g*sigmoid(1.702*g) * (u + 1)`` with the gate ``g`` clamped above at 7 and the up
projection ``u`` to [-7, 7]), and the router has a bias too. The
expert weights are otherwise laid out like qwen3moe's (separate gate/up/down, one 3-D tensor
each); the biases add ``2 * n_ff_exp + n_embd`` float32 per expert (3 KiB at the defaults, next
to 204 KiB of Q8_0 weights), which :func:`pybmoe.models.expert_bytes` does not count.

Layout of the file, in ggml order (``ne0`` first; numpy shapes are reversed)::

    token_embd.weight                 {n_embd, n_vocab}                 Q8_0 (F16 if n_embd % 32)
    output_norm.weight                {n_embd}                          F32
    output.weight                     {n_embd, n_vocab}                 Q4_K (Q8_0 / F16 if n_embd % 256 / % 32)
    blk.N.attn_norm.weight            {n_embd}                          F32
    blk.N.attn_q.weight               {n_embd, n_head * head_dim}       ftype
    blk.N.attn_q.bias                 {n_head * head_dim}               F32
    blk.N.attn_k.weight               {n_embd, n_head_kv * head_dim}    ftype
    blk.N.attn_k.bias                 {n_head_kv * head_dim}            F32
    blk.N.attn_v.weight               {n_embd, n_head_kv * head_dim}    ftype
    blk.N.attn_v.bias                 {n_head_kv * head_dim}            F32
    blk.N.attn_output.weight          {n_head * head_dim, n_embd}       ftype (Q8_0 / F16 fallback, as qwen3moe)
    blk.N.attn_output.bias            {n_embd}                          F32
    blk.N.attn_sinks.weight           {n_head}                          F32 (one sink logit per head)
    blk.N.post_attention_norm.weight  {n_embd}                          F32 (the pre-FFN norm)
    blk.N.ffn_gate_inp.weight         {n_embd, n_expert}                F32 (the router)
    blk.N.ffn_gate_inp.bias           {n_expert}                        F32
    blk.N.ffn_gate_exps.weight        {n_embd, n_ff_exp, n_expert}      ftype
    blk.N.ffn_gate_exps.bias          {n_ff_exp, n_expert}              F32
    blk.N.ffn_up_exps.weight          {n_embd, n_ff_exp, n_expert}      ftype
    blk.N.ffn_up_exps.bias            {n_ff_exp, n_expert}              F32
    blk.N.ffn_down_exps.weight        {n_ff_exp, n_embd, n_expert}      ftype
    blk.N.ffn_down_exps.bias          {n_embd, n_expert}                F32

There are no q/k norms (unlike qwen3moe). gpt-oss has an untied output head and llama.cpp
requires ``output.weight``; it is stored as Q4_K (when ``n_embd`` fills 256-value blocks) so the
second 151,936-row table costs about 21 MiB at ``n_embd=256`` instead of 39 MiB: the default
shape is about 80 MiB (Q8_0; 9 MiB of it the vocab), written in ~3 s. The q/k/v biases are optional in llama.cpp but
present in the released gpt-oss checkpoints, so they are written.

Metadata beyond what :func:`pybmoe.models.write_model` writes for every architecture
(``gpt-oss.*``)::

    expert_feed_forward_length   n_ff_exp                        (required)
    feed_forward_length          n_ff_exp * n_expert_used        (informative, as qwen3moe)
    expert_count                 n_expert
    expert_used_count            n_expert_used
    attention.sliding_window     min(128, n_ctx_train) tokens    (required; 128 as in gpt-oss)

Derived hyperparameters (deterministic functions of the :class:`~pybmoe.models.ModelSpec`):

* sliding window ``min(SLIDING_WINDOW, n_ctx_train)`` = 128 tokens at the defaults. No
  ``sliding_window_pattern`` key is written, so llama.cpp applies its gpt-oss default of 2: even
  layers (0, 2, ...) attend within the window, odd layers attend to the whole context (with
  ``n_layer=1`` the only layer is a sliding one).
* attention sinks: ``linspace(-1, 1, n_head)`` (one logit per head, head 0 lowest; ``[-1]`` for
  one head), so each head's softmax gives up a different share of its mass to the sink.
* expert biases: :func:`expert_bias`, a positive base pattern in [0.05, 0.15] per projection
  plus ``0.1 * expert_id`` (0.05 .. 1.65 at 16 experts, never 0; above 32 experts the step is
  ``3.2 / n_expert``, so the largest bias stays below 3.35 and, even doubled, below swiglu_oai's
  clamp at 7). Nothing about them is random, so a bias added zero times, twice, or with the
  wrong expert's row changes the logits.
* router bias: normal, std :data:`ROUTER_BIAS_STD` (0.5; the router logits have std ~2);
  q/k/v/output biases: normal, std :data:`ATTN_BIAS_STD` (0.1). Both come from the writer's rng
  in file order, like every weight, so the same spec gives a byte-identical file.
* not written, so llama.cpp's defaults hold: RoPE base 1e6 for both the full and the sliding
  layers (``rope.freq_base_swa`` falls back to ``rope.freq_base``), no YaRN scaling, RMS epsilon
  1e-6 (gpt-oss uses 1.5e5 with YaRN and 1e-5; irrelevant for random weights). The swiglu_oai
  constants (alpha 1.702, limit 7.0) and the softmax-over-the-top-k gating are fixed in the
  graph, not metadata.

Shapes it cannot take (:func:`validate` raises :class:`ValueError`): ``n_ctx_train < 1`` (a
sliding window of 0 tokens); every other shape :class:`~pybmoe.models.ModelSpec` accepts loads
and generates.

What llama.cpp expects, in the pinned tree (``vendor/src/<pin>/vendor/llama.cpp``)::

    src/models/openai-moe.cpp:3-20     hparams: rms eps, expert_feed_forward_length (required), sliding_window
                                       (required), SWA type standard with pattern 2, rope.freq_base_swa (optional)
    src/models/openai-moe.cpp:22-55    tensors: output (required, untied), post_attention_norm, attn_sinks {n_head},
                                       attn_output.bias, ffn_gate_inp.bias, ffn_{gate,up,down}_exps.bias
    src/models/openai-moe.cpp:71       build_attn_inp_kv_iswa: interleaved sliding-window KV cache
    src/models/openai-moe.cpp:110-113  build_attn with wo_b and attn_sinks, scale 1/sqrt(head_dim)
    src/models/openai-moe.cpp:132-142  build_moe_ffn with LLM_FFN_SWIGLU_OAI_MOE, SOFTMAX_WEIGHT gating
    src/llama-model.cpp:3404-3439      create_tensor_qkv: separate q/k/v, their biases optional
    src/llama-model.cpp:3161,3185      rope type NEOX
    src/llama-graph.cpp:2009           build_moe_ffn: router bias added to the logits; ggml_add_id of each
                                       expert bias (up, gate before the activation, down after the down
                                       projection); swiglu_oai(alpha 1.702, limit 7.0)
    ggml/src/ggml-cpu/ops.cpp:3533     swiglu_oai: min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)
    src/llama-arch.cpp:464,675         tensor names blk.%d.post_attention_norm, blk.%d.attn_sinks
    src/llama-arch.cpp:206,276         keys %s.expert_feed_forward_length, %s.attention.sliding_window
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from pybmoe.models.writer import ArchDef, ModelSpec, _fit, _normal, embd_qtype, register_arch

ARCH = "gpt-oss"

#: Sliding-window length of the even layers, tokens (capped at ``n_ctx_train``).
SLIDING_WINDOW = 128
#: Std of the router bias ``ffn_gate_inp.bias``.
ROUTER_BIAS_STD = 0.5
#: Std of the attention biases ``attn_{q,k,v,output}.bias``.
ATTN_BIAS_STD = 0.1
#: Per-expert step of :func:`expert_bias` up to :data:`EXPERT_BIAS_FULL_STEP_UP_TO` experts.
EXPERT_BIAS_STEP = 0.1
#: Above this many experts the step shrinks to keep the largest bias below 3.35 (see :func:`expert_bias_step`).
EXPERT_BIAS_FULL_STEP_UP_TO = 32
# base pattern of expert_bias: 0.05 + 0.01 * ((j * stride) % 11), in [0.05, 0.15]; a different
# stride per projection so that one projection's bias applied to another shows
_BIAS_STRIDE = {"gate": 1, "up": 3, "down": 7}


def sliding_window(spec: ModelSpec) -> int:
    """The sliding-window length in tokens: ``min(128, n_ctx_train)``."""
    return min(SLIDING_WINDOW, int(spec.n_ctx_train))


def expert_bias_step(n_expert: int) -> float:
    """The per-expert step of :func:`expert_bias`: 0.1 up to 32 experts, ``3.2 / n_expert`` above.

    The largest bias then stays below 3.2 plus the base (0.15), so even applied twice it stays
    below swiglu_oai's clamp at 7 and the doubling shows in the output.
    """
    return EXPERT_BIAS_STEP * min(1.0, EXPERT_BIAS_FULL_STEP_UP_TO / n_expert)


def expert_bias(kind: str, n_expert: int, n: int) -> np.ndarray:
    """The bias of projection ``kind`` (``"gate"``, ``"up"`` or ``"down"``) of every expert.

    Returns float32 of numpy shape ``(n_expert, n)`` (ggml ``{n, n_expert}``), ``n`` being
    ``n_ff_exp`` for gate/up and ``n_embd`` for down::

        bias[x, j] = 0.05 + 0.01 * ((j * stride) % 11) + step * x
        stride = 1, 3, 7 for gate, up, down;  step = expert_bias_step(n_expert) (0.1 up to 32 experts)

    so every expert's row is its own (row means step by ``step`` from one expert to the next),
    each projection has its own pattern, and the values stay in [0.05, 3.35): never zero, and
    small enough that an expert's gate/up bias, even doubled, stays below swiglu_oai's clamp.
    Raises :class:`ValueError` for another kind.
    """
    if kind not in _BIAS_STRIDE:
        raise ValueError(f"kind={kind!r} is not an expert projection; accepted: {', '.join(_BIAS_STRIDE)}")
    j = np.arange(n, dtype=np.int64)
    base = (0.05 + 0.01 * ((j * _BIAS_STRIDE[kind]) % 11)).astype(np.float32)
    step = np.float32(expert_bias_step(n_expert)) * np.arange(n_expert, dtype=np.float32)
    return (base[None, :] + step[:, None]).astype(np.float32)


def attn_sinks(n_head: int) -> np.ndarray:
    """The sink logits of one layer: float32 of shape ``(n_head,)``, ``linspace(-1, 1, n_head)``."""
    return np.linspace(-1.0, 1.0, n_head, dtype=np.float32) if n_head > 1 else np.full(1, -1.0, np.float32)


def validate(spec: ModelSpec) -> None:
    """Raise :class:`ValueError` for a shape gpt-oss cannot take.

    The one gpt-oss-specific limit is the sliding window: it is ``min(128, n_ctx_train)`` tokens
    and must be at least 1 (with ``attention.sliding_window = 0`` llama.cpp's standard SWA mask
    hides every key, the current token's too). Called by :class:`~pybmoe.models.ModelSpec` before
    its generic checks, so a non-integer is left to those. Every other shape ModelSpec accepts
    loads and generates in the pinned llama.cpp (checked: 1 layer, top-1, top-k = n_expert = 2,
    one head of head_dim 2, head_dim 6, 1024 experts, n_ctx_train 8; Q8_0, Q4_K, F16).
    """
    n_ctx = spec.n_ctx_train
    if isinstance(n_ctx, (int, np.integer)) and not isinstance(n_ctx, bool) and n_ctx < 1:
        raise ValueError(
            f"n_ctx_train={n_ctx} gives gpt-oss a sliding window of {n_ctx} tokens (min({SLIDING_WINDOW}, "
            f"n_ctx_train)); accepted: n_ctx_train >= 1")


def plan(spec: ModelSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], QT]]:
    """Every tensor of a gpt-oss model as ``(name, ggml shape (ne0 first), type)``, in file order
    (the table of the module docstring)."""
    q = spec.qtype
    E, F, X, H = spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.n_head
    nq, nkv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    out: list[tuple[str, tuple[int, ...], QT]] = [
        ("token_embd.weight", (E, n_vocab), embd_qtype(spec)),
        ("output_norm.weight", (E,), QT.F32),
        ("output.weight", (E, n_vocab), _fit(QT.Q4_K, E)),
    ]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (E,), QT.F32),
            (p + "attn_q.weight", (E, nq), q),
            (p + "attn_q.bias", (nq,), QT.F32),
            (p + "attn_k.weight", (E, nkv), q),
            (p + "attn_k.bias", (nkv,), QT.F32),
            (p + "attn_v.weight", (E, nkv), q),
            (p + "attn_v.bias", (nkv,), QT.F32),
            (p + "attn_output.weight", (nq, E), _fit(q, nq)),
            (p + "attn_output.bias", (E,), QT.F32),
            (p + "attn_sinks.weight", (H,), QT.F32),
            (p + "post_attention_norm.weight", (E,), QT.F32),
            (p + "ffn_gate_inp.weight", (E, X), QT.F32),
            (p + "ffn_gate_inp.bias", (X,), QT.F32),
            (p + "ffn_gate_exps.weight", (E, F, X), q),
            (p + "ffn_gate_exps.bias", (F, X), QT.F32),
            (p + "ffn_up_exps.weight", (E, F, X), q),
            (p + "ffn_up_exps.bias", (F, X), QT.F32),
            (p + "ffn_down_exps.weight", (F, E, X), q),
            (p + "ffn_down_exps.bias", (E, X), QT.F32),
        ]
    return out


def add_kvs(spec: ModelSpec, w) -> None:
    """The ``gpt-oss.*`` keys of the module docstring (``w`` is a :class:`gguf.GGUFWriter`)."""
    w.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_sliding_window(sliding_window(spec))


def init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
    """float32 values (numpy shape = reversed ggml ``shape``) of the tensors gpt-oss adds, ``None``
    for the rest (the generator's default: normal with std ``1/sqrt(fan_in)``, norms 1)."""
    np_shape = tuple(reversed(shape))
    if name.endswith("attn_sinks.weight"):
        return attn_sinks(shape[0])
    if name.endswith("_exps.bias"):
        kind = name.rsplit(".", 2)[-2][len("ffn_"):-len("_exps")]
        return expert_bias(kind, shape[1], shape[0])
    if name.endswith("ffn_gate_inp.bias"):
        return _normal(rng, np_shape, ROUTER_BIAS_STD)
    if name.endswith(".bias"):
        return _normal(rng, np_shape, ATTN_BIAS_STD)
    return None


GPT_OSS = register_arch(ArchDef(
    ARCH, plan, add_kvs, init=init, validate=validate,
    doc="separate gate/up/down experts with per-expert biases, swiglu_oai, biased router, attention sinks, "
        "sliding window"))
