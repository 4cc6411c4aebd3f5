"""pybmoe.bench.disk.probe: O_DIRECT reads of the model's own expert projections, into reused or fresh pages."""
from __future__ import annotations

import numpy as np
import pytest

from pybmoe.bench import disk


@pytest.mark.parametrize("fresh", [False, True])
def test_the_probe_reads_distinct_expert_windows_of_the_file(model_q8, fresh):
    windows, size = disk.expert_windows(model_q8)
    p = disk.probe(model_q8, lanes=2, total_mib=4.0, fresh=fresh)
    assert p.fresh is fresh and p.lanes == 2 and p.read_bytes == size
    assert p.reads == min(len(windows), max(2, int(4.0 * disk.MIB / size)))
    assert p.mib_s > 0 and p.seconds > 0
    assert all(off % disk.ALIGN == 0 and length % disk.ALIGN == 0 for off, length in windows)


@pytest.mark.parametrize("kw", [dict(lanes=0), dict(lanes=65), dict(total_mib=0.0)])
def test_bad_arguments_are_refused(model_q8, kw):
    with pytest.raises(ValueError, match="accepted"):
        disk.probe(model_q8, **kw)


def test_a_steps_reads_merge_consecutive_experts_as_the_tier_does():
    # two expert tensors of 8 experts, 5000 bytes each (not page multiples: the windows are aligned out)
    tensors = [(8192, 5000, 8), (8192 + 40000, 5000, 8)]
    got = disk.step_reads(tensors, np.array([1, 2, 3, 6]))
    want = []
    for off, per, _ in tensors:
        for a, b in ((1, 4), (6, 7)):  # the runs 1..3 and 6
            w0 = (off + a * per) // 4096 * 4096
            w1 = -(-(off + b * per) // 4096) * 4096
            want.append((w0, w1 - w0))
    assert got == want


def test_the_steps_probe_reads_top_k_experts_of_one_layer_per_step(model_q8):
    layers = disk.expert_layers(model_q8)
    assert layers and all(len({n for _, _, n in ts}) == 1 for ts in layers.values())
    p = disk.probe(model_q8, lanes=2, total_mib=2.0, top_k=3)
    assert p.top_k == 3 and p.lanes == 2 and p.mib_s > 0 and p.seconds > 0 and not p.fresh
    n_proj = len(next(iter(layers.values())))
    assert p.reads >= n_proj  # at least one step: one read per projection or more
    with pytest.raises(ValueError, match="accepted"):
        disk.probe(model_q8, top_k=0)
    with pytest.raises(ValueError, match="accepted"):
        disk.probe(model_q8, top_k=2, fresh=True)


def test_the_record_layout_reads_one_run_of_whole_experts_per_read():
    """The sidecar layout of issue 23's read shape: expert e's record (the three projections' bytes)
    at the layer's first tensor + e * record; the run 1..3 is one read, 6 another; same bytes as the
    GGUF layout's six reads, give or take the alignment."""
    tensors = [(8192, 5000, 8), (8192 + 40000, 5000, 8), (8192 + 80000, 6000, 8)]
    rec = 16000
    got = disk.record_reads(tensors, np.array([1, 2, 3, 6]))
    want = []
    for a, b in ((1, 4), (6, 7)):
        w0 = (8192 + a * rec) // 4096 * 4096
        w1 = -(-(8192 + b * rec) // 4096) * 4096
        want.append((w0, w1 - w0))
    assert got == want
    gguf = disk.step_reads(tensors, np.array([1, 2, 3, 6]))
    assert len(gguf) == 6 and abs(sum(n for _, n in got) - sum(n for _, n in gguf)) <= 6 * 4096


def test_the_record_probe_reads_the_same_experts_in_fewer_reads(model_q8):
    a = disk.probe(model_q8, lanes=2, total_mib=2.0, top_k=3, seed=5)
    b = disk.probe(model_q8, lanes=2, total_mib=2.0, top_k=3, seed=5, layout="record")
    assert a.layout == "gguf" and b.layout == "record" and b.mib_s > 0
    n_proj = len(next(iter(disk.expert_layers(model_q8).values())))
    assert b.reads * n_proj == a.reads  # the same steps: one read per run instead of one per projection and run
    for kw in (dict(layout="sidecar", top_k=3), dict(layout="record")):
        with pytest.raises(ValueError, match="accepted"):
            disk.probe(model_q8, **kw)
