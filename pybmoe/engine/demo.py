"""The main job on the embedded default model, on any machine.

A loopback ``ggml-rpc-server`` stands in for the GPU. Every layer is offloaded to
it while the experts stay in host memory (``--cpu-moe``), exactly the layout big
MoE models run in. The same greedy request is answered with the expert cache off
and on; the texts must be byte-identical, and the cache's hit rate is reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import engine

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


def run_once(model: Path, rpc_endpoint: str, slots: int, inserts: int, prompt: str | list[int], n_predict: int,
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
             prompt: str | list[int] = DEFAULT_PROMPT, n_predict: int = 64, out=print,
             route_replay: str | Path | None = None) -> tuple[RunResult, RunResult]:
    """Cache off, then on, on the same request. Returns both results.

    slots defaults to half the experts of the model (the embedded model has 16).
    route_replay: a trace file (``--moe-trace`` CSV) replayed on ``model`` by both runs
    (``--moe-route-replay``), so the hit rate reflects the trace's routing rather than random
    weights. (``pybmoe demo --route-replay granite``, the bundled granite trace on a model of its
    shape, is :func:`pybmoe.cli.demo.run_demo`: the trace is the routing layer's, not the engine's.)
    """
    from .. import models
    extra: list[str] = []
    if route_replay:
        if not Path(route_replay).is_file():
            raise FileNotFoundError(f"route replay trace {route_replay} not found")
        extra = ["--moe-route-replay", str(route_replay)]
    model = Path(model) if model else models.default_model_path()
    if slots is None:
        slots = models.read_spec(model).n_expert // 2
    engine.cache_args(slots, inserts)  # bad values fail here, before anything starts
    if n_predict < 2:
        raise ValueError(f"n_predict must be >= 2 tokens, got {n_predict}")
    with engine.RpcServer() as rpc:
        out(f"device: loopback ggml-rpc-server at {rpc.endpoint}; model: {model}")
        if extra:
            out(f"routing : replayed from {extra[1]}")
        off = run_once(model, rpc.endpoint, 0, 0, prompt, n_predict, extra)
        on = run_once(model, rpc.endpoint, slots, inserts, prompt, n_predict, extra)
    same = off.text == on.text
    out(f"cache off : {off.tokens_predicted} tokens, {off.decode_tok_s:.1f} tok/s decode")
    s = on.summary
    out(f"cache on  : {on.tokens_predicted} tokens, {on.decode_tok_s:.1f} tok/s decode, {slots} slots/layer, "
        f"inserts {inserts or 'unlimited'}: {s.hit_pct:.1f}% hit, resident {s.resident_mib:.1f} MiB, "
        f"uploads {s.uploads} ({s.upload_mib:.1f} MiB)")
    out(f"output    : {'IDENTICAL' if same else 'DIFFERENT'} ({len(on.text.encode())} bytes)")
    out(f"text      : {on.text[:200]!r}  (random weights: the text is noise; what matters is that it is identical)")
    return off, on
