"""The demo, on any machine, in two parts.

The expert cache (:func:`run_demo`): a loopback ``ggml-rpc-server`` stands in for the GPU. Every
layer is offloaded to it while the experts stay in host memory (``--cpu-moe``), exactly the layout
big MoE models run in. The same greedy request is answered with the expert cache off and on; the
texts must be byte-identical, and the cache's hit rate is reported.

The disk tier (:func:`run_stream_demo`): a model larger than a memory limit decodes with stock mmap
and with ``--moe-stream-cache-mb auto``; tokens and logits must be identical, and the ratio of the
decode speeds is reported.

The results go to ``out`` (stdout by default); a progress line goes to stderr before each slow
step (:func:`say`: a model written, a server or benchmark run started).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from .. import engine

DEFAULT_PROMPT = "The expert cache keeps recently used experts on the device, so"


def say(line: str) -> None:
    """Print one progress line of the demo to stderr, at once (``pybmoe demo: LINE``); stdout carries
    only the results."""
    print(f"pybmoe demo: {line}", file=sys.stderr, flush=True)


def ensure_cached_model(spec, what: str, progress=say) -> Path:
    """The cached model of ``spec`` (:func:`pybmoe.models.cached_model_path`), with one ``progress``
    line naming ``what``, its size (MiB) and its path before it is written (nothing when it is
    cached). Raises what :func:`pybmoe.models.write_model` raises."""
    from .. import models
    from ..models import shapes
    path = models.cached_model_file(spec)
    if not path.is_file():
        total = shapes.estimate_file_bytes(spec)  # the tensors and the header (its vocab)
        progress(f"writing {what} (about {total / 2**20:.0f} MiB) to {path} (once; cached for later runs) ...")
    return models.cached_model_path(spec)


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
             route_replay: str | Path | None = None, progress=say) -> tuple[RunResult, RunResult]:
    """Cache off, then on, on the same request. Returns both results.

    slots defaults to half the experts of the model (the embedded model has 16). ``out`` gets the
    result lines; ``progress`` (default :func:`say`, stderr) one line before the model is written
    (when it is not cached yet) and before each of the two ``llama-server`` runs.
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
    model = Path(model) if model else ensure_cached_model(models.ModelSpec(), "the embedded tiny qwen3moe model",
                                                          progress)
    if slots is None:
        slots = models.read_spec(model).n_expert // 2
    engine.cache_args(slots, inserts)  # bad values fail here, before anything starts
    if n_predict < 2:
        raise ValueError(f"n_predict must be >= 2 tokens, got {n_predict}")
    with engine.RpcServer() as rpc:
        out(f"device: loopback ggml-rpc-server at {rpc.endpoint}; model: {model}")
        if extra:
            out(f"routing : replayed from {extra[1]}")
        progress(f"run 1 of 2: llama-server with the expert cache off, {n_predict} tokens ...")
        off = run_once(model, rpc.endpoint, 0, 0, prompt, n_predict, extra)
        progress(f"run 2 of 2: llama-server with the expert cache on ({slots} slots/layer), {n_predict} tokens ...")
        on = run_once(model, rpc.endpoint, slots, inserts, prompt, n_predict, extra)
    same = off.text == on.text
    out(f"cache off : {off.tokens_predicted} tokens, {off.decode_tok_s:.1f} tok/s decode")
    s = on.summary
    out(f"cache on  : {on.tokens_predicted} tokens, {on.decode_tok_s:.1f} tok/s decode, {slots} slots/layer, "
        f"inserts {inserts or 'unlimited'}: {s.hit_pct:.1f}% hit, resident {s.resident_mib:.1f} MiB, "
        f"uploads {s.uploads} ({s.upload_mib:.1f} MiB)")
    out("why       : the loopback device is this same CPU behind a socket, so the cache cannot make decode faster "
        "here (a GPU is where it pays; single runs on a busy machine swing either way); without a GPU the "
        "speed-up to see is the disk tier's (pybmoe demo's second part)")
    out(f"output    : {'IDENTICAL' if same else 'DIFFERENT'} ({len(on.text.encode())} bytes)")
    out(f"text      : {on.text[:200]!r}  (random weights: the text is noise; what matters is that it is identical)")
    return off, on


