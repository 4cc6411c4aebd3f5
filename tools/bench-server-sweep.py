#!/usr/bin/env python3
"""The disk tier as the server runs it, at its defaults, against llama-bench's defaults point and stock
mmap (docs/benchmarks/server-sweep-2026-12-06/README.md).

For every model (``NAME=MODEL.gguf``, its routings ``--traces DIR/uniform-NAME.csv`` and
``DIR/granite-NAME.csv``), limit factor (the cgroup limit is the file's size divided by it) and routing,
one :func:`pybmoe.bench.stream.bench_stream` run with the points ``mmap`` and ``defaults``
(llama-bench) and ``server`` (llama-server at its own defaults: 1 client, then 4 at once), interleaved
over ``--repeats``. Then, per model, the inputs a new user tries (``--inputs``), each one server start
under the 3x limit: ``-np 8``, ``-c 65536``, a fixed budget of 3x the limit, and a limit under the dense
weights; each must be answered or refused in one line, never killed.

Writes ``OUT/server-sweep.csv`` (one row per setting), ``OUT/server-inputs.csv``, ``OUT/server-sweep.png``
and each setting's own folder (bench_stream's CSVs, plots and logs).

Usage: tools/bench-server-sweep.py --out DIR --traces DIR A=a.gguf B=b.gguf ... [--factors 2,3,5]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import server, stream
from pybmoe.engine import memlimit

MIB = 2**20


def dense_mib(model: Path) -> float:
    import gguf
    r = gguf.GGUFReader(str(model))
    return sum(int(t.n_bytes) for t in r.tensors if "_exps.weight" not in t.name) / MIB


def run_setting(name: str, model: Path, factor: float, routing: str, trace: Path, out: Path, a) -> dict:
    limit = int(model.stat().st_size / MIB / factor)
    res = stream.bench_stream(model, out / f"{name}-{factor:g}x-{routing}", limit_mib=limit, budgets=[],
                              n_prompt=a.n_prompt, n_gen=a.n_gen, n_gen_mmap=a.n_gen_mmap, repeats=a.repeats,
                              threads=2, route_replay=trace, include_resident=False, probe=False, server=True)
    tg = res.summary[res.summary["mode"] == "tg"].set_index("point")
    pp = res.summary[res.summary["mode"] == "pp"].set_index("point")
    s = res.server_summary.set_index("clients")
    one, four = s.loc[1], s.loc[4] if 4 in s.index else None
    return dict(model=name, factor=factor, routing=routing, limit_mib=limit,
                mmap_tg=tg.loc["mmap", "median_ts"], bench_defaults_tg=tg.loc["defaults", "median_ts"],
                bench_defaults_pp=pp.loc["defaults", "median_ts"], mmap_pp=pp.loc["mmap", "median_ts"],
                server_tg=one.median_ts, server_ttft_s=one.median_ttft_s, server_hit_pct=one.median_hit_pct,
                server4_tg=four.median_ts if four is not None else math.nan,
                server4_wall_tg=four.median_wall_ts if four is not None and "median_wall_ts" in four else math.nan,
                server1_wall_tg=one.median_wall_ts if "median_wall_ts" in one else math.nan,
                server_vs_bench=one.median_ts / tg.loc["defaults", "median_ts"],
                server_vs_mmap=one.median_ts / tg.loc["mmap", "median_ts"],
                four_vs_one=(four.median_ts / one.median_ts) if four is not None else math.nan,
                # with route replay the answers are not compared (pybmoe.bench.server): NaN
                identical=four.identical if four is not None else math.nan,
                near_tie=four.near_tie if four is not None else math.nan,
                wrong=four.wrong if four is not None else math.nan,
                n_ctx_slot=one.n_ctx_slot, n_slots=one.n_slots, budget_mb=one.serving_budget_mb,
                cycle_mb=one.cycle_mb, budget_over_cycle=one.serving_budget_mb / one.cycle_mb,
                oom_kills=int(s.oom_kills.sum()), refused=int(s.refused.sum()), peak_mib=one.peak_mib)


def run_inputs(name: str, model: Path, trace: Path, out: Path, a) -> list[dict]:
    size = model.stat().st_size / MIB
    limit3 = int(size / 3)
    cases = [(f"-np 8 ({f:g}x)", int(size / f), ["-np", "8"], server.DEFAULTS)
             for f in [float(v) for v in a.input_factors.split(",")]]
    cases += [("-c 65536", limit3, ["-c", "65536"], server.DEFAULTS),
             (f"--moe-stream-cache-mb {3 * limit3}", limit3, [], ("--moe-stream-cache-mb", str(3 * limit3))),
             ("limit under the dense weights", int(dense_mib(model) * 0.8), [], server.DEFAULTS)]
    rows = []
    for label, limit, extra, tier in cases:
        log_path = out / f"{name}-inputs" / f"{slug(label)}.log"
        with memlimit.MemoryLimit(limit) as lim:
            r = server.run_server_point(model, limit=lim, cold=True, clients=(1,), n_prompt=a.n_prompt,
                                        n_gen=8, route_replay=trace, extra=extra, tier=tier, log_path=log_path)[0]
        log = log_path.read_text(errors="replace")
        errs = [ln for ln in log.splitlines() if " E " in ln or "error" in ln.lower()]
        rows.append(dict(model=name, input=label, limit_mib=limit, status=r["status"], oom_kills=r.get("oom_kills", 0),
                         answered=r["status"] == "ok", n_ctx_slot=r.get("n_ctx_slot"), n_slots=r.get("n_slots"),
                         fit_line=r.get("fit_line", ""), first_error=errs[0][:400] if errs else ""))
        print(f"{name} {label}: {r['status']}", file=sys.stderr, flush=True)
    return rows


def slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in label)


def run_answers(name: str, model: Path, out: Path, a) -> list[dict]:
    """The answers check on the model's own router (no route replay, so four interleaved requests get the
    experts the same request gets alone): llama-server at the tier's defaults under the 3x limit, and stock
    llama-server (no tier, no limit) beside it, each 1 client then 4 at once; ``pybmoe load``'s verdicts."""
    rows = []
    limit3 = int(model.stat().st_size / MIB / 3)
    with memlimit.MemoryLimit(limit3) as lim:
        for r in server.run_server_point(model, limit=lim, cold=True, n_prompt=a.n_prompt, n_gen=a.n_gen,
                                         log_path=out / f"{name}-answers" / "tier-3x.log"):
            rows.append(dict(r, model=name, run="tier, 3x limit"))
    for r in server.run_server_point(model, limit=None, cold=True, n_prompt=a.n_prompt, n_gen=a.n_gen, tier=(),
                                     extra=["--no-repack"], log_path=out / f"{name}-answers" / "stock.log"):
        rows.append(dict(r, model=name, run="stock, no limit"))
    print(f"{name} answers: " + ", ".join(f"{r['run']} x{r.get('clients')}: {r.get('identical')}/{r.get('near_tie')}/"
                                          f"{r.get('wrong')}" for r in rows), file=sys.stderr, flush=True)
    return rows


