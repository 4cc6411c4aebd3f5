"""C 3x granite at the defaults with one compute thread (-t 1), reads behind compute on every step (the first
version, prefill steps included) against PYBMOE_MOE_STREAM_OVERLAP=0: decode (tg32) and prefill (pp32), cold,
3 alternating rounds. Writes c3-granite-t1.csv (run it from the repository root; paths are this machine's)."""
import os, sys
from pathlib import Path
import pandas as pd
from pybmoe.bench import stream
from pybmoe.engine import memlimit
model=Path("/work/models/C-L16-E256-K8-q4_k.gguf"); trace=Path("/work/traces/granite-C.csv")
limit=int(model.stat().st_size/2**20/3)
rows=[]
with memlimit.MemoryLimit(limit) as lim:
    for mode in ("tg","pp"):
        for rep in range(3):
            for label in (("on","off") if rep%2==0 else ("off","on")):
                os.environ["PYBMOE_MOE_STREAM_OVERLAP"]="0" if label=="off" else "1"
                r=stream.run_point(model, stream.StreamPoint("defaults","auto"), mode, limit=lim, cold=True, log_path=Path(f"logs/{mode}-{label}-{rep}.log"), n_prompt=32, n_gen=32, threads=1, ubatch=512, io_threads=None, floor_mib=None, route_replay=trace)
                rows.append(dict(mode=mode,point=label,rep=rep,ts=r["avg_ts"],io=r.get("stream_io_wait_s")))
                print(rows[-1], flush=True)
d=pd.DataFrame(rows); d.to_csv("c3-granite-t1.csv",index=False)
print(d.groupby(["mode","point"]).agg(ts=("ts","median"),io=("io","median")))