# --------------------------------------------------------------------------- the disk tier

#: The disk-tier demo's model (written by ``pybmoe-make-synth``, cached): 16 layers, 64 experts,
#: top-8, n_embd 512, expert ff 512, Q8_0: 0.80 MiB per expert, 816 MiB of experts, 0.98 GiB in all.
STREAM_DEMO_SHAPE = dict(n_layer=16, n_expert=64, top_k=8, n_embd=512, n_ff_exp=512, n_head=8, n_head_kv=4,
                         head_dim=64)
#: Its memory limit (MiB): the model is 2.5x larger. Its stream budget: ``auto``, the tier's default
#: (what a user who types only ``--moe-stream-cache-mb auto`` gets; docs/stream-tier.md).
STREAM_DEMO_LIMIT_MIB = 400
#: Its size on disk, MiB (what the progress line before writing it says).
STREAM_DEMO_MIB = 915
STREAM_DEMO_BUDGET_MIB = "auto"


#: The line after the disk tier's ratio.
RATIO_NOTE = ("note      : one run of each, so the ratio swings with the machine's load (a busy machine moves it "
              "either way); pybmoe bench-stream gives medians of repeated runs")


@dataclass(frozen=True)
class StreamDemoResult:
    """The disk-tier part of the demo: decode tok/s of stock mmap and of the stream tier under the
    same limit, their ratio, the tier's hit rate and MiB read per token, and whether the two runs'
    tokens and logits are identical."""

    limit_mib: int | None        # None: no limit could be set here
    mmap_tok_s: float
    stream_tok_s: float
    hit_pct: float
    read_mib_per_token: float
    identical: bool

    @property
    def ratio(self) -> float:
        return self.stream_tok_s / self.mmap_tok_s if self.mmap_tok_s > 0 else float("nan")


def stream_demo_model(progress=say) -> Path:
    """The disk-tier demo's model (:data:`STREAM_DEMO_SHAPE`), written once into the models cache by
    ``pybmoe-make-synth`` (915 MiB, a few seconds), with one ``progress`` line (its size and path)
    before it is written. Raises :class:`EngineError` when it fails."""
    import subprocess
    from .. import models
    s = STREAM_DEMO_SHAPE
    path = models.cache_dir() / (f"pybmoe-synth-L{s['n_layer']}-E{s['n_expert']}-K{s['top_k']}-D{s['n_embd']}"
                                 f"-F{s['n_ff_exp']}-Q8_0.gguf")
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = models.default_vocab_path()
    tmp = path.with_suffix(".tmp")
    cmd = [str(engine.find_binary("pybmoe-make-synth")), str(tmp), "--vocab", str(vocab), "--type", "q8_0",
           "--threads", "2", *[a for k, v in s.items() for a in (f"--{k.replace('_', '-')}", str(v))]]
    progress(f"writing the disk tier's model ({STREAM_DEMO_MIB} MiB) to {path} with pybmoe-make-synth (once; cached "
             f"for later runs) ...")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise engine.EngineError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    tmp.rename(path)
    return path


