"""The engine's residency bookkeeping (ggml-ext/llama-moe-residency.{h,cpp}) against the simulator.

``pybmoe-test-residency`` drives the C++ bookkeeping over a trace exactly as the VRAM tier does (one
layer step per layer and ubatch, then settle and schedule) and prints its hit or miss per lookup;
the simulator's layer-lru replays the same trace. The two must agree on every lookup and on the
number of uploads, on the bundled granite trace (24 layers, 32 experts, top-8), across slot counts,
insert caps and batch sizes.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from pybmoe import engine
from pybmoe.routing import sim, trace


@pytest.fixture(scope="module")
def granite_csv(granite, tmp_path_factory):
    p = tmp_path_factory.mktemp("residency") / "granite.csv"
    trace.write_trace(granite, p, fmt="csv")
    return p


def _engine_bookkeeping(path, meta, slots: int, inserts: int, max_batch: int,
                        admit_window: int = 0, pool: int = -1) -> tuple[np.ndarray, dict[str, int]]:
    r = subprocess.run([str(engine.find_binary("pybmoe-test-residency")), str(path), str(meta.n_expert),
                        str(meta.n_expert_used), str(slots), str(inserts), str(max_batch), str(admit_window), str(pool)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("# lookups=")
    counts = {k: int(v) for k, v in (kv.split("=") for kv in lines[-1][2:].split())}
    return np.array([int(x) for x in lines[:-1]], dtype=np.int8), counts


@pytest.mark.parametrize("slots,inserts,max_batch", [
    (1, 0, 1), (3, 0, 1), (8, 0, 1), (8, 1, 1), (8, 2, 1), (16, 0, 1), (16, 3, 1), (31, 0, 1), (32, 0, 1),
    (8, 0, 4), (8, 2, 64), (0, 0, 1),
])
def test_the_engines_bookkeeping_equals_the_simulator_event_for_event(granite, granite_csv, slots, inserts, max_batch):
    got, counts = _engine_bookkeeping(granite_csv, granite.meta, slots, inserts, max_batch)
    want = sim.simulate(granite, "layer-lru", slots_per_layer=slots, inserts=inserts, max_batch=max_batch, phase="all")
    assert len(got) == len(granite.frame)
    bad = np.flatnonzero(got != want.predicted)
    assert bad.size == 0, f"{bad.size} lookups differ, first at row {bad[:5].tolist()}"
    assert counts["moves"] == int(want.summary["uploads"].sum())
    assert counts["hits"] == int((want.predicted == 1).sum())
    if slots == 0:
        assert counts["lookups"] == 0          # the tier is off: nothing is served
    else:
        assert counts["hits"] > 0 and counts["misses"] > 0
        served = int((got >= 0).sum())
        assert counts["lookups"] == served and served > 0


@pytest.mark.parametrize("slots,inserts,max_batch,window", [
    (4, 0, 1, 4), (8, 0, 1, 1), (8, 0, 1, 4), (8, 2, 1, 4), (16, 0, 1, 8), (24, 0, 1, 4), (8, 0, 4, 4),
])
def test_second_miss_admission_equals_the_simulator(granite, granite_csv, slots, inserts, max_batch, window):
    """The engine's admission rule (--moe-expert-cache-admit second-miss:W) against the simulator's
    (--admit second-miss --admit-window W): every lookup and the upload count agree, and the rule
    uploads fewer experts than admitting every miss."""
    got, counts = _engine_bookkeeping(granite_csv, granite.meta, slots, inserts, max_batch, window)
    want = sim.simulate(granite, "layer-lru", slots_per_layer=slots, inserts=inserts, max_batch=max_batch, phase="all",
                        admit="second-miss", admit_window=window)
    bad = np.flatnonzero(got != want.predicted)
    assert bad.size == 0, f"{bad.size} lookups differ, first at row {bad[:5].tolist()}"
    assert counts["moves"] == int(want.summary["uploads"].sum())
    _, always = _engine_bookkeeping(granite_csv, granite.meta, slots, inserts, max_batch, 0)
    assert counts["moves"] < always["moves"]


@pytest.mark.parametrize("entries,max_batch", [
    (24, 1),    # one slot per layer: under the floor's reach (f = 0)
    (96, 1),    # half the cache cycle (24 layers x top-8 = 192)
    (192, 1),   # the cycle
    (384, 1), (600, 1), (768, 1),   # half of all entries, and the whole model
    (192, 4), (384, 64),            # multi-token steps; 64 serves the prefills too
])
def test_the_engines_pool_equals_the_simulator_event_for_event(granite, granite_csv, entries, max_batch):
    """The pool (one bank over every layer, llama_moe_residency::add_bank) against the simulator's
    policy "pool" (floor-half-k, the engine's lag): every lookup and the upload count agree."""
    got, counts = _engine_bookkeeping(granite_csv, granite.meta, 0, 0, max_batch, 0, pool=entries)
    want = sim.simulate(granite, "pool", budget_entries=entries, max_batch=max_batch, phase="all")
    bad = np.flatnonzero(got != want.predicted)
    assert bad.size == 0, f"{bad.size} lookups differ, first at row {bad[:5].tolist()}"
    assert counts["moves"] == int(want.summary["uploads"].sum())
    assert counts["hits"] == int((want.predicted == 1).sum()) > 0 and counts["misses"] > 0


def test_a_bad_trace_is_refused_with_its_line(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("workload,phase,ubatch,token,layer,rank,expert,hit\nw,decode,0,0,0,0,99,-1\n")
    r = subprocess.run([str(engine.find_binary("pybmoe-test-residency")), str(p), "32", "8", "4", "0", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{p}:2:" in r.stderr
