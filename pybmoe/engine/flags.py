"""The engine's flags for the two things pybmoe sets on every run: the expert cache
(:func:`cache_args`) and the split layout, experts in host memory and every layer on a device
(:func:`host_experts_args`)."""
from __future__ import annotations


#: ``--moe-expert-cache-admit second-miss`` without ``:W``: the window, steps (llama-moe.h; docs/traces.md
#: "Admission" measured it). tests/build/test_abi.py holds both to the header.
LLAMA_MOE_CACHE_ADMIT_WINDOW_DEFAULT = 4
#: the longest admission window the engine takes, steps (llama-moe.h)
LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX = 1024


def parse_admit(admit: str) -> int:
    """The admission window in steps of ``--moe-expert-cache-admit``'s value: ``"always"`` is 0,
    ``"second-miss"`` :data:`LLAMA_MOE_CACHE_ADMIT_WINDOW_DEFAULT`, ``"second-miss:W"`` W.

    Raises:
        ValueError: anything else, or W outside 1 .. :data:`LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX`.
    """
    if admit == "always":
        return 0
    if admit == "second-miss":
        return LLAMA_MOE_CACHE_ADMIT_WINDOW_DEFAULT
    if isinstance(admit, str) and admit.startswith("second-miss:"):
        w = admit[len("second-miss:"):]
        if w.isdigit() and 1 <= int(w) <= LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX:
            return int(w)
    raise ValueError(f"admit={admit!r}: expected 'always', 'second-miss' or 'second-miss:W' with W in "
                     f"1 .. {LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX} steps")


def cache_args(slots: int, inserts: int = 0, sync: bool = False, admit: str = "always") -> list[str]:
    """Engine flags for a cache of ``slots`` slots per layer and ``inserts`` uploads per layer per step;
    ``sync`` adds ``--moe-expert-cache-sync`` (deterministic upload visibility, for exact replay);
    ``admit`` other than ``"always"`` adds ``--moe-expert-cache-admit`` (:func:`parse_admit`).

    Raises:
        ValueError: a negative or non-integer value, or a bad ``admit``.
    """
    for name, v in (("slots", slots), ("inserts", inserts)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    window = parse_admit(admit)
    return ["--moe-expert-cache", str(slots), "--moe-expert-cache-inserts", str(inserts),
            *(["--moe-expert-cache-sync"] if sync else []),
            *(["--moe-expert-cache-admit", f"second-miss:{window}"] if window else [])]


def host_experts_args(rpc_endpoint: str) -> list[str]:
    """Flags that put every layer on the RPC device and keep the experts in host memory.

    ``--no-repack`` keeps host experts in the GGUF layout, so host and device run the same
    CPU kernels and the split is bit-exact.
    """
    return ["--rpc", rpc_endpoint, "-ngl", "99", "--cpu-moe", "--no-repack"]
