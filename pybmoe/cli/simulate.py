"""``pybmoe simulate TRACE``: replay expert-cache policies over a routing trace
(:mod:`pybmoe.routing.sim`), with a report, a tidy CSV and a plot (:mod:`pybmoe.bench.plot`)."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd

from ..bench import plot
from ..routing import sim
from ..routing import trace as tr


def _values(text: str, cast: Callable[[str], float]) -> list[float]:
    """``A,B,C`` or ``A:B[:STEP]`` (inclusive) into a list of values."""
    out: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if ":" in part:
            bits = [cast(x) for x in part.split(":")]
            if len(bits) not in (2, 3) or (len(bits) == 3 and bits[2] <= 0):
                raise sim.BudgetError(f"range {part!r}; accepted: START:STOP[:STEP] with STEP > 0")
            lo, hi = bits[0], bits[1]
            step = bits[2] if len(bits) == 3 else 1
            n = int(math.floor((hi - lo) / step + 1e-9)) + 1
            out += [cast(f"{lo + i * step:.12g}") for i in range(max(n, 0))]
        elif part:
            out.append(cast(part))
    if not out:
        raise sim.BudgetError(f"budget {text!r} has no value; accepted: N, A,B,C or START:STOP[:STEP]")
    return out


def _mib(text: str, flag: str, *, positive: bool = False, total: float | None = None) -> list[float]:
    """``--mib`` / ``--expert-mib`` values (one, ``A,B,C`` or ``START:STOP[:STEP]``): finite MiB, >= 0
    (``positive``: > 0). Raises :class:`sim.BudgetError` in one line naming the accepted range
    (with ``total``, the MiB that hold every expert of the trace)."""
    lo = "> 0" if positive else ">= 0"
    hold = f"; {total:.6g} MiB hold every expert of the trace" if total else ""
    accepted = f"accepted: a finite number of MiB {lo}{' per device' if flag == '--mib' else ''}{hold}"
    try:
        values = _values(text, float)
    except ValueError:
        raise sim.BudgetError(f"{flag} {text}; {accepted}") from None
    for v in values:
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise sim.BudgetError(f"{flag} {text}; {accepted}")
    return values


def _parse_policies(text: str) -> list[str]:
    ps = list(sim.POLICIES) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    for p in ps:
        if p not in sim.POLICIES:
            raise sim.PolicyError(f"policy {p!r}; accepted: {', '.join(sim.POLICIES)} or all")
    return ps


def _window(text: str) -> int:
    """``--admit-window``: an integer >= 1 (steps)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1 or str(v) != text.strip():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; accepted: an integer >= 1 (steps)")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    """``pybmoe simulate TRACE --policy P BUDGET [...]``; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="pybmoe simulate",
        description="Replay expert-cache policies over a routing trace (engine CSV, Parquet, granite JSON or "
                    "JSONL route log). Each workload starts cold. Give exactly one kind of budget; each takes "
                    "one value, a list A,B,C or a range START:STOP[:STEP].",
        epilog="Policies: layer-lru (the VRAM tier's policy, exactly: lag, staging, insert cap), pool (the VRAM "
               "tier's pool: one bank of --mib per device over all layers, the engine's lag, a per-layer floor of "
               "half the top-k), pool-global (no floor), pool-classlru (ClassLRU's victim), classlru (upstream's "
               "cache since b12170 as published), global-lru-scan "
               "(the disk tier's, exactly: global LRU whose scans, steps too big for a pass to fit, enter at the "
               "least recent end), global-lru, fifo, lfu, belady (oracle), static (in-sample hot set). "
               "See docs/traces.md.")
    ap.add_argument("trace", type=Path, help="trace file, or granite (the bundled granite-3.0-1b-a400m trace)")
    ap.add_argument("--policy", default="layer-lru",
                    help=f"one or more of {', '.join(sim.POLICIES)} (comma-separated) or 'all' (default %(default)s)")
    b = ap.add_mutually_exclusive_group()
    b.add_argument("--slots-per-layer", metavar="N", help="slots per cached layer")
    b.add_argument("--budget-entries", metavar="N", help="(layer, expert) entries in all")
    b.add_argument("--fraction", metavar="F", help="fraction 0..1 of all (layer, expert) entries")
    b.add_argument("--mib", metavar="M", help="MiB of expert slots per device: the pool's bank (per-layer slots "
                                             "get M / n_layer each); needs -m MODEL.gguf or --expert-mib")
    ap.add_argument("-m", "--model", type=Path, help="GGUF model whose expert size converts --mib")
    ap.add_argument("--expert-mib", metavar="X", default=None,
                    help="MiB of one expert (up + gate + down), instead of -m, to convert --mib")
    ap.add_argument("--phase", choices=tr.PHASE_CHOICES, default="decode", help="lookups counted (default %(default)s)")
    ap.add_argument("--inserts", type=int, default=None,
                    help="layer-lru upload cap per layer per step, 0 = unlimited (default: the trace header's, else 0)")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="largest ubatch (tokens) the engine cache serves (default: the trace header's max_batch, else 1)")
    ap.add_argument("--admit", choices=sim.ADMISSIONS, default="always",
                    help="layer-lru admission rule: always upload a miss (the engine today), or second-miss: "
                         "only an expert that also missed within the last --admit-window steps of its layer "
                         "(default %(default)s)")
    ap.add_argument("--admit-window", type=_window, default=None, metavar="N",
                    help=f"second-miss's window in steps of the layer (default {sim.DEFAULT_ADMIT_WINDOW})")
    ap.add_argument("--lend", type=int, default=None, metavar="N",
                    help="entries the stream tier's prefetch window lends to decode (global-lru, global-lru-scan; "
                         "default: the trace header's stream_lend, else 0)")
    ap.add_argument("--workload", default=None, help="replay only this workload")
    ap.add_argument("--csv", action="store_true", help="print tidy CSV: one row per workload, policy and budget")
    ap.add_argument("-o", "--output", type=Path, default=None, help="also write the tidy CSV here")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of hit rate against budget, one line per policy")
    ap.add_argument("--batch-table", default=None, metavar="B,B,...",
                    help="also print the misses-per-token table at these decode batch sizes (layer-lru, at the slot budgets)")
    ap.add_argument("--verify", action="store_true",
                    help="compare the layer-lru replay with the trace's own hit column, event for event; "
                         "exit 1 on any difference (default budget: the header's slots)")
    ap.add_argument("--backend", choices=sim.BACKENDS, default="auto",
                    help="replay core: auto and c both name the compiled core, the only one (default %(default)s)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    err = sys.stderr
    if a.admit_window is not None and a.admit == "always":
        ap.error("--admit-window applies to --admit second-miss only")
    if a.admit != "always":
        if a.verify:
            ap.error(f"--verify replays the engine, which admits every miss; --admit {a.admit} does not apply")
        try:
            others = [p for p in _parse_policies(a.policy) if p != "layer-lru"]
        except ValueError:
            others = []              # reported below with the other errors
        if others:
            ap.error(f"--admit {a.admit} is modelled for layer-lru only; --policy also names {', '.join(others)}")
    try:
        t = tr.read_trace(a.trace)
        if a.workload:
            t = t.select("all", a.workload)
        rp = sim.Replay(t)
        if a.verify:
            slots = int(a.slots_per_layer) if a.slots_per_layer else None
            r = sim.engine_replay(rp, slots_per_layer=slots, inserts=a.inserts, max_batch=a.max_batch, backend=a.backend)
            bad = sim.compare_with_engine(rp, r)
            print(f"verify: layer-lru, {r.budget_entries // rp.n_layer} slots/layer, inserts {r.inserts}: "
                  f"{len(bad)} of {rp.n_rows} lookups differ from the engine")
            if len(bad):
                print(bad.head(20).to_string(index=False))
            return 1 if len(bad) else 0
        kinds = {"slots_per_layer": a.slots_per_layer, "budget_entries": a.budget_entries,
                 "fraction": a.fraction, "mib": a.mib}
        given = {k: v for k, v in kinds.items() if v is not None}
        if not given and t.meta.slots is not None:
            given = {"slots_per_layer": str(t.meta.slots)}
        if not given:
            raise sim.BudgetError("no budget; accepted: one of --slots-per-layer, --budget-entries, --fraction, --mib")
        (kind, text), = given.items()
        expert_bytes = None
        if a.expert_mib is not None:
            if a.model is not None:
                raise sim.BudgetError("give -m MODEL.gguf or --expert-mib, not both; accepted: one of them")
            expert_bytes = _mib(a.expert_mib, "--expert-mib", positive=True)[0] * 2**20
        elif kind == "mib" and a.model is not None:
            expert_bytes = sim.gguf_expert_bytes(a.model)[0]
        if kind == "mib":
            total = rp.n_entries * expert_bytes / 2**20 if expert_bytes else None
            values = _mib(text, "--mib", total=total)
            if expert_bytes is None:
                raise sim.BudgetError("--mib needs the MiB of one expert; accepted: -m MODEL.gguf or --expert-mib X")
        else:
            values = _values(text, float if kind == "fraction" else int)
        policies = _parse_policies(a.policy)
        df = sim.sweep(rp, policies, [(kind, v) for v in values], phase=a.phase, inserts=a.inserts,
                       max_batch=a.max_batch or int(t.meta.extra.get("max_batch", 1)), expert_bytes=expert_bytes,
                       admit=a.admit, admit_window=a.admit_window, backend=a.backend,
                       progress=False if a.no_progress else None,
                       lend_entries=int(t.meta.extra.get("stream_lend", 0)) if a.lend is None else a.lend)
    except (OSError, ValueError) as e:
        print(f"pybmoe simulate: error: {e}", file=err)
        return 2
    if expert_bytes:
        df["budget_mib"] = df["budget_entries"] * (expert_bytes / 2**20)    # beside the slots
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(a.output, index=False)
    if a.csv:
        try:
            df.to_csv(sys.stdout, index=False, lineterminator="\n")
            sys.stdout.flush()
        except BrokenPipeError:          # e.g. piped into head
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    else:
        _print_report(rp, df, a.phase, expert_bytes / 2**20 if expert_bytes else None)
    if a.batch_table:
        slot_values = sorted({int(round(s)) for s in df["slots_per_layer"]})
        mpt = sim.misses_per_token(rp, slot_values, [int(x) for x in a.batch_table.split(",")],
                                   inserts=a.inserts or 0, backend=a.backend)
        table = mpt.pivot(index="slots_per_layer", columns="batch", values="misses_per_token")
        print("\nmisses per token per layer at decode batch b (layer-lru):", file=err if a.csv else sys.stdout)
        print(table.to_string(float_format=lambda x: f"{x:.3f}"), file=err if a.csv else sys.stdout)
    if a.plot:
        plot.hit_rate_plot(df, a.plot, n_layer=rp.n_layer, top_k=rp.top_k, n_expert=rp.n_expert,
                           title=f"{a.trace.name} ({a.phase})")
        print(f"plot written to {a.plot}", file=err)
    return 0


def _slots(x: float) -> str:
    """A slot count: ``8``, or ``4.17`` where a budget in entries or MiB is not whole slots per layer."""
    return f"{int(round(x))}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def _table(df: pd.DataFrame) -> str:
    return df.to_string(index=False, float_format=lambda x: f"{x:.3f}", formatters={"slots_per_layer": _slots})


def _print_report(rp: sim.Replay, df: pd.DataFrame, phase: str, expert_mib: float | None = None) -> None:
    cyc = sim.token_cycle(rp.n_layer, rp.top_k, rp.n_expert)
    print(f"{len(rp.workloads)} workload(s), {rp.n_layer} layers x {rp.n_expert} experts, top-{rp.top_k}; "
          f"token cycle {cyc} entries ({rp.top_k} slots/layer); phase {phase}")
    if (df["admit"] != "always").any():
        print(f"admission: {df['admit'].iloc[0]}, window {df['admit_window'].iloc[0]} steps (layer-lru)")
    mib = ["budget_mib"] if expert_mib else []
    cols = ["workload", "policy", "budget_entries", *mib, "slots_per_layer", "accesses", "misses", "hit_rate",
            "uploads", "wasted", "reach_tokens"]
    print(_table(df[cols]))
    if len(rp.workloads) > 1:
        p = sim.pooled(df)
        print("\nall workloads:")
        if mib:
            p["budget_mib"] = p["budget_entries"] * expert_mib
        print(_table(p[["policy", "budget_entries", *mib, "slots_per_layer", "accesses", "misses", "hit_rate",
                        "uploads", "wasted"]]))
    below = df[df["budget_entries"] < cyc]
    if len(below):
        print(f"\nnote: budgets below the token cycle ({cyc} entries): a global LRU evicts what the next token "
              f"needs (0% hit at or below {sim.zero_hit_entries(rp.n_layer, rp.top_k, rp.n_expert)} entries).")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
