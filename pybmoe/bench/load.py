"""``pybmoe load``: the tiers under concurrent load, checked answer by answer.

One ``llama-server`` with ``-np 8`` and continuous batching runs a churning configuration of the
tiers (:data:`CONFIGS`); client threads send greedy ``/completion`` and ``/v1/chat/completions``
requests, some streamed, with prompts of mixed lengths (31 and 33 tokens among them: the op-offload
boundary at 32). Every answer is compared with the same request run alone on a tier-off server of
the same layout (:func:`compare`): it must be identical, or diverge only at a token where the
reference's top two logprobs are within :data:`NEAR_TIE` (batched kernels round differently;
upstream's parallel tests allow the same). The tiers' ``/metrics`` counters must add up
(:func:`check_counters`). Timings go to CSV (:func:`write_csv`); nothing here asserts a time.

Errors: :class:`LoadError` for a malformed answer or a server that does not answer;
:class:`~pybmoe.engine.EngineError` when a server cannot start.
"""
from __future__ import annotations

import csv
import http.client
import json
import math
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .. import engine
from ..routing import sim

#: Largest gap (nats) between the reference's top two logprobs at which a divergence is accepted.
NEAR_TIE = 2e-2

#: The configurations of the tiers under load: VRAM slots per layer (0: off), the VRAM insert cap,
#: and the disk tier's budget (None: off; "cycle+": just above the cache cycle).
CONFIGS = {
    "off": dict(slots=0, inserts=0, stream=None),
    "vram": dict(slots=6, inserts=1, stream=None),
    "stream": dict(slots=0, inserts=0, stream="cycle+"),
    "both": dict(slots=6, inserts=1, stream="cycle+"),
}

#: Prompt lengths (tokens) of ``/completion`` requests; 31 and 33 straddle the op-offload boundary.
PROMPT_LENGTHS = (1, 7, 20, 31, 32, 33, 50, 90)

_TEXT = ("A model larger than memory streams its experts from the file: each layer reads the experts its "
         "router picked, keeps the recently used ones in RAM, and computes exactly what it would have. "
         "The device keeps the hottest experts in slots, uploads one more per step, and never changes "
         "an answer. Eight clients ask at once; the server batches their tokens into one graph per step.")


class LoadError(RuntimeError):
    """A request that got no well-formed answer (HTTP error, broken stream, timeout)."""


@dataclass(frozen=True)
class Request:
    """One request of the pool: ``kind`` is ``"completion"`` (``prompt``: token ids) or ``"chat"``
    (``prompt``: the user message); ``n_predict`` tokens, greedy; ``stream``: SSE."""

    name: str
    kind: str
    stream: bool
    prompt: tuple[int, ...] | str
    n_predict: int

    def body(self) -> dict:
        """The JSON body: greedy, no prompt cache, the top two logprobs of every token."""
        common = {"temperature": 0, "top_k": 1, "seed": 0, "cache_prompt": False, "stream": self.stream}
        if self.kind == "completion":
            return {**common, "prompt": list(self.prompt), "n_predict": self.n_predict, "n_probs": 2}
        return {**common, "messages": [{"role": "user", "content": self.prompt}], "max_tokens": self.n_predict,
                "logprobs": True, "top_logprobs": 2}

    @property
    def path(self) -> str:
        return "/completion" if self.kind == "completion" else "/v1/chat/completions"


@dataclass
class Answer:
    """A request's answer: generated token ids, their text, the top two logprobs (nats) at each
    token, and the tokens the server evaluated (``prompt_n``) and predicted (``predicted_n``)."""

    ids: list[int]
    text: str
    top2: list[tuple[float, float]]
    prompt_n: int
    predicted_n: int
    latency_s: float = 0.0
    first_s: float = math.nan    # streamed: seconds to the first data chunk (the time to the first token)
    decode_ts: float = math.nan  # the server's own decode tok/s for the request (timings.predicted_per_second)


@dataclass
class Outcome:
    """One request sent under load: ``verdict`` is ``identical``, ``near_tie``, ``wrong`` or
    ``error`` (then ``error`` says why); ``latency_s`` in seconds."""

    client: int
    index: int
    request: str
    verdict: str
    latency_s: float
    error: str = ""
    first_diff: int = -1


