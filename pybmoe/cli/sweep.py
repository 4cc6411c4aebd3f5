"""``pybmoe sweep -m MODEL``: benchmark sweep of the cache with llama-bench or llama-server requests
(:mod:`pybmoe.bench.sweeps`): CSV and PNG."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import pandas as pd

from .. import engine
from ..bench import sweeps
from . import paths


def _list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _modes(text: str) -> list[bool]:
    out = []
    for x in (v.strip() for v in text.split(",") if v.strip()):
        if x not in ("off", "on"):
            raise ValueError(f"--sync {text!r}: expected off, on or off,on")
        out.append(x == "on")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe sweep -m MODEL --slots 0,8 [--repeats N] --out DIR ...``; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="pybmoe sweep",
        description="Benchmark the expert cache with llama-bench (or llama-server requests): pp and tg "
                    "separately, cache off interleaved with cache on, several repeats, medians and ratios; writes "
                    "DIR/sweep.csv, DIR/sweep-summary.csv and DIR/sweep-{pp,tg}.png.")
    ap.add_argument("-m", "--model", type=Path, required=True, help="GGUF model")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--slots", type=_list, default=[0, 8], help="slots per layer, comma-separated (0 = off; "
                                                                 "always included) (default 0,8)")
    ap.add_argument("--inserts", type=_list, default=[0], help="insert caps (uploads per layer per step, "
                                                               "0 = unlimited) (default 0)")
    ap.add_argument("--ubatch", type=_list, default=[512], help="ubatch sizes in tokens (default 512)")
    ap.add_argument("--max-batch", type=_list, default=[0], help="--moe-expert-cache-max-batch values: the largest "
                                                                 "ubatch the cache serves, tokens (0 = the engine's "
                                                                 "default) (default 0)")
    ap.add_argument("--sync", default="off", help="upload modes, comma-separated: off (the default: no step waits "
                                                  "for uploads), on (--moe-expert-cache-sync) or off,on (both, "
                                                  "interleaved; the summary gains ratio_to_sync) (default off)")
    ap.add_argument("--threads", type=_list, default=None, help="host threads (default: the CPU count)")
    ap.add_argument("--backend", default="auto", help="comma-separated: auto, rpc (loopback ggml-rpc-server), "
                                                      "gpu (the local device) (default auto)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point and mode (default 3)")
    ap.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens of the pp runs (default 128; the "
                                                                       "server runner's prompts come from the traffic "
                                                                       "file)")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="generated tokens of the tg runs; with --runner server, "
                                                                   "the most each request generates (default 64)")
    ap.add_argument("--modes", default="pp,tg", help="pp, tg or pp,tg (default)")
    ap.add_argument("--rpc-threads", type=int, default=None, help="threads of the loopback rpc server")
    ap.add_argument("--floor-mb", type=float, default=0.0, help="MiB each device must keep free (overflow check)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--bench-args", "--server-args", dest="bench_args", default="",
                    help="extra llama-bench (or, with --runner server, llama-server) arguments, one string "
                         "(e.g. '-fa on')")
    ap.add_argument("--runner", default="bench", choices=sweeps.RUNNERS,
                    help="bench: llama-bench pp and tg runs; server: llama-server requests from a traffic file "
                         "(default bench)")
    ap.add_argument("--spec", default="off", help="speculation settings, comma-separated: off or a --spec-type "
                                                  "(server runner; e.g. off,ngram-simple) (default off)")
    ap.add_argument("--traffic", type=Path, default=None, help="server runner: JSON request file (default: the "
                                                                "bundled pybmoe/data/traffic.json)")
    ap.add_argument("--requests", type=int, default=None, help="server runner: send the first N requests only")
    a = ap.parse_args(argv)
    why = paths.model_error(a.model) or paths.out_dir_error(a.out)
    if why:
        print(f"pybmoe sweep: error: {why}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        res = sweeps.sweep(a.model, a.out, slots=a.slots, inserts=a.inserts, ubatch=a.ubatch, threads=a.threads,
                    backends=[b.strip() for b in a.backend.split(",") if b.strip()], repeats=a.repeats,
                    n_prompt=a.n_prompt, n_gen=a.n_gen, modes=[m.strip() for m in a.modes.split(",") if m.strip()],
                    rpc_threads=a.rpc_threads, floor_mib=a.floor_mb, extra_args=a.bench_args.split(),
                    progress=not a.no_progress, runner=a.runner,
                    specs=[x.strip() for x in a.spec.split(",") if x.strip()], traffic=a.traffic,
                    n_requests=a.requests, max_batch=a.max_batch, sync=_modes(a.sync))
    except (ValueError, FileNotFoundError, engine.EngineError) as e:
        print(f"pybmoe sweep: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"pybmoe sweep: error: {paths.os_error_line(e)}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(sweeps.format_summary(res.summary))
    print(f"\n{res.csv}\n{res.summary_csv}")
    for p in res.plots:
        print(p)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
