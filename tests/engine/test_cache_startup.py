"""A cache whose start-up fails after it has allocated its slots turns off and frees them.

The slots are allocated first; then the tier opens the GGUF again for its uploads. Here the file is
renamed between the load and the cache's start (through the C API, as the bindings call it), so the
reopen fails after the allocation. The device is the loopback ggml-rpc-server: its resident memory
grows by the slots while they exist, and must come back down.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pybmoe import models

bindings = pytest.importorskip("pybmoe.engine.bindings", reason="the llama_cpp bindings are not installed")

# experts of 0.80 MiB (3 x 256 x 1024 Q8_0 rows) with a narrow embedding: 148 MiB (n_embd 512, n_ff 512: 188 MiB)
SHAPE = dict(n_layer=4, n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=1024)

SCRIPT = r"""
import os, sys, time
from pybmoe.engine import bindings
path, endpoint, pid = sys.argv[1], sys.argv[2], sys.argv[3]

def rss_mib():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
llm = bindings.Llama(path, n_gpu_layers=99, cpu_moe=True, rpc_servers=endpoint, repack=False, verbose=True)
before = rss_mib()
os.rename(path, path + ".moved")
rc = bindings._llama_lib().llama_model_moe_cache_init(llm._model.model, 32, 0)
time.sleep(0.5)
print("rc", rc, "before", round(before, 1), "after", round(rss_mib(), 1), flush=True)
"""


def test_a_failed_start_frees_the_slots_it_allocated(rpc, tmp_path):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    copy = tmp_path / "m.gguf"
    shutil.copy(model, copy)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(copy), rpc.endpoint, str(rpc.proc.pid)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    fields = r.stdout.split()
    rc, before, after = int(fields[1]), float(fields[3]), float(fields[5])
    assert rc == bindings.LLAMA_MOE_ERR
    assert f"moe-cache: cannot open {copy}" in r.stderr and "are freed" in r.stderr, r.stderr[-3000:]
    # 32 slots (+1 zero) x 4 layers x 0.80 MiB were allocated and cleared on the device (~105 MiB)
    freed = float(r.stderr.split("MiB it had allocated are freed")[0].rsplit("(", 1)[1])
    assert freed > 60
    assert after - before < freed / 4, f"the device kept {after - before:.1f} MiB of {freed:.1f} MiB"