def markdown(df: pd.DataFrame) -> str:
    """The sweep as docs/benchmarks/server-sweep-2026-12-06/README.md shows it: decode tok/s and the ratios,
    one row per setting."""
    head = ("| model | limit | routing | limit MiB | stock mmap | llama-bench defaults | server, 1 client | x mmap | "
            "x llama-bench | server, 4 clients | 4 / 1 | the server's context | budget / cycle MiB | hit % | "
            "first token s |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|\n")
    rows = []
    for r in df.sort_values(["model", "factor", "routing"], ascending=[True, True, False]).itertuples():
        rows.append(f"| {r.model} | {r.factor:g}x | {r.routing} | {r.limit_mib} | {r.mmap_tg:.2f} | {r.bench_defaults_tg:.2f} | "
                    f"{r.server_tg:.2f} | {r.server_vs_mmap:.1f} | {r.server_vs_bench:.2f} | {r.server4_tg:.2f} | "
                    f"{r.four_vs_one:.2f} | {r.n_slots:.0f} slots sharing {r.n_ctx_slot:.0f} | "
                    f"{r.budget_mb:.0f} / {r.cycle_mb:.0f} | {r.server_hit_pct:.1f} | {r.server_ttft_s:.2f} |")
    return head + "\n".join(rows) + "\n"


def plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r.model} {r.factor:g}x {r.routing}" for r in df.itertuples()]
    x = range(len(df))
    w = 0.2
    for i, (col, lab) in enumerate((("mmap_tg", "stock mmap (llama-bench)"), ("bench_defaults_tg", "defaults (llama-bench)"),
                                    ("server_tg", "defaults (llama-server, 1 client)"),
                                    ("server4_tg", "defaults (llama-server, 4 clients, aggregate)"))):
        ax.bar([v + (i - 1.5) * w for v in x], df[col], w, label=lab)
    ax.set_xticks(list(x), labels, rotation=30, ha="right")
    ax.set_ylabel("decode tok/s")
    ax.set_title("The disk tier at its defaults: llama-server against llama-bench and stock mmap")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="NAME=MODEL.gguf")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--factors", default="3")
    ap.add_argument("--routings", default="uniform,granite")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=32)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--n-gen-mmap", type=int, default=8)
    ap.add_argument("--inputs", action="store_true", help="also the new user's inputs (module doc)")
    ap.add_argument("--input-factors", default="2,3,5", help="the limit factors of the inputs' -np 8 case")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of an earlier run's OUT/server-sweep.csv (and inputs, answers) and add these")
    ap.add_argument("--answers", action="store_true",
                    help="also the answers check on each model's own router (run_answers)")
    a = ap.parse_args()
    a.factor_list = [float(f) for f in a.factors.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    rows, inputs, answers = [], [], []
    if a.append:
        for lst, f in ((rows, "server-sweep.csv"), (inputs, "server-inputs.csv"), (answers, "server-answers.csv")):
            if (a.out / f).exists():
                lst += pd.read_csv(a.out / f).to_dict("records")
    for spec in a.models:
        name, path = spec.split("=", 1)
        model = Path(path)
        for factor in a.factor_list:
            for routing in a.routings.split(","):
                trace = a.traces / f"{routing}-{name}.csv"
                rows.append(run_setting(name, model, factor, routing, trace, a.out, a))
                pd.DataFrame(rows).to_csv(a.out / "server-sweep.csv", index=False)
                print(pd.DataFrame(rows).iloc[-1].to_string(), file=sys.stderr, flush=True)
        if a.inputs:
            inputs += run_inputs(name, model, a.traces / f"uniform-{name}.csv", a.out, a)
            pd.DataFrame(inputs).to_csv(a.out / "server-inputs.csv", index=False)
        if a.answers:
            answers += run_answers(name, model, a.out, a)
            pd.DataFrame(answers).to_csv(a.out / "server-answers.csv", index=False)
    df = pd.DataFrame(rows)
    if df.empty:
        return 0
    plot(df, a.out / "server-sweep.png")
    (a.out / "server-sweep.md").write_text(markdown(df))
    print(df.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if inputs:
        print(pd.DataFrame(inputs)[["model", "input", "limit_mib", "status", "oom_kills", "n_ctx_slot"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
