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


GRANITE_TRACE = Path(__file__).resolve().parent / "data" / "granite-3.0-1b-a400m-routing.json"


def granite_replay(workload: str = "english_prose") -> tuple[Path, Path, int]:
    """The bundled granite routing trace as an engine replay file, and a model of its shape.

    Returns ``(model, trace_csv, prompt_tokens)``: the granite-shaped tiny model
    (:data:`models.GRANITE_TRACE_SPEC`: 24 layers, 32 experts, top-8), the trace with
    ``workload`` first (its prefill, then its 64 decode tokens; the other prompts follow), and
    the number of prefill tokens of ``workload`` (a prompt of that many tokens lines the engine's
    decode steps up with the trace's decode tokens). Both files are cached in
    :func:`models.cache_dir`. Raises ValueError for an unknown workload.
    """
    import pandas as pd

    from . import models, trace
    tr = trace.read_granite_json(GRANITE_TRACE)
    names = list(dict.fromkeys(tr.frame.workload.astype(str)))  # file order
    if workload not in names:
        raise ValueError(f"workload {workload!r} is not in the granite trace; accepted: {', '.join(names)}")
    f = tr.frame
    order = [workload] + [n for n in names if n != workload]
    frame = pd.concat([f[f.workload == n] for n in order], ignore_index=True)
    csv = models.cache_dir() / f"granite-routing-{workload}.csv"
    if not csv.is_file():
        trace.write_trace(trace.from_frame(frame, tr.meta), csv)
    n_prompt = int(f[(f.workload == workload) & (f.phase == "prefill")].token.nunique())
    return models.cached_model_path(models.GRANITE_TRACE_SPEC), csv, n_prompt


def run_demo(model: Path | None = None, slots: int | None = None, inserts: int = 0,
             prompt: str = DEFAULT_PROMPT, n_predict: int = 64, out=print,
             route_replay: str | None = None) -> tuple[RunResult, RunResult]:
    """Cache off, then on, on the same request. Returns both results.

    slots defaults to half the experts of the model (the embedded model has 16).
    route_replay: ``"granite"`` replays the bundled granite-3.0-1b-a400m routing trace on a model of
    its shape (24 layers, 32 experts, top-8), so the hit rate reflects real routing locality rather
    than random weights; any other value is a trace file (``--moe-trace`` CSV) replayed on
    ``model``. Both runs replay it (``--moe-route-replay``).
    """
    from . import models
    extra: list[str] = []
    req: str | list[int] = prompt
    if route_replay == "granite":
        gmodel, csv, n_prompt = granite_replay()
        model = Path(model) if model else gmodel
        extra = ["--moe-route-replay", str(csv)]
        req = [1000 + i for i in range(n_prompt)]  # token ids: the trace's prefill length
    elif route_replay:
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
        off = run_once(model, rpc.endpoint, 0, 0, req, n_predict, extra)
        on = run_once(model, rpc.endpoint, slots, inserts, req, n_predict, extra)
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
    ap.add_argument("--route-replay", metavar="granite|FILE",
                    help="replay real routing: 'granite' = the bundled granite-3.0-1b-a400m trace on a model of its "
                         "shape (24 layers, 32 experts, top-8); or a --moe-trace CSV for the model")
    a = ap.parse_args(argv)
    try:
        off, on = run_demo(a.model, a.slots, a.inserts, a.prompt, a.n_predict, route_replay=a.route_replay)
    except (engine.EngineError, ValueError, FileNotFoundError) as e:
        print(f"pybmoe demo: error: {e}", file=sys.stderr)
        return 2
    return 0 if off.text == on.text else 1
