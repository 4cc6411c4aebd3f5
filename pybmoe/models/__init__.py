"""The models layer: tiny, deterministic, real-architecture MoE models in GGUF.

- :mod:`.writer`: the GGUF writer and reader (the ``qwen3moe`` / ``qwen3`` plans, quantization,
  :class:`ModelSpec`, the model cache); its public names are re-exported here, so
  ``from pybmoe import models; models.default_model_path()`` is the API;
- :mod:`.archs`: one module per further architecture, each registering with
  :func:`register_arch` (imported here, so every architecture is known once this package is);
- :mod:`.shapes`: shape presets of published MoE models (``make-model --like``).

Imports only ``pybmoe.build`` (the pinned tree's vocab file) below it (``tests/test_layering.py``).
"""
from __future__ import annotations

from .writer import (ARCHES, FTYPES, GENERATOR_VERSION, GRANITE_TRACE_SPEC, KV, MAX_EXPERTS, MAX_LAYERS, QK_K,
                     RMS_EPS, ROPE_FREQ_BASE, VOCAB_FILE, ArchDef, Metadata, ModelFileError, ModelSpec, MoeShape, TensorInfo,
                     attention_plan, cache_dir, cached_model_file, cached_model_path, check_complete, check_gguf,
                     copy_with_tensor_values, default_model_path,
                     default_vocab_path, embd_qtype, expert_bytes, make_model, quantize, quantize_q4_k,
                     read_metadata, read_spec, split_files, read_tensor, register_arch, row_bytes, tensor_nbytes,
                     tensor_plan, tokenizer_kvs, write_model)
from . import archs  # noqa: E402,F401  (the architectures register themselves with the writer)

__all__ = ["ARCHES", "FTYPES", "GENERATOR_VERSION", "GRANITE_TRACE_SPEC", "KV", "MAX_EXPERTS", "MAX_LAYERS", "QK_K",
           "RMS_EPS", "ROPE_FREQ_BASE", "VOCAB_FILE", "ArchDef", "Metadata", "ModelFileError", "ModelSpec", "MoeShape", "TensorInfo",
           "attention_plan", "cache_dir", "cached_model_file", "cached_model_path", "check_complete", "check_gguf",
           "copy_with_tensor_values", "default_model_path",
           "default_vocab_path", "embd_qtype", "expert_bytes", "make_model", "quantize", "quantize_q4_k",
           "read_metadata", "read_spec", "split_files", "read_tensor", "register_arch", "row_bytes", "tensor_nbytes", "tensor_plan", "tokenizer_kvs",
           "write_model"]
