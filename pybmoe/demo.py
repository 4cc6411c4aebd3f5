"""The main job on the embedded default model, on any machine.

A loopback ``ggml-rpc-server`` stands in for the GPU. Every layer is offloaded to
it while the experts stay in host memory (``--cpu-moe``), exactly the layout big
MoE models run in. The same greedy request is answered with the expert cache off
and on; the texts must be byte-identical, and the cache's hit rate is reported.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from . import engine

DEFAULT_PROMPT = "The expert cache keeps recently used experts on the device, so"


@dataclass(frozen=True)
class RunResult:
    """One greedy ``/completion`` through ``llama-server``."""

    slots: int                            # --moe-expert-cache
    inserts: int                          # --moe-expert-cache-inserts
    text: str                             # generated text
    tokens_predicted: int                 # tokens
    decode_tok_s: float                   # server-reported decode speed, tokens/s
    summary: engine.CacheSummary | None   # the moe-cache line (None when the cache is off)
    log: str


def server_args(model: Path, rpc_endpoint: str, slots: int, inserts: int = 0, extra: list[str] | None = None) -> list[str]:
    """llama-server flags for the demo layout: layers on the device, experts on the host."""
    return ["-m", str(model), *engine.host_experts_args(rpc_endpoint), *engine.cache_args(slots, inserts),
            "-c", "1024", "-np", "1", "-t", "2", "--no-warmup", *(extra or [])]


def run_once(model: Path, rpc_endpoint: str, slots: int, inserts: int, prompt: str, n_predict: int,
             extra: list[str] | None = None) -> RunResult:
    srv = engine.LlamaServer(server_args(model, rpc_endpoint, slots, inserts, extra))
    with srv:
        r = srv.completion(prompt, n_predict=n_predict)
    log = srv.stop()
    sums = engine.parse_cache_summaries(log)
    if slots > 0 and not sums:
        raise engine.EngineError(f"the cache was asked for ({slots} slots) but printed no summary:\n{log[-3000:]}")
    timings = r.get("timings", {})
    return RunResult(slots, inserts, r["content"], int(r.get("tokens_predicted", 0)),
                     float(timings.get("predicted_per_second", 0.0)), sums[-1] if sums else None, log)


def run_demo(model: Path | None = None, slots: int | None = None, inserts: int = 0,
             prompt: str = DEFAULT_PROMPT, n_predict: int = 64, out=print) -> tuple[RunResult, RunResult]:
    """Cache off, then on, on the same request. Returns both results.

    slots defaults to half the experts of the model (the embedded model has 16).
    """
    from . import models
    model = Path(model) if model else models.default_model_path()
    if slots is None:
        slots = models.read_spec(model).n_expert // 2
    engine.cache_args(slots, inserts)  # bad values fail here, before anything starts
    if n_predict < 2:
        raise ValueError(f"n_predict must be >= 2 tokens, got {n_predict}")
    with engine.RpcServer() as rpc:
        out(f"device: loopback ggml-rpc-server at {rpc.endpoint}; model: {model}")
        off = run_once(model, rpc.endpoint, 0, 0, prompt, n_predict)
        on = run_once(model, rpc.endpoint, slots, inserts, prompt, n_predict)
    same = off.text == on.text
    out(f"cache off : {off.tokens_predicted} tokens, {off.decode_tok_s:.1f} tok/s decode")
    s = on.summary
    out(f"cache on  : {on.tokens_predicted} tokens, {on.decode_tok_s:.1f} tok/s decode, {slots} slots/layer, "
        f"inserts {inserts or 'unlimited'}: {s.hit_pct:.1f}% hit, resident {s.resident_mib:.1f} MiB, "
        f"uploads {s.uploads} ({s.upload_mib:.1f} MiB)")
    out(f"output    : {'IDENTICAL' if same else 'DIFFERENT'} ({len(on.text.encode())} bytes)")
    out(f"text      : {on.text[:200]!r}  (random weights: the text is noise; what matters is that it is identical)")
    return off, on


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pybmoe demo", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF (default: the embedded tiny qwen3moe)")
    ap.add_argument("--slots", type=int, help="expert cache slots per layer (default: half the experts)")
    ap.add_argument("--inserts", type=int, default=0, help="uploads per layer per step (0 = unlimited)")
    ap.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default: 64)")
    ap.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    a = ap.parse_args(argv)
    try:
        off, on = run_demo(a.model, a.slots, a.inserts, a.prompt, a.n_predict)
    except (engine.EngineError, ValueError, FileNotFoundError) as e:
        print(f"pybmoe demo: error: {e}", file=sys.stderr)
        return 2
    return 0 if off.text == on.text else 1
