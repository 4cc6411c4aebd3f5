"""``pybmoe bench-stream -m MODEL --limit-mb L``: the stream tier against stock mmap under a memory
limit (:mod:`pybmoe.bench.stream`): CSV and PNG."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .. import engine
from ..bench import noise, stream
from ..routing import granite
from ..routing import trace as tr
from . import paths


def route_replay_file(arg: Path | None) -> Path | None:
    """The engine replay file ``--route-replay ARG`` names: ``granite`` is the bundled granite trace as
    a ``--moe-trace`` CSV (:func:`pybmoe.routing.granite.granite_replay_csv`), anything else the file
    itself. Raises :class:`FileNotFoundError` naming what is accepted when the file is not there."""
    if arg is None:
        return None
    if str(arg) == "granite":
        return granite.granite_replay_csv()[0]
    if not arg.is_file():
        raise FileNotFoundError(f"--route-replay {arg}: no such file; accepted: a --moe-trace CSV, or granite "
                                f"({tr.PACKAGED_TRACE_DOCS['granite']})")
    return arg


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe bench-stream -m MODEL --out DIR [--limit-mb L] [--budgets auto,300,...]``; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="pybmoe bench-stream",
        description="Run a model larger than a memory limit three ways on the CPU: stock mmap, the stream tier "
                    "at its defaults (--moe-stream-cache-mb auto and nothing else) and at each budget, and every expert resident (no limit, warm). pp and tg "
                    "are separate llama-bench runs from a cold page cache, interleaved over repeats; writes "
                    "DIR/stream-runs.csv, DIR/stream-summary.csv and DIR/stream-{pp,tg}.png (medians, ratios "
                    "over mmap, hit %, MiB read and major faults per token, io wait, and each point's limit: its reads at the "
                    "disk probe's rate plus the resident point's compute, and the measured speed as a fraction of it).")
    ap.add_argument("-m", "--model", type=Path, required=True, help="GGUF model")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--limit-mb", type=int, default=None,
                    help="memory limit of the limited runs, MiB (a cgroup: page cache included; needs root)")
    ap.add_argument("--budgets", default="", help="fixed stream budgets beside the defaults point, comma-separated MiB "
                                                 "or auto (default none: mmap, defaults and resident only)")
    ap.add_argument("--route-replay", type=Path, default=None,
                    help="routing trace every MoE layer replays: a --moe-trace CSV of the model's shape, or granite "
                         "(the bundled granite-3.0-1b-a400m trace, for a model of 24 MoE layers, 32 experts, top-8)")
    ap.add_argument("-p", "--n-prompt", type=int, default=64, help="prompt tokens of the pp runs (default 64)")
    ap.add_argument("-n", "--n-gen", type=int, default=32, help="generated tokens of the tg runs (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of every point (default 3)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("-ub", "--ubatch", type=int, default=512, help="ubatch, tokens (default 512)")
    ap.add_argument("--io-threads", type=int, default=None, help="read lanes of the budget points (default: the "
                                                                 "engine's, 4)")
    ap.add_argument("--floor-mb", type=int, default=None, help="--moe-stream-floor-mb of the budget points (default: "
                                                               "the engine's auto floor)")
    ap.add_argument("--dense", default="", help="extra stream points at every budget with these --dense-weights "
                                                "policies, comma-separated: mmap, warm, anon (default none)")
    ap.add_argument("--no-defaults", action="store_true", help="skip the defaults point (--moe-stream-cache-mb auto "
                                                               "and nothing else)")
    ap.add_argument("--no-resident", action="store_true", help="skip the all-resident ceiling")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache before each run")
    ap.add_argument("--no-probe", action="store_true", help="do not probe the disk before each repeat (no limits)")
    ap.add_argument("--server", action="store_true",
                    help="also the server point: llama-server at its own defaults (--moe-stream-cache-mb auto, its "
                         "context fitted beside it) under the limit, 1 client and then 4 at once; writes "
                         "DIR/server-runs.csv and DIR/server-summary.csv (decode tok/s, time to the first token)")
    a = ap.parse_args(argv)
    from tqdm import tqdm
    try:  # before the progress bar: a bad -m or --out is the only line
        stream.check_model(a.model)
        why = paths.model_error(a.model) or paths.out_dir_error(a.out)
        if why:
            raise ValueError(why)
        replay_arg = a.route_replay
        a.route_replay = route_replay_file(a.route_replay)
        if a.route_replay is not None:  # the engine's own checks, here: one line, not a failed run's log
            why = tr.replay_mismatch(tr.read_trace(a.route_replay), a.model)
            if why:
                raise ValueError(f"--route-replay {replay_arg}: {why}; accepted: a trace of the model's shape"
                                 + (" (pybmoe make-model OUT --layers 24 --experts 32 --top-k 8 writes one of "
                                    "granite's)" if str(replay_arg) == "granite" else ""))
        budgets = [b for b in a.budgets.split(",") if b.strip()]
        dense = [d for d in a.dense.split(",") if d.strip()]
        n_runs = (len(stream.points(budgets, not a.no_resident, dense, not a.no_defaults)) * len(stream.MODES)
                  + a.server) * a.repeats
        with tqdm(total=n_runs, desc="bench-stream", unit="run", file=sys.stderr) as bar:
            res = stream.bench_stream(a.model, a.out, limit_mib=a.limit_mb, budgets=budgets, n_prompt=a.n_prompt,
                                      n_gen=a.n_gen, repeats=a.repeats, threads=a.threads, ubatch=a.ubatch,
                                      io_threads=a.io_threads, floor_mib=a.floor_mb, route_replay=a.route_replay,
                                      include_resident=not a.no_resident, cold=not a.warm, dense=dense,
                                      defaults=not a.no_defaults, probe=not a.no_probe, server=a.server,
                                      progress=bar.update)
    except (ValueError, FileNotFoundError) as e:
        print(f"pybmoe bench-stream: error: {e}", file=sys.stderr)
        return 2
    except engine.EngineError as e:
        print(f"pybmoe bench-stream: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"pybmoe bench-stream: error: {paths.os_error_line(e)}", file=sys.stderr)
        return 2
    print(stream.format_summary(res.summary))
    if res.server_summary is not None:
        ss = res.server_summary.copy()
        if "noisy" in ss:
            ss["noisy"] = [noise.noisy_note(r) for r in res.server_summary.itertuples(index=False)]
        print(ss.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        for line in noise.noisy_lines(res.server_summary, ["point", "clients"]):
            print(line)
    print(f"wrote {res.out_dir}/stream-runs.csv, stream-summary.csv, stream-{{pp,tg}}.png"
          + (", server-runs.csv, server-summary.csv (the server point is in stream-tg.png too)"
             if res.server_summary is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
