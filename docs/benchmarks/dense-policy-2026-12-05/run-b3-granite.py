"""B 3x granite, tg32, cold, rotating rounds: the defaults against a fixed budget equal to theirs (686 MiB after
the contexts, mmap dense weights as auto picks) and the best fixed point's 777 MiB (mmap)."""
import sys
from pathlib import Path
import pandas as pd
from pybmoe.bench import stream
from pybmoe.engine import memlimit
out = Path("/work/bench/b3g"); rows = []
model = Path("/work/models/B-L24-E64-K4-q8_0.gguf"); limit = int(model.stat().st_size / 2**20 / 3)
pts = [stream.StreamPoint("defaults", "auto"), stream.StreamPoint("stream", "686", "mmap"), stream.StreamPoint("stream", "777", "mmap")]
with memlimit.MemoryLimit(limit) as lim:
    for rep in range(int(sys.argv[1])):
        k = rep % len(pts)
        for pt in pts[k:] + pts[:k]:
            r = stream.run_point(model, pt, "tg", limit=lim, cold=True, log_path=out / "logs" / f"{pt.name.replace(':', '-')}-{rep}.log",
                                 n_prompt=1, n_gen=32, threads=2, ubatch=512, io_threads=None, floor_mib=None,
                                 route_replay=Path("/work/traces/granite-B.csv"))
            rows.append(dict(point=pt.name, repeat=rep, ts=r["avg_ts"], hit_pct=r.get("stream_hit_pct"), io_wait_s=r.get("stream_io_wait_s"),
                             read_mib_per_token=r.get("stream_read_mib_per_token"), peak_mib=r.get("peak_mib")))
            print(pt.name, rep, round(r["avg_ts"], 2), file=sys.stderr, flush=True)
            pd.DataFrame(rows).to_csv(out / "b3g-runs.csv", index=False)
d = pd.DataFrame(rows); d["ms_per_mib"] = d.io_wait_s * 1000 / (d.read_mib_per_token * 33)
print(d.groupby("point").agg(ts=("ts", "median"), hit=("hit_pct", "median"), ms_per_mib=("ms_per_mib", "median"), peak=("peak_mib", "median")).round(3).to_string())