def _tokens(entries: list[dict]) -> tuple[list[int], list[tuple[float, float]]]:
    ids, top2 = [], []
    for e in entries:
        ids.append(int(e["id"]))
        lp = sorted((float(t["logprob"]) for t in e.get("top_logprobs", [])), reverse=True) + [-math.inf] * 2
        top2.append((lp[0], lp[1]))
    return ids, top2


def send(url: str, req: Request, timeout_s: float = 120, on_chunk: Callable[[int], bool] | None = None) -> Answer:
    """Sends ``req`` to the server at ``url`` and reads the whole answer (SSE when streamed).

    ``on_chunk(n)`` (streamed only) is called after the n-th data chunk; returning False closes the
    connection there (a client that goes away) and the partial answer is returned.
    Raises :class:`LoadError` on an HTTP error, a malformed answer or after ``timeout_s`` seconds.
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    t0 = time.monotonic()
    try:
        conn.request("POST", req.path, json.dumps(req.body()), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise LoadError(f"{req.name}: HTTP {r.status}: {r.read()[:500]!r}")
        entries, text, timings = [], [], {}
        first_s = math.nan
        if not req.stream:
            d = json.loads(r.read())
            if req.kind == "completion":
                entries, text = d.get("completion_probabilities", []), [d["content"]]
            else:
                ch = d["choices"][0]
                entries, text = (ch.get("logprobs") or {}).get("content") or [], [ch["message"].get("content") or ""]
            timings = d.get("timings", {})
        else:
            n = 0
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    break
                d = json.loads(payload)
                if "error" in d:
                    raise LoadError(f"{req.name}: error in stream: {d['error']}")
                if req.kind == "completion":
                    entries += d.get("completion_probabilities", [])
                    text.append(d.get("content", ""))
                else:
                    for ch in d.get("choices", []):
                        entries += (ch.get("logprobs") or {}).get("content") or []
                        text.append((ch.get("delta") or {}).get("content") or "")
                timings = d.get("timings", timings)
                n += 1
                if n == 1:
                    first_s = time.monotonic() - t0
                if on_chunk is not None and on_chunk(n) is False:
                    break
        ids, top2 = _tokens(entries)
        return Answer(ids, "".join(text), top2, int(timings.get("prompt_n", -1)),
                      int(timings.get("predicted_n", -1)), time.monotonic() - t0, first_s,
                      float(timings.get("predicted_per_second", math.nan)))
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        raise LoadError(f"{req.name}: {type(e).__name__}: {e}") from e
    finally:
        conn.close()


def compare(ref: Answer, got: Answer, tol: float = NEAR_TIE) -> tuple[str, int]:
    """``(verdict, index)``: ``("identical", -1)`` when ids and text match; ``("near_tie", i)`` when
    they first differ at token ``i`` where the reference's top two logprobs are within ``tol``
    nats; else ``("wrong", i)``."""
    if ref.ids == got.ids:
        return ("identical", -1) if ref.text == got.text else ("wrong", len(ref.ids))
    i = next((j for j, (a, b) in enumerate(zip(ref.ids, got.ids)) if a != b), min(len(ref.ids), len(got.ids)))
    if i < len(ref.top2) and i < len(got.ids) and ref.top2[i][0] - ref.top2[i][1] <= tol:
        return "near_tie", i
    return "wrong", i


def make_pool(tokens: Sequence[int], n_predict: Sequence[int] = (4, 8, 16),
              lengths: Sequence[int] = PROMPT_LENGTHS) -> list[Request]:
    """The distinct requests: for every prompt length, a ``/completion`` and a chat request, each
    plain and streamed; ``tokens`` (at least ``max(lengths) + 8`` ids) are cut into the prompts;
    ``n_predict`` cycles.

    Raises:
        ValueError: too few tokens.
    """
    if len(tokens) < max(lengths) + 8:
        raise ValueError(f"make_pool needs at least {max(lengths) + 8} tokens, got {len(tokens)}")
    words = _TEXT.split()
    pool = []
    for i, n in enumerate(lengths):
        for j, (kind, stream) in enumerate([("completion", False), ("completion", True), ("chat", False),
                                            ("chat", True)]):
            k = i * 4 + j
            n_pred = n_predict[k % len(n_predict)]
            if kind == "completion":
                off = (k * 3) % (len(tokens) - n + 1)
                prompt: tuple[int, ...] | str = tuple(tokens[off:off + n])
            else:
                off = (k * 5) % len(words)
                prompt = " ".join((words * 3)[off:off + max(1, n // 2)])
            pool.append(Request(f"{kind}{'-stream' if stream else ''}-p{n}-n{n_pred}", kind, stream, prompt, n_pred))
    return pool


def prompt_tokens(url: str, text: str = _TEXT * 2) -> list[int]:
    """``text`` tokenized by the server at ``url`` (``/tokenize``).

    Raises:
        LoadError: the server did not answer.
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/tokenize", json.dumps({"content": text}), {"Content-Type": "application/json"})
        return list(json.loads(conn.getresponse().read())["tokens"])
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        raise LoadError(f"/tokenize: {e}") from e
    finally:
        conn.close()


