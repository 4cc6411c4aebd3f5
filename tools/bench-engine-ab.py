#!/usr/bin/env python3
"""Two builds of the engine at the disk tier's defaults point, interleaved: is a change that should not
move the speed (a refactor) within noise? (docs/benchmarks/engine-ab-2026-12-06/README.md).

Each round runs :func:`pybmoe.bench.stream.bench_stream` once per engine, A then B, alternating which goes
first: the ``defaults`` point (``--moe-stream-cache-mb auto`` and nothing else of the tier) beside stock
``mmap``, under a cgroup limit of the file's size divided by ``--factor``, from a cold page cache, with
``--trace`` replayed; with ``--server`` also ``llama-server`` at its own defaults, one client (the row
``server``, ``tg``: request-level decode tok/s). An engine is a folder of the installed layout (``DIR/pybmoe/bin/llama-bench`` beside
``DIR/llama_cpp/lib``), or ``installed`` for this Python's package; it is picked by ``PYBMOE_BIN_DIR``.

Writes ``OUT/ab-runs.csv`` (one row per engine, round and mode: tok/s, hit %) and ``OUT/ab-summary.csv``
(per engine and mode: the median tok/s over rounds and B / A), and prints the summary.

Usage: tools/bench-engine-ab.py MODEL.gguf --trace T.csv --a DIR --b installed --out DIR [--rounds 3] [--server]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import stream

MIB = 2**20


def run(model: Path, trace: Path, bin_dir: str, out: Path, limit: int, a) -> pd.DataFrame:
    """One engine's round: llama-bench's points (point, mode, median_ts, median_hit_pct), and with
    ``--server`` the server point at its defaults, one client, as the row (server, tg)."""
    old = os.environ.get("PYBMOE_BIN_DIR")
    if bin_dir != "installed":
        os.environ["PYBMOE_BIN_DIR"] = str(Path(bin_dir) / "pybmoe" / "bin")
    else:
        os.environ.pop("PYBMOE_BIN_DIR", None)
    try:
        res = stream.bench_stream(model, out, limit_mib=limit, budgets=[], n_prompt=a.n_prompt, n_gen=a.n_gen,
                                  n_gen_mmap=a.n_gen_mmap, repeats=1, threads=2, route_replay=trace,
                                  include_resident=False, probe=False, server=a.server, server_clients=(1,))
    finally:
        if old is None:
            os.environ.pop("PYBMOE_BIN_DIR", None)
        else:
            os.environ["PYBMOE_BIN_DIR"] = old
    rows = res.summary[["point", "mode", "median_ts", "median_hit_pct"]]
    if a.server and res.server_summary is not None and len(res.server_summary):
        srv = res.server_summary.assign(mode="tg")[["point", "mode", "median_ts", "median_hit_pct"]]
        rows = pd.concat([rows, srv], ignore_index=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--a", required=True, help="engine A: a folder of the installed layout, or 'installed'")
    ap.add_argument("--b", required=True, help="engine B: the same")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=32)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--n-gen-mmap", type=int, default=4)
    ap.add_argument("--server", action="store_true", help="also llama-server at its defaults (one client) per round")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}; accepted: >= 1")
    limit = int(a.model.stat().st_size / MIB / a.factor)
    rows = []
    for r in range(a.rounds):
        order = (("A", a.a), ("B", a.b)) if r % 2 == 0 else (("B", a.b), ("A", a.a))
        for name, d in order:
            s = run(a.model, a.trace, d, a.out / f"{name}-{r}", limit, a)
            for x in s.itertuples():
                rows.append(dict(engine=name, dir=d, round=r, point=x.point, mode=x.mode, ts=x.median_ts,
                                 hit_pct=x.median_hit_pct, limit_mib=limit))
            pd.DataFrame(rows).to_csv(a.out / "ab-runs.csv", index=False)
            print(f"round {r} engine {name}: " + ", ".join(f"{x.point} {x.mode} {x.median_ts:.2f}" for x in s.itertuples()),
                  file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    summ = df.groupby(["point", "mode", "engine"]).ts.median().unstack("engine").reset_index()
    summ["b_over_a"] = summ["B"] / summ["A"]
    summ.to_csv(a.out / "ab-summary.csv", index=False)
    print(summ.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
