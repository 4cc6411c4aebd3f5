"""The stream tier's sizing at load as a pure function (ggml-ext/llama-moe-stream-sizing.{h,cpp}), driven
alone by tests/engine/stream_sizing.cpp, built here: auto's budget beside the dense weights, the prefetch
window and the floor; the floor giving way; the refusals under the mechanical minimum; a fixed budget's
clamp to every expert; the ceiling; the window's rules. Each figure's arithmetic is in its comment."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

MIB = 2**20
REPO = Path(__file__).resolve().parents[2]

# a model of 24 layers x 64 experts of 2 MiB (all projections), top-4, 3 projections: an entry commits up to
# 2 partial pages per projection beyond its bytes (4 KiB pages): cost 2 MiB + 24 KiB
SHAPE = dict(entry=2 * MIB, entry_cost=2 * MIB + 24 * 1024, n_expert=64, n_entries=24 * 64, total=24 * 64 * 2 * MIB)
PREFILL = dict(min_entries=64, least_entries=12)  # ubatch 512: a step can want all 64; waves: top-4 + 8
DECODE = dict(min_entries=4, least_entries=4)     # ubatch 1: top-4, no waves


@pytest.fixture(scope="module")
def sizing(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("sizing") / "stream_sizing"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(REPO / "ggml-ext"), "-o", str(exe),
                    str(REPO / "tests" / "engine" / "stream_sizing.cpp"),
                    str(REPO / "ggml-ext" / "llama-moe-stream-sizing.cpp")], check=True)

    def run(**kw) -> dict:
        args = [f"{k}={int(v)}" for k, v in kw.items()]
        out = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True).stdout.split()
        return {k: int(v) for k, v in (f.split("=") for f in out)}
    return run


def test_auto_sizes_beside_the_dense_weights_the_window_and_the_floor(sizing):
    o = sizing(is_auto=1, avail=1300 * MIB, limit=1360 * MIB, dense=400 * MIB, **SHAPE, **PREFILL)
    # cost 2121728 B; floor: 1360 / 16 = 85 MiB; window: (1300 - 400 - 85 MiB) // cost = 402 entries held, an
    # eighth = 50 (between a quarter of a layer, 16, and a whole one, 64); room 900 MiB - 50 x cost = 837632000 B,
    # less the floor: 748503040 B // cost = 352 entries of 2 MiB = 704 MiB
    assert o == dict(status=0, budget=704 * MIB, floor=85 * MIB, floor_asked=85 * MIB, prefetch=50, room_entries=352,
                     cap_entries=1536, entries=352, floor_gave_way=0, in_waves=0, clamped_to_total=0)


def test_auto_floor_is_64_mib_at_least_and_1536_at_most(sizing):
    small = sizing(is_auto=1, avail=600 * MIB, limit=640 * MIB, dense=100 * MIB, **SHAPE, **DECODE)
    big = sizing(is_auto=1, avail=23000 * MIB, limit=24576 * MIB, dense=400 * MIB, **SHAPE, **DECODE)
    assert small["floor"] == 64 * MIB and big["floor"] == 1536 * MIB
    # decode only (2 x top-4 < 64 experts): no prefetch window; the big machine holds every expert (the cap)
    assert small["prefetch"] == 0 and big["prefetch"] == 0
    assert big["entries"] == big["cap_entries"] == 1536 and big["budget"] == 3072 * MIB
    # the small one: (600 - 100 - 64 MiB) // cost = 457178624 // 2121728 = 215 entries
    assert small["entries"] == 215 and small["budget"] == 430 * MIB


def test_auto_floor_gives_way_to_the_minimum_while_64_mib_stay_free(sizing):
    # room 420 - 150 MiB, less a window of 16 (the least: 420 - 150 - 85 MiB holds 91 entries, an eighth is 11)
    # = 249167872 B; less the floor of 85 MiB: 160038912 B // cost = 75 entries, over the 64 of the minimum
    kept = sizing(is_auto=1, avail=420 * MIB, limit=1360 * MIB, dense=150 * MIB, **SHAPE, **PREFILL)
    assert kept["prefetch"] == 16 and kept["entries"] == 75 and kept["floor_gave_way"] == 0
    # 100 MiB less: room 144310272 B, 26 entries beside the floor, under 64; without the floor 64 entries leave
    # 144310272 - 64 x cost = 8519680 B, under 64 MiB: the floor holds, and steps that need more run in waves
    tight = sizing(is_auto=1, avail=320 * MIB, limit=1360 * MIB, dense=150 * MIB, **SHAPE, **PREFILL)
    assert tight["floor_gave_way"] == 0 and tight["entries"] == 26 and tight["in_waves"] == 1 and tight["status"] == 0
    # with a floor asked at 300 MiB and room for 64 entries plus 64 MiB: the floor gives way to what is left
    gave = sizing(is_auto=1, avail=600 * MIB, limit=1360 * MIB, dense=150 * MIB, floor=300 * MIB, **SHAPE, **PREFILL)
    room = 450 * MIB - gave["prefetch"] * SHAPE["entry_cost"]
    assert gave["floor_gave_way"] == 1 and gave["entries"] == 64 and gave["floor_asked"] == 300 * MIB
    assert gave["floor"] == room - 64 * SHAPE["entry_cost"] and gave["floor"] >= 64 * MIB


def test_auto_under_the_mechanical_minimum_is_refused(sizing):
    o = sizing(is_auto=1, avail=200 * MIB, limit=1360 * MIB, dense=150 * MIB, **SHAPE, **PREFILL)
    assert o["status"] == 1 and o["entries"] < PREFILL["least_entries"]


def test_auto_ceiling_caps_the_budget(sizing):
    o = sizing(is_auto=1, avail=23000 * MIB, limit=24576 * MIB, dense=400 * MIB, ceil=1001 * MIB, **SHAPE, **DECODE)
    assert o["cap_entries"] == 500 and o["entries"] == 500 and o["budget"] == 1000 * MIB


def test_a_fixed_budget_is_checked_against_the_minimum_and_clamped_to_every_expert(sizing):
    under = sizing(is_auto=0, budget=23 * MIB, limit=1360 * MIB, **SHAPE, **PREFILL)
    at = sizing(is_auto=0, budget=24 * MIB, limit=1360 * MIB, **SHAPE, **PREFILL)
    over = sizing(is_auto=0, budget=4000 * MIB, limit=1360 * MIB, **SHAPE, **PREFILL)
    assert under["status"] == 1 and at["status"] == 0 and at["budget"] == 24 * MIB  # least: 12 x 2 MiB
    assert over["clamped_to_total"] == 1 and over["budget"] == 3072 * MIB
    # a fixed budget's window is a quarter of a layer, never sized from the memory; its floor is auto's
    assert at["prefetch"] == 16 and at["floor"] == 85 * MIB


def test_the_window_as_asked(sizing):
    whole = sizing(is_auto=1, avail=1300 * MIB, limit=1360 * MIB, dense=400 * MIB, prefetch=1, **SHAPE, **PREFILL)
    some = sizing(is_auto=1, avail=1300 * MIB, limit=1360 * MIB, dense=400 * MIB, prefetch=5, **SHAPE, **PREFILL)
    off = sizing(is_auto=1, avail=1300 * MIB, limit=1360 * MIB, dense=400 * MIB, prefetch=0, **SHAPE, **PREFILL)
    assert (whole["prefetch"], some["prefetch"], off["prefetch"]) == (64, 5, 0)
    # each window entry is one entry less of auto's budget: 352 + 50 = 402 with the window off
    assert off["entries"] == 402 and whole["entries"] == 402 - 64 and some["entries"] == 402 - 5