def schedule(pool: Sequence[Request], clients: int, per_client: int, seed: int = 0) -> list[list[Request]]:
    """Each client's requests, in order: a seeded shuffle of the pool, repeated."""
    out = []
    for c in range(clients):
        rng = random.Random(seed * 1000 + c)
        out.append([rng.choice(pool) for _ in range(per_client)])
    return out


def run_clients(url: str, plan: list[list[Request]], refs: dict[str, Answer], timeout_s: float = 300,
                tol: float = NEAR_TIE) -> tuple[list[Outcome], float, int]:
    """Runs one thread per client of ``plan``, all at once; returns the outcomes, the wall time
    (seconds) and the requests lost (planned, but with neither an answer nor an error when the
    threads were joined, ``timeout_s`` seconds per request at most)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client(c: int, reqs: list[Request]) -> None:
        for i, req in enumerate(reqs):
            t0 = time.monotonic()
            try:
                a = send(url, req, timeout_s)
                verdict, at = compare(refs[req.name], a, tol)
                o = Outcome(c, i, req.name, verdict, a.latency_s, first_diff=at)
            except LoadError as e:
                o = Outcome(c, i, req.name, "error", time.monotonic() - t0, str(e)[:300])
            with lock:
                outcomes.append(o)

    threads = [threading.Thread(target=client, args=(c, reqs), daemon=True) for c, reqs in enumerate(plan)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    deadline = t0 + timeout_s * max(map(len, plan), default=1)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    wall = time.monotonic() - t0
    with lock:
        done = list(outcomes)
    return done, wall, sum(map(len, plan)) - len(done)


def metrics(url: str) -> dict[str, float]:
    """The ``llamacpp:*`` series of ``/metrics`` (unlabelled ones by name; labelled ones by name
    with their labels), as floats.

    Raises:
        LoadError: the server did not answer.
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException) as e:
        raise LoadError(f"/metrics: {e}") from e
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("llamacpp:")] = float(value)
    return out


def trace_counts(path: Path) -> dict[str, int]:
    """Counts of a ``--moe-trace`` file's lookups: ``rows`` (every lookup), ``vram_hits`` and
    ``vram_misses`` (its ``hit`` column: 1, 0; -1 is a lookup the VRAM tier did not serve) and
    ``stream_hits``, ``stream_misses`` (its ``ram_hit`` column, when present).

    Raises:
        OSError: the file cannot be read.
    """
    out = dict(rows=0, vram_hits=0, vram_misses=0, stream_hits=0, stream_misses=0)
    with open(path, newline="") as f:
        rows = csv.reader(line for line in f if not line.startswith("#"))
        header = next(rows, [])
        hi = header.index("hit") if "hit" in header else None
        ri = header.index("ram_hit") if "ram_hit" in header else None
        for row in rows:
            out["rows"] += 1
            if hi is not None:
                out["vram_hits"] += row[hi] == "1"
                out["vram_misses"] += row[hi] == "0"
            if ri is not None:
                out["stream_hits"] += row[ri] == "1"
                out["stream_misses"] += row[ri] == "0"
    return out