def _bench_tg(model: Path, n_gen: int, extra: list[str], limit) -> tuple[float, str]:
    import io
    import subprocess

    import pandas as pd
    from . import memlimit
    cmd = [str(engine.find_binary("llama-bench")), "-m", str(model), "-p", "0", "-n", str(n_gen), "-r", "1", "-o", "csv",
           "-v", "-t", "2", "-ngl", "0", "--repack", "0", *extra]
    memlimit.drop_caches()
    if limit is not None:
        cmd = limit.wrap(cmd)
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    text = "\n".join(ln for ln in r.stdout.splitlines() if ln.strip())
    if r.returncode != 0 or not text:
        raise engine.EngineError(f"llama-bench failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return float(pd.read_csv(io.StringIO(text)).avg_ts.iloc[0]), r.stderr


def run_stream_demo(model: Path | None = None, limit_mib: int = STREAM_DEMO_LIMIT_MIB,
                    budget_mib: int | str = STREAM_DEMO_BUDGET_MIB, n_gen: int = 16, out=print,
                    progress=say) -> StreamDemoResult:
    """The disk tier on a model larger than a memory limit: decode with stock mmap, then with
    ``--moe-stream-cache-mb budget_mib`` (MiB, or ``"auto"``: the default), both from a cold page cache under ``limit_mib`` (a cgroup;
    where one cannot be made, both run without it and the demo says so), then the two runs' tokens
    and logits compared (``pybmoe-logits``, no limit). Prints six lines to ``out``, and to ``progress``
    (default :func:`say`, stderr) one line before the model is written (when it is not cached yet)
    and before each run; returns the figures. Raises :class:`EngineError` when a run fails."""
    import tempfile
    from . import memlimit
    model = Path(model) if model else stream_demo_model(progress)
    ok, why = memlimit.limit_available()
    limit = memlimit.MemoryLimit(limit_mib) if ok else None
    size_mib = model.stat().st_size / 2**20
    out(f"disk tier : {model.name} ({size_mib:.0f} MiB) under a {limit_mib} MiB memory limit "
        f"({size_mib / limit_mib:.1f}x larger), cold page cache" if limit else
        f"disk tier : {model.name} ({size_mib:.0f} MiB); no memory limit here ({why}), so mmap does not thrash "
        f"and the ratio below is not the speed-up a small machine sees")
    under = f"under the {limit_mib} MiB limit" if limit else "without a memory limit"
    try:
        progress(f"run 1 of 3: stock mmap {under}, cold page cache, {n_gen} tokens (the slow one: the page cache "
                 f"thrashes) ...")
        mmap_ts, _ = _bench_tg(model, n_gen, [], limit)
        progress(f"run 2 of 3: the disk tier (--moe-stream-cache-mb {budget_mib}) {under}, cold page cache, "
                 f"{n_gen} tokens ...")
        stream_ts, log = _bench_tg(model, n_gen, ["--moe-stream-cache-mb", str(budget_mib)], limit)
    finally:
        if limit is not None:
            limit.close()
    rec = engine.stream_record(log)
    progress("run 3 of 3: tokens and logits of mmap and of the disk tier, 8 tokens each, no limit ...")
    with tempfile.TemporaryDirectory() as d:
        args = ["-ngl", "0", "--no-repack"]
        a = engine.run_logits(model, Path(d) / "a.bin", args, n_predict=8)
        b = engine.run_logits(model, Path(d) / "b.bin", [*args, "--moe-stream-cache-mb", str(budget_mib)], n_predict=8)
    same = a.tokens == b.tokens and a.logits == b.logits
    res = StreamDemoResult(limit_mib if limit else None, mmap_ts, stream_ts, rec["stream_hit_pct"] or 0.0,
                           rec["stream_read_mib_per_token"] or 0.0, same)
    out(f"mmap      : {mmap_ts:.2f} tok/s decode (stock llama.cpp: the page cache thrashes)")
    b = rec.get("stream_budget_after_contexts_mb") or rec.get("stream_budget_mb")
    chosen = f" (chose {b:.0f} MiB)" if budget_mib == "auto" and b else ""
    out(f"stream    : {stream_ts:.2f} tok/s decode, --moe-stream-cache-mb {budget_mib}{chosen}: {res.hit_pct:.1f}% hit, "
        f"{res.read_mib_per_token:.1f} MiB read/token")
    out(f"ratio     : {res.ratio:.2f}x")
    out(RATIO_NOTE)
    out(f"output    : {'IDENTICAL' if same else 'DIFFERENT'} (tokens and logits, mmap vs stream)")
    return res
