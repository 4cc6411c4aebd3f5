#!/usr/bin/env python3
"""The sweep's comparisons with repeats, per setting of a ``tools/bench-stream-sweep.py`` run:

- ``tg``: ``defaults`` against that setting's best fixed point (by the sweep's single pass);
- ``pp``: ``defaults`` against stock mmap (prefill, ``-p 32``, the sweep's prompt).

``--repeats`` times each, interleaved (AB, BA on odd repeats), under the same limit and routing, from a
cold page cache. One pass of four fixed points picks its best on single runs whose disk speed swings by a
third from run to run (the io wait of equal reads), so the max over them is biased up; this pass
compares medians.

Writes OUT/sweep-confirm.csv (one row per run, with its mode; a run that failed, such as one the kernel
killed for memory, has ``failed`` set and no speed) and OUT/sweep-confirm-summary.csv (per setting and
mode: the two medians of the runs that completed and defaults / the other). ``--settings`` names the sweep's
sweep-settings.csv when OUT is a new folder (default: OUT/sweep-settings.csv).

``--predict``: the prediction of ``pybmoe size --stream-mb`` (:func:`pybmoe.routing.sizing.predict_stream`)
against each tg run, with its inputs measured in the same run: the all-resident decode speed of each
model (3 warm runs without a limit, median, first), and the disk (:func:`pybmoe.bench.disk.probe` on
the model's own file, the tier's lanes, right before each pair of runs, twice: random projections, and
decode's layer steps of top-k experts, ``top_k``). Adds ``probe_mib_s``, ``probe_steps_mib_s``,
``predicted_ts`` and ``predicted_steps_ts`` to the runs, and to the summary their medians and measured /
predicted per point for each probe (OUT/sweep-confirm-prediction.csv). With it each tg run gets its limits too
(:func:`pybmoe.bench.stream.limit_ts`, issue 23's bound): ``resident_ts``, ``limit_ts`` = 1 / (the tier's reads
per token / the random probe + 1 / resident), ``overlap_limit_ts`` = 1 / max(the same two), and the measured
tok/s over each (``vs_limit``, ``vs_overlap_limit``), with their medians per point in the prediction CSV.

Usage: tools/bench-stream-confirm.py --out DIR --traces DIR [--settings CSV] [--modes tg,pp] [--predict] A=a.gguf ...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from pybmoe import engine
from pybmoe.bench import disk, stream
from pybmoe.engine import memlimit
from pybmoe.routing import sizing
from pybmoe.routing import trace as tr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where the CSVs and logs go")
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--settings", type=Path, help="the sweep's sweep-settings.csv (default: OUT/sweep-settings.csv)")
    ap.add_argument("--modes", default="tg", help="tg (defaults against the best fixed point), pp (against mmap)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-p", "--n-prompt", type=int, default=32)
    ap.add_argument("--predict", action="store_true", help="the decode prediction against each tg run (see above)")
    ap.add_argument("models", nargs="+", help="NAME=MODEL.gguf")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"tg", "pp"}:
        ap.error(f"--modes takes tg and/or pp, got {a.modes!r}")
    models = dict(m.split("=", 1) for m in a.models)
    settings = pd.read_csv(a.settings or a.out / "sweep-settings.csv")
    settings = settings[settings.model.isin(list(models))]
    a.out.mkdir(parents=True, exist_ok=True)
    resident = {}
    if a.predict and "tg" in modes:
        for name in dict.fromkeys(settings.model):
            resident[name] = stream.resident_ts(Path(models[name]), "tg", a.out / "confirm-logs", name, n_prompt=1,
                                                n_gen=a.n_gen)
            print(f"{name} resident tg: {resident[name]:.2f} tok/s", file=sys.stderr, flush=True)
    rows = []
    traces: dict[str, tr.Trace] = {}
    for s in settings.itertuples():
        model = Path(models[s.model])
        shape = sizing.model_shape(model) if a.predict else None
        budget, _, dense = s.best_fixed.removeprefix("stream:").partition("+")
        against = {"tg": stream.StreamPoint("stream", budget, dense or "auto"), "pp": stream.StreamPoint("mmap")}
        with memlimit.MemoryLimit(int(s.limit_mib)) as lim:
            for mode in modes:
                pts = [stream.StreamPoint("defaults", "auto"), against[mode]]
                for rep in range(a.repeats):
                    probe = disk.probe(model).mib_s if a.predict and mode == "tg" else None
                    probe_steps = (disk.probe(model, top_k=shape.top_k).mib_s
                                   if a.predict and mode == "tg" else None)
                    for pt in (pts if rep % 2 == 0 else pts[::-1]):
                        log = a.out / "confirm-logs" / f"{s.model}-{s.factor:g}x-{s.routing}-{mode}-{pt.name.replace(':', '-')}-{rep}.log"
                        try:
                            r = stream.run_point(model, pt, mode, limit=lim, cold=True, log_path=log,
                                                 n_prompt=a.n_prompt if mode == "pp" else 1, n_gen=a.n_gen, threads=2,
                                                 ubatch=512, io_threads=None, floor_mib=None,
                                                 route_replay=a.traces / f"{s.routing}-{s.model}.csv")
                        except engine.EngineError as e:  # killed (out of memory) or refused: a row without a speed
                            rows.append(dict(model=s.model, factor=s.factor, routing=s.routing, limit_mib=s.limit_mib,
                                             mode=mode, point=pt.name, repeat=rep, failed=str(e).splitlines()[0][:200]))
                            print(f"{s.model} {s.factor:g}x {s.routing} {mode} {pt.name} {rep}: failed: "
                                  f"{str(e).splitlines()[0][:120]}", file=sys.stderr, flush=True)
                            continue
                        rows.append(dict(model=s.model, factor=s.factor, routing=s.routing, limit_mib=s.limit_mib,
                                         mode=mode, point=pt.name, repeat=rep, ts=r["avg_ts"],
                                         hit_pct=r.get("stream_hit_pct"), io_wait_s=r.get("stream_io_wait_s"),
                                         read_mib_per_token=r.get("stream_read_mib_per_token"),
                                         budget_mb=r.get("stream_budget_after_contexts_mb") or r.get("stream_budget_mb"),
                                         window_experts=r.get("stream_prefetch_experts"),
                                         peak_mib=r.get("peak_mib"), probe_mib_s=probe,
                                         probe_steps_mib_s=probe_steps))
                        if probe is not None:
                            budget = rows[-1]["budget_mb"]
                            key = f"{s.routing}-{s.model}"
                            if key not in traces:
                                traces[key] = tr.read_trace(a.traces / f"{key}.csv")
                            trace = traces[key]
                            for col, bw in (("predicted_ts", probe), ("predicted_steps_ts", probe_steps)):
                                p = sizing.predict_stream(shape, trace, float(budget), disk_mib_s=bw,
                                                          resident_tok_s=resident[s.model], tokens=a.n_gen + 1, skip=1,
                                                          window_experts=rows[-1]["window_experts"])
                                rows[-1][col] = p.tok_s
                            rows[-1].update(resident_ts=resident[s.model],
                                            **stream.limit_columns(r["avg_ts"], rows[-1]["read_mib_per_token"], probe,
                                                                   1.0 / resident[s.model]))
                        print(f"{s.model} {s.factor:g}x {s.routing} {mode} {pt.name} {rep}: {r['avg_ts']:.2f} tok/s",
                              file=sys.stderr, flush=True)
                pd.DataFrame(rows).to_csv(a.out / "sweep-confirm.csv", index=False)
    df = pd.DataFrame(rows)
    done = df.dropna(subset=["ts"])
    med = done.groupby(["model", "factor", "routing", "mode", "point"], sort=False).ts.median().reset_index()
    out = []
    for key, g in med.groupby(["model", "factor", "routing", "mode"], sort=False):
        if (g.point == "defaults").sum() == 0 or (g.point != "defaults").sum() == 0:
            continue  # every run of one side failed
        d = g[g.point == "defaults"].ts.iloc[0]
        b = g[g.point != "defaults"]
        out.append(dict(model=key[0], factor=key[1], routing=key[2], mode=key[3], against=b.point.iloc[0],
                        defaults_ts=d, against_ts=b.ts.iloc[0], defaults_vs_against=d / b.ts.iloc[0]))
    summary = pd.DataFrame(out)
    summary.to_csv(a.out / "sweep-confirm-summary.csv", index=False)
    if "predicted_ts" in df:
        t = df[df["mode"] == "tg"]
        pr = t.groupby(["model", "factor", "routing", "point"], sort=False).agg(
            ts=("ts", "median"), predicted_ts=("predicted_ts", "median"), probe_mib_s=("probe_mib_s", "median"),
            predicted_steps_ts=("predicted_steps_ts", "median"), probe_steps_mib_s=("probe_steps_mib_s", "median"),
            hit_pct=("hit_pct", "median"), read_mib_per_token=("read_mib_per_token", "median"),
            limit_ts=("limit_ts", "median"), vs_limit=("vs_limit", "median"),
            overlap_limit_ts=("overlap_limit_ts", "median"), vs_overlap_limit=("vs_overlap_limit", "median")).reset_index()
        pr["measured_vs_predicted"] = pr.ts / pr.predicted_ts
        pr["measured_vs_predicted_steps"] = pr.ts / pr.predicted_steps_ts
        pr.to_csv(a.out / "sweep-confirm-prediction.csv", index=False)
        print(pr.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
