"""The elastic benchmark's own arithmetic (pybmoe.bench.elastic): the fill run's turns, the medians and
their spread flag, the turns' comparison with the stock run, and the plot from a CSV's columns."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from pybmoe.bench import elastic, noise


def test_the_fill_runs_turns_reach_the_fraction_asked():
    # each turn's prompt plus its 32 answered tokens fill the fraction of the 4096-token context
    assert elastic.turn_lengths(4096, (0.05, 0.5, 0.92), 32) == [172, 2016, 3736]
    with pytest.raises(ValueError, match="growing"):
        elastic.turn_lengths(4096, (0.5, 0.25), 32)
    with pytest.raises(ValueError, match="growing"):
        elastic.turn_lengths(4096, (0.5, 1.0), 32)
    with pytest.raises(ValueError, match="first turn"):
        elastic.turn_lengths(100, (0.1, 0.5), 32)


def test_the_medians_flag_a_point_whose_repeats_spread():
    runs = pd.DataFrame(dict(setting="D", point=["server"] * 3 + ["llama-bench defaults"] * 3,
                             decode_ts=[4.0, 5.0, 6.0, 1.0, 5.0, 9.0], status="ok"))
    runs.loc[len(runs)] = dict(setting="D", point="server", decode_ts=math.nan, status="oom")
    m = elastic.medians(runs, ["setting", "point"]).set_index("point")
    assert m.loc["server", "median_ts"] == 5.0 and m.loc["server", "repeats"] == 3
    assert m.loc["server", "spread"] == pytest.approx(1.5) and not m.loc["server", "noisy"]
    assert m.loc["llama-bench defaults", "spread"] == pytest.approx(9.0)
    assert m.loc["llama-bench defaults", "noisy"] and noise.SPREAD_LIMIT < 9


def test_the_turns_are_compared_token_for_token():
    a = pd.DataFrame(dict(ids=["1 2 3", "4 5", "6"]))
    assert elastic.compare_turns(a, a.copy()) == [True, True, True]
    b = pd.DataFrame(dict(ids=["1 2 3", "4 6", "6"]))
    assert elastic.compare_turns(a, b) == [True, False, True]
    assert elastic.compare_turns(a, b.iloc[:2]) == [True, False, False]


def test_the_fill_plot_is_written(tmp_path):
    turns = pd.DataFrame(dict(label="D @ 560 MiB", fill=[0.05, 0.5, 0.92], budget_mib=[116.0, 34.0, 11.0],
                              kv_committed_mib=[8.0, 80.0, 147.0], decode_ts=[23.0, 5.4, 4.2], cycle_mb=95.6))
    ref = pd.DataFrame(dict(label="D @ 560 MiB: stock, no limit", fill=[0.05, 0.5, 0.92], decode_ts=[40.0, 14.0, 8.7]))
    p = elastic.plot_fill(turns, tmp_path / "fill.png", "t", ref=ref)
    assert p.stat().st_size > 10_000
