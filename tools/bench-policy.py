#!/usr/bin/env python3
"""Policy study (issue 23, item 4): the global LRU of the disk tier against ARC, LRU-2, S3-FIFO,
W-TinyLFU, LFU, FIFO, Belady (the offline ceiling) and a cross-layer co-activation prefetcher.

A benchmark of counts (no engine, no device). The cache holds (layer, expert) entries of size 1
under a budget in entries, fed in decode order (per token, per MoE layer, the top-k in router
rank order); every workload starts from a cold cache.

Implementations:

* ``lru``, ``arc``, ``lru-2``, ``s3-fifo``, ``w-tinylfu``, ``lfu``, ``fifo``, ``belady``:
  libcachesim (PyPI ``libcachesim``, tested with 0.3.5) at its defaults (LRUK k=2; S3FIFO small
  queue 10 %, ghost 90 %, move threshold 2; WTinyLFU window 1 % over SLRU), one request per
  lookup, key ``layer * n_expert + expert + 1``, size 1, replayed from oracleGeneral files (the
  next-access times that libcachesim's Belady needs). libcachesim admits per *request*: a miss
  may evict an entry that a later rank of the same layer step needs.
* ``global-lru``: ``pybmoe.routing.sim`` (the compiled core), the engine's disk-tier policy in
  decode (``global-lru-scan`` equals it there: no decode step wants half a layer; checked). It
  admits per *layer step*: the step's lookups see the cache as it was, then its misses are
  admitted together, never evicting an entry the step needs. ``belady-step``: pybmoe's Belady,
  the same step semantics.
* ``coact-m{M}``: this script's step LRU (identical to ``global-lru`` with M = 0, checked at every
  budget of every trace) plus a prefetcher: counts ``C[L][e][e']`` of (layer L selected e, layer
  L+1 selected e') learned online from the trace so far (kept across workloads; the cache is not);
  once layer L's experts S are known (after its step), layer L+1's experts are scored by
  ``sum_{e in S} C[L][e][:]`` and the M best with a positive score that are not resident are
  inserted as the most recent entries, best last, evicting the least recent entries that layer L's
  step does not need, as admissions do. ``prefetches`` counts them, ``wasted_prefetches`` those
  never looked up before they left the cache (evicted) or the workload ended;
  ``bytes_read_entries`` = misses + prefetches. The last layer prefetches nothing.

Two oracles tie the implementations together, printed and written to ``oracle.csv``:
(1) at request granularity (the trace recast as one lookup per step: 1 layer of n_layer*n_expert
experts, top-1), pybmoe's ``global-lru`` and ``fifo`` equal libcachesim's ``LRU`` and ``FIFO``
hit for hit at every budget; (2) on the real layer steps, pybmoe's ``global-lru`` against
libcachesim's ``LRU`` (they differ by the step semantics above; the figures say by how much).

Budgets: 8 points from the token cycle (n_layer x top_k) to 75 % of all (layer, expert) entries,
evenly spaced and rounded. Writes ``OUT/policy-study.csv``, ``OUT/oracle.csv``,
``OUT/summary.csv`` (relative miss reduction per trace and policy, min / median / max over the
budgets, and the largest hit-rate loss) and ``OUT/policy-study.png``.

    python tools/bench-policy.py --out docs/benchmarks/policy-study-2026-12-05
    python tools/bench-policy.py --replot          # redraw the PNG from the CSV
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybmoe.routing import sim  # noqa: E402
from pybmoe.routing import trace as tr  # noqa: E402
from pybmoe.routing.granite import GRANITE_TRACE  # noqa: E402

COLUMNS = ["trace", "policy", "budget_entries", "budget_frac", "lookups", "hits", "hit_rate", "misses",
           "prefetches", "wasted_prefetches", "bytes_read_entries", "impl"]
LCS_POLICIES = {"lru": ("LRU", {}), "arc": ("ARC", {}), "lru-2": ("LRUK", {"k": 2}), "s3-fifo": ("S3FIFO", {}),
                "w-tinylfu": ("WTinyLFU", {}), "lfu": ("LFU", {}), "fifo": ("FIFO", {}), "belady": ("Belady", {})}
#: The candidates the adoption rule is applied to, with the baseline of the same semantics.
CANDIDATES = {"arc": "lru", "lru-2": "lru", "lru-2-hist": "lru", "s3-fifo": "lru", "w-tinylfu": "lru", "lfu": "lru", "fifo": "lru"}
REFERENCE = {"belady": "lru", "belady-step": "global-lru"}


# --------------------------------------------------------------------------- traces

class Study:
    """One trace in decode order: per workload, the keys (0-based ``layer * n_expert + expert``)
    and the layer steps."""

    def __init__(self, name: str, t: tr.Trace):
        self.name = name
        self.trace = t.select("decode")
        m = self.trace.meta
        self.n_layer = len(self.trace.layers)
        self.n_expert, self.top_k = m.n_expert, m.n_expert_used
        f = self.trace.frame.sort_values(["workload", "ubatch", "token", "layer", "rank"], kind="stable")
        self.workloads = []
        for w in self.trace.workloads:
            g = f[f["workload"] == w]
            lay = np.searchsorted(self.trace.layers, g["layer"].to_numpy()).astype(np.int64)  # 0 .. n_layer-1
            keys = lay * self.n_expert + g["expert"].to_numpy().astype(np.int64)
            step = np.r_[0, np.flatnonzero((np.diff(g["token"].to_numpy()) != 0) | (np.diff(lay) != 0)) + 1,
                         len(keys)]
            self.workloads.append((w, keys, lay, step))
        self.lookups = sum(len(k) for _, k, _, _ in self.workloads)
        self.n_entries = self.n_layer * self.n_expert
        self.cycle = self.n_layer * self.top_k

    def budgets(self, points: int) -> list[int]:
        hi = round(0.75 * self.n_entries)
        return sorted({int(round(b)) for b in np.linspace(self.cycle, hi, points)})


# --------------------------------------------------------------------------- libcachesim

_ORACLE_DT = np.dtype([("ts", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


def write_oracle_general(path: str, keys: np.ndarray) -> None:
    """libcachesim's oracleGeneral binary trace: timestamp, obj_id (key + 1), size 1, next access
    (the index of the key's next request, -1 for none)."""
    n = len(keys)
    a = np.zeros(n, _ORACLE_DT)
    a["ts"] = np.arange(n)
    a["id"] = keys + 1
    a["size"] = 1
    nxt = np.full(n, -1, np.int64)
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        k = int(keys[i])
        nxt[i] = last.get(k, -1)
        last[k] = i
    a["next"] = nxt
    a.tofile(path)


def lcs_hits(lcs, cls_name: str, kwargs: dict, files: list[tuple[str, int]], budget: int) -> int:
    """Hits of a libcachesim policy over the workloads' files, each from a cold cache."""
    hits = 0
    for path, n in files:
        reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
        miss_ratio, _ = getattr(lcs, cls_name)(cache_size=budget, **kwargs).process_trace(reader)
        hits += int(round((1.0 - miss_ratio) * n))
    return hits


# --------------------------------------------------------------------------- the step LRU and the prefetcher

def _evict(cache: OrderedDict, need: set, n: int, unused: set) -> int:
    """Evict the ``n`` least recent entries not in ``need``; returns how many were unused prefetches."""
    victims = []
    if n > 0:
        for v in cache:
            if v not in need:
                victims.append(v)
                if len(victims) == n:
                    break
    wasted = 0
    for v in victims:
        del cache[v]
        if v in unused:
            unused.discard(v)
            wasted += 1
    return wasted


def step_lru_prefetch(st: Study, budget: int, m: int) -> dict:
    """The global LRU with pybmoe's layer-step semantics plus the co-activation prefetcher (M = m;
    m = 0 is plain ``global-lru``). See the module doc."""
    E, Ln = st.n_expert, st.n_layer
    counts = np.zeros((max(Ln - 1, 1), E, E), dtype=np.int64)  # learned across workloads
    hits = prefetches = wasted = 0
    for _, keys, lay, step in st.workloads:
        cache: OrderedDict[int, None] = OrderedDict()   # first = least recent
        unused: set[int] = set()                        # prefetched, not yet looked up
        prev_layer, prev_sel = -1, None
        for s in range(len(step) - 1):
            ks = keys[step[s]:step[s + 1]]
            layer = int(lay[step[s]])
            sel = [int(k) for k in dict.fromkeys(ks.tolist())]   # distinct, router order
            need = set(sel)
            hits += sum(1 for k in ks.tolist() if k in cache)
            # a second lookup in the same step of an entry admitted by it would hit (multi-token
            # ubatches); decode steps are one token, so every key of a step is distinct
            miss = [k for k in sel if k not in cache]
            for k in sel:
                unused.discard(k)
            # evict for the misses: least recent entries the step does not need
            free = budget - len(cache)
            wasted += _evict(cache, need, len(miss) - free, unused)
            room = budget - len(cache)
            admit = set(miss[:room])
            for k in sel:                       # recency: router order
                if k in cache:
                    cache.move_to_end(k)
                elif k in admit:
                    cache[k] = None
            # learn (L-1 -> L) from the previous step of this token
            if prev_sel is not None and prev_layer == layer - 1:
                sl = np.array([k - prev_layer * E for k in prev_sel])
                counts[prev_layer][np.ix_(sl, np.array([k - layer * E for k in sel]))] += 1
            prev_layer, prev_sel = layer, sel
            # prefetch layer + 1
            if m and layer < Ln - 1:
                score = counts[layer][np.array([k - layer * E for k in sel])].sum(axis=0)
                order = np.argsort(-score, kind="stable")
                base = (layer + 1) * E
                pick = []
                for e in order:
                    if score[e] <= 0 or len(pick) == m:
                        break
                    if base + int(e) not in cache:
                        pick.append(base + int(e))
                if pick:
                    wasted += _evict(cache, need, len(cache) + len(pick) - budget, unused)
                    pick = pick[:budget - len(cache)]
                    for k in reversed(pick):    # best last = most recent
                        cache[k] = None
                        unused.add(k)
                    prefetches += len(pick)
        wasted += len(unused)                   # never looked up by the workload's end
    return dict(hits=hits, prefetches=prefetches, wasted_prefetches=wasted)


# --------------------------------------------------------------------------- LRU-2 with retained history

def lru2_history_hits(workloads: list, budget: int) -> int:
    """Classic LRU-2 (O'Neil et al. 1993) that keeps every key's last two request times also after
    its eviction (libcachesim's LRUK forgets an evicted key's history). One request per lookup, as in
    libcachesim. Victim: among residents with one known access the earliest admitted, else the
    resident whose second-last access is the oldest."""
    import heapq
    hits = 0
    for _, keys, _, _ in workloads:
        last: dict[int, int] = {}
        prev: dict[int, int] = {}          # second-last access time
        once: OrderedDict[int, None] = OrderedDict()   # residents with one known access, admission order
        heap: list[tuple[int, int]] = []   # (second-last access, key), lazily invalidated
        resident: set[int] = set()
        for t, k in enumerate(keys.tolist()):
            if k in resident:
                hits += 1
                if k in once:
                    del once[k]
                prev[k] = last[k]
                last[k] = t
                heapq.heappush(heap, (prev[k], k))
                continue
            if len(resident) >= budget:
                if once:
                    v, _ = once.popitem(last=False)
                else:
                    while True:
                        p2, v = heapq.heappop(heap)
                        if v in resident and v not in once and prev.get(v) == p2:
                            break
                resident.discard(v)
            if k in last:
                prev[k] = last[k]
                heapq.heappush(heap, (prev[k], k))
            else:
                once[k] = None
            last[k] = t
            resident.add(k)
    return hits


# --------------------------------------------------------------------------- the study

def row(st: Study, policy: str, budget: int, hits: int, impl: str, prefetches: int = 0, wasted: int = 0) -> dict:
    misses = st.lookups - hits
    return dict(trace=st.name, policy=policy, budget_entries=budget, budget_frac=budget / st.n_entries,
                lookups=st.lookups, hits=hits, hit_rate=hits / st.lookups, misses=misses, prefetches=prefetches,
                wasted_prefetches=wasted, bytes_read_entries=misses + prefetches, impl=impl)


def run_trace(st: Study, lcs, tmp: str, points: int, ms: list[int], oracle_rows: list[dict]) -> list[dict]:
    files = []
    for i, (w, keys, _, _) in enumerate(st.workloads):
        p = os.path.join(tmp, f"{st.name}-{i}.oracleGeneral")
        write_oracle_general(p, keys)
        files.append((p, len(keys)))
    rp = sim.prepare(st.trace)
    rows = []
    for b in st.budgets(points):
        g = sim.simulate(rp, "global-lru", budget_entries=b, phase="decode")
        g_hits = int(g.summary["hits"].sum())
        scan = int(sim.simulate(rp, "global-lru-scan", budget_entries=b, phase="decode").summary["hits"].sum())
        if scan != g_hits:
            raise SystemExit(f"{st.name} @ {b}: global-lru-scan {scan} != global-lru {g_hits} in decode")
        rows.append(row(st, "global-lru", b, g_hits, "pybmoe.sim"))
        bel = int(sim.simulate(rp, "belady", budget_entries=b, phase="decode").summary["hits"].sum())
        rows.append(row(st, "belady-step", b, bel, "pybmoe.sim"))
        for name, (cls, kw) in LCS_POLICIES.items():
            rows.append(row(st, name, b, lcs_hits(lcs, cls, kw, files, b), f"libcachesim {lcs.__version__}"))
        rows.append(row(st, "lru-2-hist", b, lru2_history_hits(st.workloads, b), "this script (LRU-2, history kept)"))
        own = step_lru_prefetch(st, b, 0)
        if own["hits"] != g_hits or own["prefetches"]:
            raise SystemExit(f"{st.name} @ {b}: the study's step LRU {own['hits']} != pybmoe global-lru {g_hits}")
        for m in ms:
            r = step_lru_prefetch(st, b, m)
            rows.append(row(st, f"coact-m{m}", b, r["hits"], "this script (step LRU + prefetch)",
                            r["prefetches"], r["wasted_prefetches"]))
        lru = next(r for r in rows if r["policy"] == "lru" and r["budget_entries"] == b)
        oracle_rows.append(dict(check="steps", trace=st.name, budget_entries=b, pybmoe_policy="global-lru",
                                pybmoe_hits=g_hits, libcachesim_policy="LRU", libcachesim_hits=lru["hits"],
                                equal=g_hits == lru["hits"], study_step_lru_hits=own["hits"]))
    return rows


def request_oracle(st: Study, lcs, tmp: str, points: int) -> list[dict]:
    """pybmoe at one lookup per step against libcachesim: must be equal hit for hit."""
    parts, files = [], []
    for i, (w, keys, _, _) in enumerate(st.workloads):
        parts.append(tr.make_trace(keys.reshape(-1, 1, 1), workload=str(w), n_expert=st.n_entries))
        p = os.path.join(tmp, f"{st.name}-req-{i}.oracleGeneral")
        write_oracle_general(p, keys)
        files.append((p, len(keys)))
    rp = sim.prepare(tr.concat(parts))
    out = []
    for b in st.budgets(points):
        for ours, theirs in (("global-lru", "LRU"), ("fifo", "FIFO")):
            h = int(sim.simulate(rp, ours, budget_entries=b, phase="decode").summary["hits"].sum())
            l = lcs_hits(lcs, theirs, {}, files, b)
            out.append(dict(check="requests", trace=st.name, budget_entries=b, pybmoe_policy=ours, pybmoe_hits=h,
                            libcachesim_policy=theirs, libcachesim_hits=l, equal=h == l))
    return out


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """Per trace and policy: relative miss reduction against its baseline (min / median / max over
    the budgets), also against pybmoe's global-lru (the engine), and the largest hit-rate loss."""
    out = []
    pairs = dict(CANDIDATES, **REFERENCE, **{p: "global-lru" for p in df["policy"].unique() if p.startswith("coact-")})
    for (trace, policy), g in df.groupby(["trace", "policy"], sort=False):
        if policy not in pairs:
            continue
        g = g.set_index("budget_entries")
        base = df[(df["trace"] == trace) & (df["policy"] == pairs[policy])].set_index("budget_entries")
        eng = df[(df["trace"] == trace) & (df["policy"] == "global-lru")].set_index("budget_entries")
        red = 100.0 * (1.0 - g["misses"] / base["misses"])
        red_eng = 100.0 * (1.0 - g["misses"] / eng["misses"])
        loss = 100.0 * (base["hit_rate"] - g["hit_rate"])
        loss_eng = 100.0 * (eng["hit_rate"] - g["hit_rate"])
        out.append(dict(trace=trace, policy=policy, baseline=pairs[policy], red_min=red.min(), red_median=red.median(),
                        red_max=red.max(), red_eng_min=red_eng.min(), red_eng_median=red_eng.median(),
                        red_eng_max=red_eng.max(), max_loss_pts=max(loss.max(), 0.0),
                        max_loss_eng_pts=max(loss_eng.max(), 0.0),
                        bytes_vs_eng_median=100.0 * (g["bytes_read_entries"] / eng["bytes_read_entries"] - 1).median()))
    return pd.DataFrame(out)


def decide(summary: pd.DataFrame, gate_trace: str, bar: float, max_loss: float) -> list[str]:
    """The rule: >= ``bar`` % fewer misses than global LRU at every budget of the gate trace (against
    both the same-semantics baseline and the engine's global-lru), no more than ``max_loss`` points of
    hit rate lost at any budget of any trace."""
    adopted = []
    for policy in [p for p in summary["policy"].unique() if p not in REFERENCE]:
        s = summary[summary["policy"] == policy]
        gate = s[s["trace"] == gate_trace].iloc[0]
        ok = (min(gate["red_min"], gate["red_eng_min"]) >= bar
              and max(s["max_loss_pts"].max(), s["max_loss_eng_pts"].max()) <= max_loss)
        if ok:
            adopted.append(policy)
    return adopted


def plot(df: pd.DataFrame, names: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pols = ["global-lru", "lru", "arc", "lru-2", "lru-2-hist", "s3-fifo", "w-tinylfu", "lfu", "fifo"] + sorted(
        [p for p in df["policy"].unique() if p.startswith("coact-")], key=lambda p: int(p[7:])) + ["belady-step",
                                                                                                  "belady"]
    cmap = plt.get_cmap("tab20")
    style = {"global-lru": dict(color="k", lw=2.4), "lru": dict(color="k", ls="--", lw=1.2),
             "belady": dict(color="0.45", ls=":", lw=1.5), "belady-step": dict(color="0.45", lw=1.5)}
    for i, p in enumerate(x for x in pols if x not in style):
        style[p] = dict(color=cmap(2 * i % 20 + (i >= 10)), ls="-." if p.startswith("coact-") else "-")
    fig, axes = plt.subplots(2, len(names), figsize=(3.8 * len(names), 8.5), squeeze=False)
    for j, name in enumerate(names):
        d = df[df["trace"] == name]
        eng = d[d["policy"] == "global-lru"].set_index("budget_entries")
        for p in pols:
            g = d[d["policy"] == p].sort_values("budget_entries")
            if g.empty:
                continue
            kw = dict(style.get(p, {}))
            kw.setdefault("lw", 1.2)
            axes[0][j].plot(100 * g["budget_frac"], 100 * g["hit_rate"], marker=".", label=p, **kw)
            if p != "global-lru":
                red = 100.0 * (1.0 - g.set_index("budget_entries")["misses"] / eng["misses"])
                axes[1][j].plot(100 * g["budget_frac"], red.to_numpy(), marker=".", label=p, **kw)
        axes[0][j].set_title(name, fontsize=9)
        axes[1][j].axhline(10, color="r", lw=0.8, ls="--")
        axes[1][j].set_ylim(max(-60.0, axes[1][j].get_ylim()[0]), None)
        axes[1][j].axhline(0, color="k", lw=0.6)
        axes[1][j].set_xlabel("budget, % of (layer, expert) entries")
    axes[0][0].set_ylabel("decode hit rate, %")
    axes[1][0].set_ylabel("misses cut vs global-lru (pybmoe), %")
    axes[0][0].legend(fontsize=7, loc="lower right", ncol=2)
    fig.suptitle("Policy study: hit rate (top) and relative miss reduction against the engine's global LRU "
                 "(bottom, clipped at -60 %; red: the 10 % bar), budgets from the token cycle to 75 %", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/benchmarks/policy-study-2026-12-05")
    ap.add_argument("--synth-dir", default="/work/traces", help="granite-{A,B,C}.csv, uniform-{A,B,C}.csv")
    ap.add_argument("--points", type=int, default=8, help="budgets per trace (default 8)")
    ap.add_argument("--prefetch", default="2,4,8", help="prefetch widths M of the co-activation prefetcher")
    ap.add_argument("--bar", type=float, default=10.0, help="relative miss cut required on granite, %%")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from OUT/policy-study.csv")
    ap.add_argument("--max-loss", type=float, default=2.0, help="largest hit-rate loss allowed, points")
    a = ap.parse_args(argv)
    import libcachesim as lcs
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.replot:
        df = pd.read_csv(out / "policy-study.csv")
        plot(df, list(pd.unique(df["trace"])), out / "policy-study.png")
        print(f"wrote {out / 'policy-study.png'}")
        return 0
    ms = [int(x) for x in a.prefetch.split(",") if x.strip()]
    traces = [("granite", tr.read_trace(GRANITE_TRACE))]
    for n in ("granite-A", "granite-B", "granite-C", "uniform-A", "uniform-B", "uniform-C"):
        p = Path(a.synth_dir) / f"{n}.csv"
        if p.exists():
            traces.append((f"synth-{n}", tr.read_trace(p)))
        else:
            print(f"warning: {p} missing, skipped", file=sys.stderr)
    rows, oracle = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, t in traces:
            t0 = time.time()
            st = Study(name, t)
            if name == "granite":
                oracle += request_oracle(st, lcs, tmp, a.points)
            rows += run_trace(st, lcs, tmp, a.points, ms, oracle)
            print(f"{name}: {st.n_layer} layers x {st.n_expert} experts, top-{st.top_k}, {st.lookups} lookups, "
                  f"budgets {st.budgets(a.points)} ({time.time() - t0:.0f} s)", flush=True)
    df = pd.DataFrame(rows, columns=COLUMNS)
    orc = pd.DataFrame(oracle)
    summary = summarise(df)
    df.to_csv(out / "policy-study.csv", index=False, float_format="%.6g")
    orc.to_csv(out / "oracle.csv", index=False)
    summary.to_csv(out / "summary.csv", index=False, float_format="%.2f")
    plot(df, [n for n, _ in traces], out / "policy-study.png")
    pd.set_option("display.width", 200)
    print("\noracle (request granularity must be equal; step granularity differs by the step semantics):")
    print(orc.to_string(index=False))
    print("\nrelative miss reduction, % (red: vs its baseline; red_eng: vs pybmoe global-lru):")
    print(summary.round(2).to_string(index=False))
    adopted = decide(summary, "granite", a.bar, a.max_loss)
    print(f"\ndecision (>= {a.bar:g} % fewer misses on granite at every budget, <= {a.max_loss:g} points lost anywhere):"
          f" {', '.join(adopted) if adopted else 'nothing clears the bar'}")
    if not orc[orc["check"] == "requests"]["equal"].all():
        print("ORACLE FAILED: pybmoe and libcachesim differ at request granularity", file=sys.stderr)
        return 1
    for f in ("policy-study.csv", "oracle.csv", "summary.csv", "policy-study.png"):
        print(f"wrote {out / f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
