import subprocess, sys
from pathlib import Path
from pybmoe.bench import stream
from pybmoe.engine import memlimit
model = Path("/work/models/A-L24-E128-K8-q4_0.gguf"); trace = Path("/work/traces/uniform-A.csv")
limit = int(model.stat().st_size / 2**20 / 8)
for name, pt in (("waves", stream.StreamPoint("defaults", "auto")), ("mmap8", stream.StreamPoint("mmap"))):
    cmd = stream.bench_command(model, pt, "pp", n_prompt=512, n_gen=0, threads=2, ubatch=512, io_threads=None,
                               floor_mib=None, route_replay=trace)
    with memlimit.MemoryLimit(limit) as lim:
        memlimit.drop_caches()
        full = lim.wrap(["perf", "record", "-F", "499", "-g", "-o", f"/work/bench/prof/{name}.data", "--"] + cmd)
        r = subprocess.run(full, capture_output=True, text=True)
        print(name, r.returncode, r.stdout.strip().splitlines()[-1][:200] if r.stdout.strip() else r.stderr[-500:])
