#!/usr/bin/env python3
"""Memory that follows the work, measured through llama-server at its defaults under a memory limit
(pybmoe.bench.elastic; docs/stream-tier.md, "Serving under a memory limit").

  chat: per setting NAME=MODEL.gguf@LIMIT_MIB[:TRACE.csv], interleaved over --repeats: the server at its
        defaults (one chat of --n-prompt + --n-gen tokens; its kept context, its budget through the chat),
        each --variant (the same server plus flags, e.g. "-c 4096") and llama-bench's defaults point at the
        same limit (unless --no-bench). Writes OUT/chat-runs.csv (one row per run, appended as it goes)
        and OUT/chat.csv (medians, the ratios server / llama-bench and server / variant).
  fill: per setting NAME=MODEL.gguf@LIMIT_MIB, one conversation that fills the server's context in turns
        (the budget and decode tok/s after each), then the same conversation on stock llama-server (no
        tier, no limit, the same context): every turn's tokens compared. Writes OUT/fill-turns.csv,
        OUT/fill-samples.csv, OUT/fill-settings.csv and OUT/fill.png.

Usage: tools/bench-elastic.py chat --out DIR [--repeats 2] [--variant "-c 4096"] [--no-bench] SETTING...
       tools/bench-elastic.py fill --out DIR SETTING...
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import pandas as pd

from pybmoe.bench import elastic


def setting(text: str) -> tuple[str, Path, int, Path | None]:
    try:
        name, rest = text.split("=", 1)
        model, rest = rest.rsplit("@", 1)
        limit, _, trace = rest.partition(":")
        out = (name, Path(model), int(limit), Path(trace) if trace else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: NAME=MODEL.gguf@LIMIT_MIB[:TRACE.csv]") from None
    for p in (out[1], out[3]):
        if p is not None and not p.is_file():
            raise argparse.ArgumentTypeError(f"{p}: no such file")
    return out


def append(path: Path, row: dict) -> None:
    """Adds ``row`` to the CSV at ``path`` (rewritten whole: rows may carry other columns)."""
    old = pd.read_csv(path) if path.exists() else pd.DataFrame()
    pd.concat([old, pd.DataFrame([row])], ignore_index=True).to_csv(path, index=False)


def chat(a) -> None:
    runs_path = a.out / "chat-runs.csv"
    for rep in range(a.repeats):
        for name, model, limit, trace in a.settings:
            routing = trace.stem.split("-")[0] if trace else "own"
            tag = f"{name}-{limit}-{routing}"
            points = [("server", [])] + [(f"server {v}", shlex.split(v)) for v in a.variant]
            for label, extra in points:
                log = a.out / tag / f"{label.replace(' ', '_')}-r{rep}.log"
                r = elastic.chat_point(model, limit, log, n_prompt=a.n_prompt, n_gen=a.n_gen, extra=extra,
                                       route_replay=trace)
                append(runs_path, dict(r, setting=name, routing=routing, repeat=rep))
                print(f"{tag} r{rep} {label}: {r['status']} {r.get('decode_ts', float('nan')):.2f} tok/s, context "
                      f"{r.get('n_ctx_slot')} x {r.get('n_slots')}, budget >= {r.get('budget_min_mib', float('nan')):.0f} "
                      f"MiB, cycle {r.get('cycle_mb')}", file=sys.stderr, flush=True)
            if not a.no_bench:
                r = elastic.bench_point(model, limit, a.out / tag / f"llama-bench-r{rep}.log", n_gen=a.n_gen,
                                        route_replay=trace)
                append(runs_path, dict(r, setting=name, routing=routing, repeat=rep))
                print(f"{tag} r{rep} llama-bench: {r['decode_ts']:.2f} tok/s", file=sys.stderr, flush=True)
    summarize_chat(a.out)


def summarize_chat(out: Path) -> pd.DataFrame:
    runs = pd.read_csv(out / "chat-runs.csv")
    med = elastic.medians(runs, ["setting", "routing", "limit_mib", "point"])
    ok = runs[runs.status == "ok"]
    ctx = ok.groupby(["setting", "routing", "limit_mib", "point"]).agg(
        n_ctx_slot=("n_ctx_slot", "first"), n_slots=("n_slots", "first"), cycle_mb=("cycle_mb", "first"),
        budget_min_mib=("budget_min_mib", "min"), oom_kills=("oom_kills", "sum")).reset_index()
    med = med.merge(ctx, on=["setting", "routing", "limit_mib", "point"], how="left")
    key = ["setting", "routing", "limit_mib"]
    base = med[med.point == "server"].set_index(key).median_ts
    for p in med.point.unique():
        if p != "server":
            other = med[med.point == p].set_index(key).median_ts
            med.loc[med.point == "server", f"x {p}"] = [base.get(k) / other.get(k, float("nan"))
                                                          for k in med[med.point == "server"].set_index(key).index]
    med["budget_over_cycle"] = med.budget_min_mib / med.cycle_mb
    med.to_csv(out / "chat.csv", index=False)
    print(med.to_string(), file=sys.stderr)
    return med


def fill(a) -> None:
    turns, samples, settings = [], [], []
    for name, model, limit, _ in a.settings:
        label = f"{name} @ {limit} MiB"
        t, s, info = elastic.fill_run(model, limit, a.out / f"fill-{name}-{limit}.log", n_gen=a.fill_gen)
        row = dict(setting=name, limit_mib=limit, label=label, **{k: v for k, v in info.items() if k != "error"})
        if info.get("status") == "ok":
            ctx, n_slots = int(t.n_ctx.iloc[0]), int(info["n_slots"])
            unified = info.get("kv_unified") == "true"
            total = ctx if unified else ctx * n_slots
            ref, _, rinfo = elastic.fill_run(model, None, a.out / f"fill-{name}-{limit}-stock.log", tier=(),
                                             extra=("--no-repack", "-c", str(total), "-np", str(n_slots),
                                                    *(["--kv-unified"] if unified else [])),
                                             n_ctx=ctx, n_gen=a.fill_gen)
            same = elastic.compare_turns(t, ref)
            t["identical"] = same[:len(t)]
            row.update(identical_turns=sum(same), turns=len(t), stock_status=rinfo.get("status"),
                       stock_n_ctx_slot=rinfo.get("n_ctx_slot"), max_fill=t.fill.max(), yields=t.yields.iloc[-1],
                       budget_first_mib=t.budget_mib.iloc[0], budget_last_mib=t.budget_mib.iloc[-1])
            ref["label"] = f"{label}: stock, no limit"
            turns += [t.assign(label=label, setting=name, limit_mib=limit, cycle_mb=info.get("cycle_mb")), ref]
            samples.append(s.assign(label=label))
        else:
            row["error"] = info.get("error", "")[-400:]
        settings.append(row)
        print(f"fill {label}: {row}", file=sys.stderr, flush=True)
        pd.DataFrame(settings).to_csv(a.out / "fill-settings.csv", index=False)
    if turns:
        df = pd.concat(turns, ignore_index=True)
        df.to_csv(a.out / "fill-turns.csv", index=False)
        pd.concat(samples, ignore_index=True).to_csv(a.out / "fill-samples.csv", index=False)
        stock = df.label.str.endswith("no limit")
        elastic.plot_fill(df[~stock], a.out / "fill.png", "llama-server at its defaults under a memory limit: the "
                          "budget and decode as one conversation fills the context", ref=df[stock])


def replot(out: Path) -> None:
    """fill.png again from OUT/fill-turns.csv."""
    df = pd.read_csv(out / "fill-turns.csv")
    stock = df.label.str.endswith("no limit")
    elastic.plot_fill(df[~stock], out / "fill.png", "llama-server at its defaults under a memory limit: the budget and "
                      "decode as one conversation fills the context", ref=df[stock])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    for verb in ("chat", "fill"):
        p = sub.add_parser(verb)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("settings", nargs="*", type=setting, metavar="NAME=MODEL.gguf@LIMIT_MIB[:TRACE]")
    c = sub.choices["chat"]
    c.add_argument("--repeats", type=int, default=2)
    c.add_argument("--n-prompt", type=int, default=256)
    c.add_argument("--n-gen", type=int, default=128)
    c.add_argument("--variant", action="append", default=[], help="the server point again with these flags")
    c.add_argument("--no-bench", action="store_true")
    sub.choices["fill"].add_argument("--fill-gen", type=int, default=32)
    sub.choices["fill"].add_argument("--replot", action="store_true", help="only redraw OUT/fill.png from its CSV")
    a = ap.parse_args()
    if not a.settings and not (a.verb == "fill" and a.replot):
        ap.error("give at least one setting NAME=MODEL.gguf@LIMIT_MIB[:TRACE]")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.verb == "fill" and a.replot:
        replot(a.out)
    else:
        chat(a) if a.verb == "chat" else fill(a)


if __name__ == "__main__":
    main()
