"""The ggml half of the split: the CPU skip table is exact and no other device accepts it."""
from __future__ import annotations

import re
import subprocess

from pybmoe import engine


def test_skip_table_cpu_kernels_and_device_guard(rpc):
    r = subprocess.run([str(engine.find_binary("pybmoe-test-skip")), rpc.endpoint],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"devices checked: (\d+) \((\d+) non-CPU\)", r.stdout)
    assert m and int(m.group(2)) >= 1, r.stdout  # the RPC device was checked
    m = re.search(r"^(\d+) passed, (\d+) failed$", r.stdout, re.M)
    assert m and int(m.group(1)) >= 96 and m.group(2) == "0", r.stdout
