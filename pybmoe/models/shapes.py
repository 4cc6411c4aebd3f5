"""Shape presets of real MoE models, for synthetic models of a real model's shape.

``pybmoe make-model OUT --like NAME`` writes a :mod:`pybmoe.models` model (``qwen3moe``
architecture, deterministic random weights, the pinned Qwen2 vocab) with the MoE shape of a
published model: layers, experts, top-k, hidden size, expert FFN size and attention heads, so
that the expert bytes, the per-token cycle (layers × top-k) and the cache's memory cost are those
of the real model. With ``--moe-route-replay`` the routing can then be a real trace's.

Each preset cites the published ``config.json`` it was read from. What is *not* reproduced:

- the architecture: every preset is written as ``qwen3moe`` (gpt-oss's attention sinks,
  sliding window, biased clamped SwiGLU experts and MXFP4 storage, granitemoe's scaling
  multipliers are not modelled; the MoE layer is qwen3moe's gate/up/down SiLU);
- the vocabulary: the generator always embeds the pinned Qwen2 vocab (151,936 tokens), so
  ``n_vocab`` below is recorded for reference and the token embedding's size differs for
  gpt-oss (201,088) and granite (49,152);
- the expert storage type: the published checkpoints are BF16 (gpt-oss: MXFP4 experts); here
  it is ``Q8_0`` or ``Q4_K`` (or ``F16``).

Full shapes are large: :func:`estimate_bytes` gives the file size before anything is written,
and ``--layers N`` (and ``--embd`` / ``--ff``) shrink a preset for CPU runs.

Errors: :class:`ValueError` for an unknown preset or a shape the type cannot store (e.g.
gpt-oss-20b's 2880-wide rows are not a multiple of Q4_K's 256-element block).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import writer as models


@dataclass(frozen=True)
class Shape:
    """The MoE shape of a published model.

    Units: ``n_layer`` MoE blocks, ``n_expert`` experts per layer, ``top_k`` experts routed per
    token, ``n_embd`` (hidden size) / ``n_ff_exp`` (one expert's FFN width) / ``head_dim``
    elements, ``n_head`` / ``n_head_kv`` heads, ``n_vocab`` tokens (reference only, see the
    module docstring). ``source`` is the config file the numbers come from.
    """

    name: str
    n_layer: int
    n_expert: int
    top_k: int
    n_embd: int
    n_ff_exp: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    source: str

    def spec(self, *, ftype: str = "Q8_0", seed: int = 0, n_layer: int | None = None, n_embd: int | None = None,
             n_ff_exp: int | None = None, n_expert: int | None = None, top_k: int | None = None) -> models.ModelSpec:
        """The :class:`pybmoe.models.ModelSpec` of this shape; each field given (not None) overrides the
        preset's (units as in the class docstring).

        Raises :class:`ValueError` (from ``ModelSpec``) for a field out of its range (e.g. a ``top_k``
        above the experts) or when ``ftype`` cannot store the rows.
        """
        def pick(v: int | None, preset: int) -> int:
            return preset if v is None else v
        return models.ModelSpec(n_layer=pick(n_layer, self.n_layer), n_expert=pick(n_expert, self.n_expert),
                                n_expert_used=pick(top_k, self.top_k), n_embd=pick(n_embd, self.n_embd),
                                n_ff_exp=pick(n_ff_exp, self.n_ff_exp), n_head=self.n_head,
                                n_head_kv=self.n_head_kv, head_dim=self.head_dim, ftype=ftype, seed=seed)


#: The presets. Numbers are the published config's ``num_hidden_layers``, ``num_experts`` /
#: ``num_local_experts``, ``num_experts_per_tok``, ``hidden_size``, ``moe_intermediate_size``
#: (qwen3) / ``intermediate_size`` (gpt-oss, granitemoe: the per-expert width),
#: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (granite: hidden / heads) and
#: ``vocab_size``.
PRESETS: dict[str, Shape] = {s.name: s for s in (
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    Shape("qwen3-30b-a3b", n_layer=48, n_expert=128, top_k=8, n_embd=2048, n_ff_exp=768, n_head=32, n_head_kv=4,
          head_dim=128, n_vocab=151936, source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json"),
    # https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
    Shape("qwen3-235b-a22b", n_layer=94, n_expert=128, top_k=8, n_embd=4096, n_ff_exp=1536, n_head=64, n_head_kv=4,
          head_dim=128, n_vocab=151936, source="https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json"),
    # https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json
    Shape("gpt-oss-20b", n_layer=24, n_expert=32, top_k=4, n_embd=2880, n_ff_exp=2880, n_head=64, n_head_kv=8,
          head_dim=64, n_vocab=201088, source="https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json"),
    # https://huggingface.co/ibm-granite/granite-3.0-1b-a400m-base/blob/main/config.json
    # (the routing trace in shared/data comes from the instruct variant, same shape, vocab 49155)
    Shape("granite-3.0-1b-a400m", n_layer=24, n_expert=32, top_k=8, n_embd=1024, n_ff_exp=512, n_head=16,
          n_head_kv=8, head_dim=64, n_vocab=49152,
          source="https://huggingface.co/ibm-granite/granite-3.0-1b-a400m-base/blob/main/config.json"),
)}


def preset(name: str) -> Shape:
    """The preset called ``name``. Raises :class:`ValueError` naming the accepted presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown shape preset {name!r}; accepted: {', '.join(PRESETS)}") from None


def estimate_bytes(spec: models.ModelSpec, n_vocab: int | None = None) -> tuple[int, int]:
    """``(tensor bytes of the whole file, expert bytes)`` of the model ``spec`` describes,
    without writing it. The GGUF header (with the vocab: about 9 MiB for the pinned Qwen2 vocab)
    and alignment padding come on top.

    ``n_vocab`` defaults to the pinned vocab's token count (what the generator embeds).
    """
    if n_vocab is None:
        kvs = models.tokenizer_kvs(models.default_vocab_path())
        n_vocab = len(next(kv.value for kv in kvs if kv.key == "tokenizer.ggml.tokens"))
    total = 0
    for _, shape, qtype in models.tensor_plan(spec, n_vocab):
        rows = 1
        for d in shape[1:]:
            rows *= d
        total += rows * models.row_bytes(shape[0], qtype)
    experts = spec.n_layer * spec.n_expert * models.expert_bytes(spec)
    return total, experts


def estimate_file_bytes(spec: models.ModelSpec, vocab_path: str | os.PathLike | None = None) -> int:
    """Bytes of the GGUF file the generator writes for ``spec`` with ``vocab_path`` (default: the pinned
    vocab), without writing it: :func:`estimate_bytes`' tensors plus the header, whose bulk is the vocab's
    tokenizer pairs, as large as the vocab GGUF itself (a file of those pairs and no tensor). Within
    0.1 MiB of the file for the tiny models (alignment padding and the model's own few keys are left
    out). Raises :class:`FileNotFoundError` without the vocab."""
    vocab = Path(vocab_path) if vocab_path is not None else models.default_vocab_path()
    n_vocab = len(next(kv.value for kv in models.tokenizer_kvs(vocab) if kv.key == "tokenizer.ggml.tokens"))
    return estimate_bytes(spec, n_vocab)[0] + vocab.stat().st_size


def write_like(name: str, out: str | Path, *, ftype: str = "Q8_0", seed: int = 0, n_layer: int | None = None,
               n_embd: int | None = None, n_ff_exp: int | None = None, vocab_path: str | Path | None = None) -> Path:
    """Write a model of preset ``name``'s shape (optionally reduced) to ``out``; returns the path.

    Raises :class:`ValueError` (unknown preset, a shape the type cannot store),
    :class:`FileNotFoundError` (no vocab file).
    """
    spec = preset(name).spec(ftype=ftype, seed=seed, n_layer=n_layer, n_embd=n_embd, n_ff_exp=n_ff_exp)
    return models.write_model(spec, out, vocab_path=vocab_path)