def check_counters(series: dict[str, float], trace: dict[str, int], vram: bool, stream: bool) -> list[str]:
    """What is wrong with the tiers' counters (empty: nothing), against the lookups the engine's
    trace recorded (:func:`trace_counts` of the same server's ``--moe-trace``).

    Each tier's ``/metrics`` hits and misses must equal the lookups the trace shows it answered
    (hits + misses = its lookups), and every lookup is answered once: by a VRAM hit, else by the
    disk tier (with it on); a tier that is off counts nothing.
    """
    bad = []
    g = lambda k: int(series.get(k, 0))  # noqa: E731
    got = dict(vram_hits=g("moe_cache_hits_total"), vram_misses=g("moe_cache_misses_total"),
               stream_hits=g("moe_stream_hits_total"), stream_misses=g("moe_stream_misses_total"))
    for tier, on in (("vram", vram), ("stream", stream)):
        h, m = got[f"{tier}_hits"], got[f"{tier}_misses"]
        want = (trace[f"{tier}_hits"], trace[f"{tier}_misses"]) if on else (0, 0)
        if (h, m) != want:
            bad.append(f"{tier} tier: /metrics hits {h} + misses {m}, the trace {want[0]} + {want[1]}")
    if stream and got["stream_hits"] + got["stream_misses"] + (got["vram_hits"] if vram else 0) != trace["rows"]:
        bad.append(f"lookups: {trace['rows']} in the trace, the tiers answered "
                   f"{got['stream_hits'] + got['stream_misses'] + (got['vram_hits'] if vram else 0)}")
    if vram and got["vram_hits"] + got["vram_misses"] == 0:
        bad.append("the VRAM tier looked nothing up")
    return bad


@dataclass
class LoadResult:
    """One configuration's run: counts, requests per second, p50/p99 latency (ms), the counters."""

    config: str
    clients: int
    per_client: int
    requests: int
    answered: int
    errors: int
    lost: int
    identical: int
    near_tie: int
    wrong: int
    wall_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    lookups: int
    vram_hits: int
    vram_misses: int
    stream_hits: int
    stream_misses: int
    counter_problems: list[str] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """0 errors, 0 lost, 0 wrong, and the counters add up."""
        return not (self.errors or self.lost or self.wrong or self.counter_problems)

    def row(self) -> dict:
        d = asdict(self)
        d.pop("outcomes")
        d["counter_problems"] = "; ".join(self.counter_problems)
        d["ok"] = self.ok
        return d


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def stream_budget_mib(model: Path) -> int:
    """The disk tier's budget just above the cache cycle (every MoE layer's top-k experts), whole MiB
    (at least one expert more than the cycle)."""
    entry, n_layer, _, k = sim.gguf_expert_bytes(model)
    return math.ceil((n_layer * k + 1) * entry / 2**20)


def server_args(model: Path, rpc_endpoint: str, parallel: int, ctx_slot: int, threads: int, slots: int = 0,
                inserts: int = 0, stream_mib: int | None = None, trace: Path | None = None) -> list[str]:
    """llama-server flags: the loopback layout, ``parallel`` slots of ``ctx_slot`` tokens each,
    continuous batching, ``--metrics``, flash attention off; the VRAM tier when ``slots`` > 0, the
    disk tier when ``stream_mib`` is given (MiB); ``trace``: a ``--moe-trace`` file.

    Flash attention is off (``-fa off``) on the references and under load alike: its online softmax
    over a batch's KV cells rounds differently with the batch's make-up, so stock llama.cpp without
    any tier answered 2 of 320 requests (the 90-token prompts) differently from the lone run, at
    tokens that were no near tie (docs/reliability.md). With it off, stock under load is bit-identical
    to the lone run, and any difference is the tiers'."""
    args = ["-m", str(model), *engine.host_experts_args(rpc_endpoint), "-c", str(parallel * ctx_slot),
            "-np", str(parallel), "-cb", "-t", str(threads), "--no-warmup", "--metrics", "-fa", "off"]
    if slots:
        args += engine.cache_args(slots, inserts)
    if stream_mib is not None:
        args += ["--moe-stream-cache-mb", str(stream_mib)]
    if trace is not None:
        args += ["--moe-trace", str(trace)]
    return args


def references(url: str, pool: Sequence[Request], timeout_s: float = 300) -> dict[str, Answer]:
    """Every request of ``pool`` run alone, one after another, on the server at ``url``.

    Raises:
        LoadError: a request failed.
    """
    return {r.name: send(url, r, timeout_s) for r in pool}


