"""``pybmoe load``: the tiers under concurrent load, every answer checked against a lone run
(:mod:`pybmoe.bench.load`); CSV of the counts, requests per second and latencies."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .. import engine, models
from ..bench import load
from . import paths


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe load [-m MODEL] [--clients 8] [--requests 200] [--configs stream,both] --out DIR``;
    returns 0 when every configuration passed, 1 when one failed or a server did not start, 2 on a
    bad argument (a model that is not a complete GGUF file, an output folder that cannot be made: one
    line, before anything starts)."""
    ap = argparse.ArgumentParser(
        prog="pybmoe load",
        description="Start a loopback ggml-rpc-server and, per configuration, one llama-server -np 8 with "
                    "continuous batching and churning tiers; client threads send greedy /completion and "
                    "/v1/chat/completions requests (some streamed; prompts of 1 to 90 tokens, 31 and 33 among "
                    "them). Every answer is compared with the same request run alone on a tier-off server "
                    "(identical, or diverging only where the reference's top two logprobs are within 2e-2); "
                    "/metrics must agree with the engine's trace. Writes DIR/load-summary.csv and "
                    "DIR/load-requests.csv.")
    ap.add_argument("-m", "--model", type=Path, default=None, help="GGUF model (default: the embedded Q8_0 model)")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    ap.add_argument("--requests", type=int, default=200, help="requests per client (default 200)")
    ap.add_argument("--configs", default="stream,both",
                    help=f"configurations, comma-separated, of: {', '.join(load.CONFIGS)} (default stream,both)")
    ap.add_argument("-np", "--parallel", type=int, default=8, help="server slots (default 8)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="server threads (default 2)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per request (default 300)")
    a = ap.parse_args(argv)
    why = (paths.model_error(a.model) if a.model is not None else None) or paths.out_dir_error(a.out)
    if why:
        print(f"pybmoe load: error: {why}", file=sys.stderr)
        return 2
    model = a.model or models.default_model_path("Q8_0")
    try:
        with engine.RpcServer(threads=1) as rpc:
            results = load.run_load(model, rpc.endpoint, [c for c in a.configs.split(",") if c], clients=a.clients,
                                    per_client=a.requests, parallel=a.parallel, threads=a.threads,
                                    timeout_s=a.timeout, progress=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"pybmoe load: error: {e}", file=sys.stderr)
        return 2
    except (engine.EngineError, load.LoadError) as e:
        print(f"pybmoe load: {e}", file=sys.stderr)
        return 1
    summary, per_request = load.write_csv(results, a.out)
    for r in results:
        print(load.format_result(r))
    print(f"wrote {summary} and {per_request}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
