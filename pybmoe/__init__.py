"""pybmoe: llama.cpp with a device-resident LRU cache of MoE experts, packaged for Python.

``pybmoe.Llama`` is ``llama_cpp.Llama`` with expert placement (``cpu_moe``, ``n_cpu_moe``,
``override_tensor``, ``rpc_servers``) and the expert cache (``moe_expert_cache``); see
:mod:`pybmoe.engine.bindings`. The command line is ``pybmoe --help``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # imported lazily: the CLI and the tools do not need the llama_cpp bindings loaded
    if name in ("Llama", "MoeCacheStats", "MoeStreamStats"):
        from .engine import bindings
        return getattr(bindings, name)
    raise AttributeError(f"module 'pybmoe' has no attribute {name!r}")
