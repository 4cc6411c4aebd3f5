"""The engine's flags for the two things pybmoe sets on every run: the expert cache
(:func:`cache_args`) and the split layout, experts in host memory and every layer on a device
(:func:`host_experts_args`)."""
from __future__ import annotations


def cache_args(slots: int, inserts: int = 0, sync: bool = False) -> list[str]:
    """Engine flags for a cache of ``slots`` slots per layer and ``inserts`` uploads per layer per step;
    ``sync`` adds ``--moe-expert-cache-sync`` (deterministic upload visibility, for exact replay).

    Raises:
        ValueError: a negative or non-integer value.
    """
    for name, v in (("slots", slots), ("inserts", inserts)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return ["--moe-expert-cache", str(slots), "--moe-expert-cache-inserts", str(inserts),
            *(["--moe-expert-cache-sync"] if sync else [])]


def host_experts_args(rpc_endpoint: str) -> list[str]:
    """Flags that put every layer on the RPC device and keep the experts in host memory.

    ``--no-repack`` keeps host experts in the GGUF layout, so host and device run the same
    CPU kernels and the split is bit-exact.
    """
    return ["--rpc", rpc_endpoint, "-ngl", "99", "--cpu-moe", "--no-repack"]
