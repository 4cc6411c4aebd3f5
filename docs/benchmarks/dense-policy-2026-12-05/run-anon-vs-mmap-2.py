"""The defaults (auto, dense auto -> anon then) against the same with mmap dense weights, interleaved, cold, tg32,
medians. The "floor1/8" point meant to test a 1/8 floor, but pybmoe.bench.stream never passes a floor to the
defaults point, so it ran the defaults again: auto-anon-vs-mmap-2.csv names it "defaults (2nd)", a second sample
of the same configuration (its spread against "defaults" is the run's noise)."""
import sys
from pathlib import Path
import pandas as pd
from pybmoe.bench import stream
from pybmoe.engine import memlimit
out = Path("/work/bench/floor"); rows = []
models = {"B": "/work/models/B-L24-E64-K4-q8_0.gguf", "A": "/work/models/A-L24-E128-K8-q4_0.gguf"}
settings = [("B", 5.0, "uniform"), ("B", 3.0, "uniform"), ("A", 5.0, "uniform")]
for name, f, routing in settings:
    model = Path(models[name]); limit = int(model.stat().st_size / 2**20 / f)
    pts = [("defaults", stream.StreamPoint("defaults", "auto"), None),
           ("floor1/8", stream.StreamPoint("defaults", "auto"), limit // 8),
           ("mmap-dense", stream.StreamPoint("stream", "auto", "mmap"), None)]
    with memlimit.MemoryLimit(limit) as lim:
        for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
            k = rep % len(pts)
            for tag, pt, floor in pts[k:] + pts[:k]:
                r = stream.run_point(model, pt, "tg", limit=lim, cold=True, log_path=out / "logs" / f"{name}-{f:g}x-{routing}-{tag}-{rep}.log",
                                     n_prompt=1, n_gen=32, threads=2, ubatch=512, io_threads=None, floor_mib=floor,
                                     route_replay=Path(f"/work/traces/{routing}-{name}.csv"))
                rows.append(dict(model=name, factor=f, routing=routing, limit_mib=limit, point=tag, repeat=rep, ts=r["avg_ts"],
                                 hit_pct=r.get("stream_hit_pct"), io_wait_s=r.get("stream_io_wait_s"),
                                 budget_mb=r.get("stream_budget_after_contexts_mb") or r.get("stream_budget_mb"),
                                 peak_mib=r.get("peak_mib"), major_faults=r.get("major_faults")))
                print(name, f, routing, tag, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
                pd.DataFrame(rows).to_csv(out / "floor-runs.csv", index=False)
d = pd.DataFrame(rows)
print(d.groupby(["model", "factor", "routing", "point"]).agg(ts=("ts", "median"), io=("io_wait_s", "median"), hit=("hit_pct", "median"),
      budget=("budget_mb", "median"), peak=("peak_mib", "median")).to_string())
