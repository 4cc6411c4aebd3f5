"""The engine layer: locate and run the patched llama.cpp binaries.

The names below are the engine's API (``from pybmoe import engine; engine.find_binary(...)``);
each lives in one module of this package:

- :mod:`.binaries`: :data:`BINARIES`, :func:`find_binary`, :func:`bin_dirs`, :class:`EngineError`;
- :mod:`.servers`: the lifecycle of a loopback ``ggml-rpc-server`` (:class:`RpcServer`) and of a
  ``llama-server`` (:class:`LlamaServer`), and :func:`wait_for_endpoint` (``pybmoe serve --rpc``);
- :mod:`.cachelog`: the cache's log lines and ``/metrics`` series, parsed (:func:`cache_record`);
- :mod:`.logits`: one ``pybmoe-logits`` run (:func:`run_logits`);
- :mod:`.flags`: the cache and layout flags (:func:`cache_args`, :func:`host_experts_args`).

Beside them, imported on their own: :mod:`.bindings` (``pybmoe.Llama``, ctypes over the patched
``libllama``), :mod:`.backend_ops` (``test-backend-ops``' duplicate-id cases) and :mod:`.demo`
(cache off against cache on, on the embedded model).

Layer rule (``tests/test_layering.py``): the engine imports only ``pybmoe.models`` and
``pybmoe.build`` below it, never ``pybmoe.routing`` (its sibling) nor anything above.
"""
from __future__ import annotations

from .binaries import BINARIES, EngineError, bin_dirs, find_binary
from .cachelog import (CacheSummary, StreamSummary, cache_record, parse_cache_metrics, parse_cache_preamble,
                       parse_cache_summaries, parse_stream_preamble, parse_stream_summaries, stream_record)
from .flags import cache_args, host_experts_args
from .logits import LogitsRun, run_logits
from .servers import LlamaServer, RpcServer, free_port, split_endpoint, wait_for_endpoint

__all__ = ["BINARIES", "EngineError", "bin_dirs", "find_binary", "CacheSummary", "cache_record",
           "parse_cache_metrics", "parse_cache_preamble", "parse_cache_summaries", "StreamSummary",
           "parse_stream_preamble", "parse_stream_summaries", "stream_record", "cache_args",
           "host_experts_args", "LogitsRun", "run_logits", "LlamaServer", "RpcServer", "free_port",
           "split_endpoint", "wait_for_endpoint"]