def run_load(model: Path, rpc_endpoint: str, configs: Sequence[str] = ("stream", "both"), clients: int = 8,
             per_client: int = 200, parallel: int = 8, ctx_slot: int = 256, threads: int = 2,
             n_predict: Sequence[int] = (4, 8, 16), seed: int = 0, timeout_s: float = 300,
             log_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> list[LoadResult]:
    """Runs the load test of each configuration of :data:`CONFIGS` named in ``configs``: the
    references first (one tier-off server, ``-np 1``), then each configuration's server under
    ``clients`` threads of ``per_client`` requests. ``timeout_s``: seconds per request.

    Raises:
        ValueError: an unknown configuration or a non-positive count.
        LoadError: a reference request failed.
        EngineError: a server did not start.
    """
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    if min(clients, per_client, parallel, ctx_slot, threads) <= 0:
        raise ValueError("clients, per_client, parallel, ctx_slot and threads must be positive")
    say = progress or (lambda _: None)
    spec = engine_spec(model)
    with engine.LlamaServer(server_args(model, rpc_endpoint, 1, ctx_slot, threads), log_dir=log_dir) as ref:
        pool = make_pool(prompt_tokens(ref.url), n_predict)
        say(f"references: {len(pool)} distinct requests, each alone on a tier-off server")
        refs = references(ref.url, pool, timeout_s)
    plan = schedule(pool, clients, per_client, seed)
    results = []
    for name in configs:
        cfg = CONFIGS[name]
        stream_mib = stream_budget_mib(model) if cfg["stream"] == "cycle+" else cfg["stream"]
        args = server_args(model, rpc_endpoint, parallel, ctx_slot, threads, cfg["slots"], cfg["inserts"], stream_mib)
        say(f"{name}: {clients} clients x {per_client} requests ({' '.join(args[args.index('-np'):])})")
        trace = Path(tempfile.mkdtemp(prefix="pybmoe-load-", dir=log_dir)) / f"trace-{name}.csv"
        with engine.LlamaServer([*args, "--moe-trace", str(trace)], log_dir=log_dir) as srv:
            outcomes, wall, lost = run_clients(srv.url, plan, refs, timeout_s)
            series = metrics(srv.url)
        counts = trace_counts(trace)
        trace.unlink()
        answered = [o for o in outcomes if o.verdict != "error"]
        lat = [o.latency_s * 1000 for o in answered]
        res = LoadResult(
            name, clients, per_client, sum(map(len, plan)), len(answered),
            sum(o.verdict == "error" for o in outcomes), lost, sum(o.verdict == "identical" for o in outcomes),
            sum(o.verdict == "near_tie" for o in outcomes), sum(o.verdict == "wrong" for o in outcomes), wall,
            len(answered) / wall if wall > 0 else float("nan"), _percentile(lat, 0.5), _percentile(lat, 0.99),
            counts["rows"], int(series.get("moe_cache_hits_total", 0)), int(series.get("moe_cache_misses_total", 0)),
            int(series.get("moe_stream_hits_total", 0)), int(series.get("moe_stream_misses_total", 0)),
            check_counters(series, counts, cfg["slots"] > 0, stream_mib is not None), outcomes)
        say(format_result(res))
        results.append(res)
    return results


def engine_spec(model: Path) -> tuple[int, int]:
    """``(MoE layers, top-k)`` of a GGUF."""
    _, n_layer, _, k = sim.gguf_expert_bytes(model)
    return n_layer, k


def format_result(r: LoadResult) -> str:
    """One line: the counts, requests per second, p50/p99 latency and the verdict."""
    return (f"{r.config}: {r.answered}/{r.requests} answered, {r.errors} errors, {r.lost} lost, "
            f"{r.identical} identical, {r.near_tie} near-tie, {r.wrong} wrong; {r.rps:.2f} req/s, "
            f"p50 {r.p50_ms:.0f} ms, p99 {r.p99_ms:.0f} ms; counters "
            f"{'consistent' if not r.counter_problems else 'INCONSISTENT: ' + '; '.join(r.counter_problems)}"
            f" -> {'PASS' if r.ok else 'FAIL'}")


def write_csv(results: Sequence[LoadResult], out_dir: Path) -> tuple[Path, Path]:
    """Writes ``load-summary.csv`` (one row per configuration) and ``load-requests.csv`` (one row per
    request: latency in ms, verdict, error) into ``out_dir``; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, per_req = out_dir / "load-summary.csv", out_dir / "load-requests.csv"
    rows = [r.row() for r in results]
    with open(summary, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["config"])
        w.writeheader()
        w.writerows(rows)
    with open(per_req, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "client", "index", "request", "verdict", "latency_ms", "first_diff", "error"])
        for r in results:
            for o in sorted(r.outcomes, key=lambda o: (o.client, o.index)):
                w.writerow([r.config, o.client, o.index, o.request, o.verdict, f"{o.latency_s * 1000:.1f}",
                            o.first_diff, o.error])
    return summary, per_req
