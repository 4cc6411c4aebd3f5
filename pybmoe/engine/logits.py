"""``pybmoe-logits``, the engine's test driver: greedy tokens, raw logits and the cache's per-layer
hits and misses of one run (:func:`run_logits`)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .binaries import EngineError, find_binary


@dataclass
class LogitsRun:
    """One ``pybmoe-logits`` run: greedy ``tokens``, the raw ``logits`` (n_vocab float32 per decode
    step, native byte order), the VRAM tier's per-layer ``layers`` (il -> (hits, misses)), the
    ``log`` (stdout + stderr) and the stream tier's per-layer ``stream_layers`` (il -> (hits,
    misses))."""

    tokens: list[int]
    logits: bytes
    layers: dict[int, tuple[int, int]]
    log: str
    stream_layers: dict[int, tuple[int, int]] = field(default_factory=dict)


def run_logits(model: str | os.PathLike, out: str | os.PathLike, args: list[str], *, prompt: str = "Hello there",
               n_predict: int = 8, ctx: int | None = 256, timeout: float = 300,
               bin_dir: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> LogitsRun:
    """Run ``pybmoe-logits`` on ``model`` (2 threads) with the extra llama.cpp ``args`` (layout, cache
    flags, ``-ub`` ...), writing the logits to ``out``; ``bin_dir`` picks another build (e.g. a Vulkan
    one). ``ctx``: the context in tokens (``-c``, with ``--fit off``), or None for llama.cpp's
    defaults (the model's trained context, ``--fit`` on: the disk tier may fit it). Raises
    :class:`EngineError` (with the command and the log's tail) on a non-zero exit."""
    exe = Path(bin_dir) / "pybmoe-logits" if bin_dir is not None else find_binary("pybmoe-logits")
    sized = ["-c", str(ctx), "--fit", "off"] if ctx is not None else []
    cmd = [str(exe), "--logits-out", str(out), "-m", str(model), "-p", prompt, "-n", str(n_predict),
           *sized, "-t", "2", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise EngineError(f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stderr[-3000:]}")
    tokens, layers, stream_layers = [], {}, {}
    for line in r.stdout.splitlines():
        if line.startswith("token "):
            tokens.append(int(line.split()[1]))
        elif line.startswith("moe-cache-layer "):
            _, il, h, m = line.split()
            layers[int(il)] = (int(h), int(m))
        elif line.startswith("moe-stream-layer "):
            _, il, h, m = line.split()
            stream_layers[int(il)] = (int(h), int(m))
    return LogitsRun(tokens, Path(out).read_bytes(), layers, r.stdout + r.stderr, stream_layers)
