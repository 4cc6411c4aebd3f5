"""``pybmoe bench-stream`` end to end on the tiny model under a memory limit (the CI case): the CSVs,
the plots, the ratios over mmap, and the stream tier's columns. Timings are not asserted here; the
figures live in docs/benchmarks/."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pybmoe import models
from pybmoe.bench import stream
from pybmoe.cli import bench_stream as cli
from pybmoe.engine import memlimit

SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    out = tmp_path_factory.mktemp("bench-stream")
    return stream.bench_stream(model, out, limit_mib=1024, budgets=["8", "auto"], n_prompt=16, n_gen=4, repeats=2,
                               ubatch=16, floor_mib=0)


def test_every_point_and_mode_ran_and_was_written(result):
    runs = pd.read_csv(result.out_dir / "stream-runs.csv")
    assert set(runs.point) == {"mmap", "defaults", "stream:8", "stream:auto", "resident"}
    assert len(runs) == 5 * 2 * 2 and set(runs["mode"]) == {"pp", "tg"}
    assert (runs.avg_ts > 0).all()
    for p in ("stream-summary.csv", "stream-pp.png", "stream-tg.png"):
        assert (result.out_dir / p).stat().st_size > 0
    # issue 52, item 7: every run records the load it started under; every point its spread and flag
    assert (runs.load_1m >= 0).all()
    summary = pd.read_csv(result.out_dir / "stream-summary.csv")
    assert np.allclose(summary.spread, summary.max_ts / summary.min_ts)
    assert (summary.noisy == (summary.spread > 1.5)).all() and summary.max_load_1m.notna().all()


def test_the_stream_points_carry_the_tiers_figures_and_mmap_none(result):
    r = result.runs
    s = r[r.kind.isin(["stream", "defaults"])]
    assert s.stream_hit_pct.notna().all() and (s.stream_budget_mb > 0).all()
    assert (s[s.budget == "8"].stream_budget_mb == 8.0).all()
    assert r[~r.kind.isin(["stream", "defaults"])].stream_hit_pct.isna().all()
    assert (r.tokens > 0).all() and (r.read_mib_per_token >= 0).all()
    # a run's tokens are the ones the tier counted: llama-bench's warm-up is the whole prompt for pp (it was
    # counted as one token, which made pp's per-token figures nearly twice too large) and one token for tg
    assert (s[s["mode"] == "pp"].tokens == 2 * s[s["mode"] == "pp"].n_prompt).all()
    assert (s[s["mode"] == "tg"].tokens == s[s["mode"] == "tg"].n_gen + 1).all()
    read = s[s.stream_read_mib_per_token > 0.05]  # the tier's figure has two decimals
    assert len(read) > 0
    counted = read.stream_read_mib / read.stream_read_mib_per_token
    assert np.allclose(counted, read.tokens, rtol=0.1), list(zip(counted, read.tokens))


def test_the_summary_gives_ratios_over_mmap(result):
    s = result.summary
    assert set(s.columns) >= {"point", "mode", "n", "median_ts", "ratio", "median_hit_pct"}
    mm = s[s.point == "mmap"]
    assert np.allclose(mm.ratio, 1.0)
    for r in s.itertuples():
        base = float(mm[mm["mode"] == r.mode].median_ts.iloc[0])
        assert r.ratio == pytest.approx(r.median_ts / base)


def test_the_limit_held_or_the_reason_is_given(result):
    ok, why = memlimit.limit_available()
    if ok:
        lim = result.runs[result.runs.point != "resident"]
        assert result.limit_mib == 1024 and (lim.limit_mib == 1024).all()
        assert (lim.peak_mib.dropna() <= 1024).all()
    else:
        assert result.limit_mib is None and any(why in n for n in result.notes)


def test_each_repeat_probes_the_disk_and_every_point_gets_its_limit(result):
    """Issue 23's bound on every point: the repeat's disk probe (the model's own file, O_DIRECT, the
    tier's lanes), the resident point's compute per token, and the run's reads per token; by hand
    from the run's own columns."""
    r = result.runs
    assert (r.probe_mib_s > 0).all()
    assert (r.groupby("repeat").probe_mib_s.nunique() == 1).all()  # one probe per repeat, before its runs
    res = r[r.kind == "resident"].groupby("mode").avg_ts.median()
    for row in r.itertuples():
        compute = 1.0 / res[row.mode]
        miss = row.stream_read_mib_per_token if row.kind in ("stream", "defaults") else row.read_mib_per_token
        assert row.compute_s_per_token == pytest.approx(compute)
        assert row.miss_mib_per_token == pytest.approx(miss)
        assert row.limit_ts == pytest.approx(1.0 / (miss / row.probe_mib_s + compute))
        assert row.overlap_limit_ts == pytest.approx(1.0 / max(miss / row.probe_mib_s, compute))
        assert row.vs_limit == pytest.approx(row.avg_ts / row.limit_ts)
        assert row.overlap_limit_ts >= row.limit_ts
    s = result.summary
    assert s.median_vs_limit.notna().all() and s.median_probe_mib_s.notna().all()
    d = s[(s.point == "defaults") & (s["mode"] == "tg")].iloc[0]
    runs = r[(r.point == "defaults") & (r["mode"] == "tg")]
    assert d.median_vs_overlap_limit == pytest.approx(runs.vs_overlap_limit.median())
    assert "median_vs_limit" in stream.format_summary(s)


def test_the_limit_by_hand():
    """100 MiB a token at 1000 MiB/s and 0.05 s of compute: 1 / 0.15 s serially, 1 / 0.1 s overlapped;
    a probe that failed (NaN) or read nothing gives no limit; arrays go element by element."""
    assert stream.limit_ts(100, 1000, 0.05) == pytest.approx(1 / 0.15)
    assert stream.limit_ts(100, 1000, 0.05, overlap=True) == pytest.approx(10.0)
    assert stream.limit_ts(0, 1000, 0.05, overlap=True) == pytest.approx(20.0)
    assert np.isnan(stream.limit_ts(100, np.nan, 0.05)) and np.isnan(stream.limit_ts(100, 0, 0.05))
    got = stream.limit_ts(np.array([10.0, 200.0]), np.array([100.0, 1000.0]), np.array([0.5, 0.1]), overlap=True)
    assert got == pytest.approx([1 / 0.5, 1 / 0.2])


def test_the_chain_limit_by_hand():
    """100 MiB a token at 1000 MiB/s (0.1 s of reads), 0.05 s of compute of which 0.02 s expert
    matmuls: the reads hide behind the expert matmuls only, so 1 / (0.03 + 0.1) s; with reads shorter
    than the expert matmuls the token is its compute. It lies between the serial and the overlapped
    limit. An expert share outside [0, compute] (two resident runs noise apart) gives no limit."""
    assert stream.chain_limit_ts(100, 1000, 0.05, 0.02) == pytest.approx(1 / 0.13)
    assert stream.chain_limit_ts(10, 1000, 0.05, 0.02) == pytest.approx(20.0)
    assert stream.limit_ts(100, 1000, 0.05) < stream.chain_limit_ts(100, 1000, 0.05, 0.02) \
        < stream.limit_ts(100, 1000, 0.05, overlap=True)
    assert stream.chain_limit_ts(100, 1000, 0.05, 0.0) == pytest.approx(stream.limit_ts(100, 1000, 0.05))
    assert stream.chain_limit_ts(100, 1000, 0.05, 0.05) == pytest.approx(stream.limit_ts(100, 1000, 0.05, overlap=True))
    assert np.isnan(stream.chain_limit_ts(100, 1000, 0.05, -0.001))
    assert np.isnan(stream.chain_limit_ts(100, 1000, 0.05, 0.06))
    got = stream.chain_limit_ts(np.array([100.0, 10.0]), 1000.0, np.array([0.05, 0.05]), np.array([0.02, 0.02]))
    assert got == pytest.approx([1 / 0.13, 20.0])
    cols = stream.limit_columns(5.0, 100, 1000, 0.05, 0.02)
    assert cols["vs_chain_limit"] == pytest.approx(5.0 * 0.13)
    assert "chain_limit_ts" not in stream.limit_columns(5.0, 100, 1000, 0.05)


def test_the_expert_share_from_a_narrow_twin():
    """A model at 40 tok/s (25 ms), its twin with experts 256 wide instead of 512 at 50 tok/s (20 ms):
    the 5 ms between them are half the expert matmuls, so 10 ms. A twin as wide as the model, or a
    speed of 0, is refused."""
    assert stream.expert_seconds(40.0, 50.0, 512, 256) == pytest.approx(0.010)
    assert stream.expert_seconds(40.0, 50.0, 768, 32) == pytest.approx(0.005 * 768 / 736)
    with pytest.raises(ValueError, match="width"):
        stream.expert_seconds(40.0, 50.0, 512, 512)
    with pytest.raises(ValueError, match="positive"):
        stream.expert_seconds(0.0, 50.0, 512, 256)


def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    assert cli.main(["-m", str(model), "--out", str(tmp_path), "--budgets", "lots"]) == 2
    assert "budget 'lots'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="repeats 0"):
        stream.bench_stream(model, tmp_path, limit_mib=None, repeats=0)
    with pytest.raises(ValueError, match="probe_mib 0"):
        stream.bench_stream(model, tmp_path, limit_mib=None, probe_mib=0)
    assert not (tmp_path / "stream-runs.csv").exists()


def test_the_defaults_point_passes_auto_and_nothing_else(tmp_path):
    """The headline point is what a user who types only --moe-stream-cache-mb auto gets: no floor, no lanes,
    no dense policy on its command line; the budget points carry what they were given."""
    pts = stream.points(["300"], include_resident=False, dense=["mmap", "anon"], dense_only=True)
    assert [p.name for p in pts] == ["mmap", "defaults", "stream:300+mmap", "stream:300+anon"]
    kw = dict(n_prompt=8, n_gen=4, threads=2, ubatch=512, io_threads=None, floor_mib=None, route_replay=None)
    cmd = stream.bench_command(tmp_path / "m.gguf", pts[1], "tg", **kw)
    tier = [a for a in cmd if a.startswith("--moe-") or a.startswith("--dense")]
    assert tier == ["--moe-stream-cache-mb"] and cmd[cmd.index("--moe-stream-cache-mb") + 1] == "auto"
    fixed = stream.bench_command(tmp_path / "m.gguf", pts[3], "tg", **{**kw, "floor_mib": 0})
    assert fixed[fixed.index("--dense-weights") + 1] == "anon" and "--moe-stream-floor-mb" in fixed


@pytest.mark.parametrize("case", ["directory", "missing"])
def test_a_model_that_is_not_a_file_is_named_as_what_it_is(case, tmp_path, capsys):
    """Issue 43, item 7: `pybmoe bench-stream -m DIR` said the directory "does not exist"."""
    model = tmp_path / "models"
    if case == "directory":
        model.mkdir()
    assert cli.main(["-m", str(model), "--out", str(tmp_path / "out")]) == 2
    what = "is a directory" if case == "directory" else "does not exist"
    assert capsys.readouterr().err == f"pybmoe bench-stream: error: model {model} {what}; accepted: a GGUF file\n"
    assert not (tmp_path / "out").exists()


def _runs_by_hand() -> pd.DataFrame:
    """Two repeats of mmap, defaults, stream:8 and resident, decode only, with the columns the summary
    and the limits read (figures made up, not measured)."""
    rows = []
    for rep in range(2):
        for point, kind, ts, hit in (("mmap", "mmap", 1.0, np.nan), ("defaults", "defaults", 8.0, 80.0),
                                     ("stream:8", "stream", 6.0, 60.0), ("resident", "resident", 20.0, np.nan)):
            rows.append(dict(point=point, kind=kind, mode="tg", repeat=rep, avg_ts=ts + rep, stream_hit_pct=hit,
                             read_mib_per_token=4.0, stream_read_mib_per_token=2.0, majflt_per_token=0.0,
                             stream_io_wait_s=0.1, peak_mib=100.0, probe_mib_s=400.0))
    return pd.DataFrame(rows)


def test_the_plot_shows_the_repeats_the_hit_rate_the_limits_and_marks_the_resident_bar():
    """Issue 43, item 13: the plots showed only tok/s bars. Each repeat is now a dot, the tier's hit rate
    has its own axis, the limits are ticks, and the all-resident bar says it ran with no limit, warm."""
    from pybmoe.bench import plot
    runs = stream.add_limits(_runs_by_hand())
    summary = stream.summarize(runs)
    fig = plot.stream_figure(summary, runs, "tg", title="t")
    try:
        ax, bx = fig.axes
        labels = ax.get_legend_handles_labels()[1]
        assert {"each repeat", "min–max of the repeats", "serial limit (reads + compute)",
                "overlapped limit (max of reads, compute)", "resident: no memory limit, warm page cache"} <= set(labels)
        dots = next(c for c, lab in zip(*ax.get_legend_handles_labels()) if lab == "each repeat")
        assert sorted(dots.get_offsets()[:, 1]) == sorted(runs.avg_ts)  # every repeat, at its tok/s
        serial = next(c for c, lab in zip(*ax.get_legend_handles_labels()) if lab.startswith("serial"))
        want = summary[summary["mode"] == "tg"].median_limit_ts.to_numpy()
        assert np.allclose(serial.get_offsets()[:, 1].data, want, equal_nan=True)
        ticks = [t.get_text() for t in bx.get_xticklabels()]
        assert ticks == ["mmap", "defaults", "stream:8", "resident\n(no limit, warm)"]
        assert bx.get_ylabel() == "tier hit rate (%)"
        assert [round(p.get_height()) for p in bx.patches] == [0, 80, 60, 0]  # medians of 80 and 60 (no tier: 0)
        assert ["n/a", "80%", "60%", "n/a"] == [t.get_text() for t in bx.texts]
        resident = [p for p in ax.patches if p.get_hatch()]
        assert len(resident) == 1 and resident[0].get_x() < 3 < resident[0].get_x() + resident[0].get_width()
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_the_plots_take_the_repeats_from_the_folders_runs(tmp_path, monkeypatch):
    """bench_stream calls plot(summary, out, title): the repeats come from the stream-runs.csv it wrote."""
    from pybmoe.bench import plot
    runs = stream.add_limits(_runs_by_hand())
    runs.to_csv(tmp_path / "stream-runs.csv", index=False)
    seen = []
    monkeypatch.setattr(plot, "stream_plot", lambda summary, r, path, mode, title="": seen.append(r) or path)
    assert stream.plot(stream.summarize(runs), tmp_path, "t") == [tmp_path / "stream-tg.png"]
    assert len(seen) == 1 and sorted(seen[0].avg_ts) == sorted(runs.avg_ts)


# --------------------------------------------------------------------------- issue 52, item 7: noise and the server's bars

def _noisy_runs() -> pd.DataFrame:
    """The issue's run: resident repeats of 65.0, 2.19 and 0.45 tok/s, the other points steady; each run
    with the load average it started under (figures made up, not measured)."""
    rows = []
    for rep, (res, load) in enumerate(((65.0, 0.4), (2.19, 3.1), (0.45, 2.7))):
        for point, kind, ts in (("mmap", "mmap", 1.0 + 0.1 * rep), ("defaults", "defaults", 8.0 + 0.2 * rep),
                                ("resident", "resident", res)):
            rows.append(dict(point=point, kind=kind, mode="tg", repeat=rep, avg_ts=ts, stream_hit_pct=np.nan,
                             read_mib_per_token=4.0, stream_read_mib_per_token=2.0, majflt_per_token=0.0,
                             stream_io_wait_s=0.1, peak_mib=100.0, probe_mib_s=400.0, load_1m=load))
    return pd.DataFrame(rows)


def test_a_point_whose_repeats_spread_is_flagged_with_the_load_beside_it():
    """One bench-stream run had resident repeats of 65.0, 2.19 and 0.45 tok/s, and its medians and plots said
    nothing. The summary flags a point whose repeats spread over 1.5x, with the highest load average its
    runs started under, in the CSV's columns and in the printed table, with one line under it."""
    from pybmoe.bench import noise
    s = stream.summarize(stream.add_limits(_noisy_runs())).set_index("point")
    assert s.loc["resident", "spread"] == pytest.approx(65.0 / 0.45)
    assert s.loc["resident", "noisy"] and not s.loc["mmap", "noisy"] and not s.loc["defaults", "noisy"]
    assert s.loc["resident", "max_load_1m"] == 3.1 and s.loc["mmap", "max_load_1m"] == 3.1
    assert s.loc["defaults", "spread"] == pytest.approx(8.4 / 8.0) and noise.SPREAD_LIMIT == 1.5
    text = stream.format_summary(s.reset_index())
    header, lines = text.splitlines()[0], [ln for ln in text.splitlines() if ln.startswith("noisy:")]
    assert "noisy" in header.split()
    row = next(ln for ln in text.splitlines() if ln.split()[:1] == ["resident"])
    assert row.rstrip().endswith("spread 144.4x, load 3.1")
    assert lines == [f"noisy: point=resident mode=tg: its repeats spread 0.45 .. 65 tok/s (144.4x, over 1.5x); the "
                     f"1-minute load average was up to 3.1 on {os.cpu_count()} CPUs"
                     + (" (the runs shared the cores)" if 3.1 > os.cpu_count() else "")
                     + ": its median is not a measurement; rerun it on a quiet machine"]
    with pytest.raises(ValueError, match="spread limit 0.5; accepted: a factor >= 1"):
        noise.flag_spread(s.reset_index(), _noisy_runs(), ["point", "mode"], limit=0.5)


def test_the_sweep_summary_flags_noise_too():
    """pybmoe sweep's medians: the same columns, the table's column and the line under it."""
    from pybmoe.bench import sweeps
    rows = []
    for rep, (ts, load) in enumerate(((10.0, 0.5), (30.0, 2.5), (11.0, 0.7))):
        for slots, v in ((0, 5.0 + rep * 0.1), (8, ts)):
            rows.append(dict(runner="bench", backend="rpc", spec="off", n_threads=2, n_ubatch=512, mode="tg",
                             slots=slots, inserts=0, max_batch=0, sync=False, avg_ts=v, hit_pct=50.0, resident_mib=1.0,
                             uploads=3, upload_wait_ms_per_step=0.0, h2d_per_step=1.0, overflow=False, repeat=rep,
                             load_1m=load))
    s = sweeps.summarize(pd.DataFrame(rows))
    on = s[s.slots == 8].iloc[0]
    assert on.spread == pytest.approx(3.0) and on.noisy and on.max_load_1m == 2.5
    assert not s[s.slots == 0].iloc[0].noisy
    text = sweeps.format_summary(s)
    assert "| spread 3.0x, load 2.5 |" in text
    assert [ln for ln in text.splitlines() if ln.startswith("noisy: mode=tg backend=rpc slots=8 inserts=0: its "
                                                            "repeats spread 10 .. 30 tok/s (3.0x, over 1.5x)")]


def _server_summary() -> tuple[pd.DataFrame, pd.DataFrame]:
    """A server point's runs (1 client and 4 at once, two repeats) and their summary (made up, not measured)."""
    sruns = pd.DataFrame([dict(point="server", clients=c, status="ok", decode_ts=ts, wall_ts=ts * 0.8, ttft_s=0.5,
                               hit_pct=50.0, n_ctx_slot=4096, n_slots=4, budget_mb=100.0, cycle_mb=50.0,
                               serving_budget_mb=100.0, peak_mib=500.0, oom_kills=0, load_1m=0.5, repeat=rep)
                          for rep in range(2) for c, ts in ((1, 6.0 + rep), (4, 9.0 + rep))])
    summary = stream.summarize(stream.add_limits(_runs_by_hand()))
    return stream.summarize_server(sruns, summary), sruns


def test_the_server_point_is_plotted_beside_the_others():
    """`bench-stream --server` wrote the server's CSVs but no plot: its bars (1 client, 4 clients) are in
    stream-tg.png beside llama-bench's points, each repeat a dot, the ratio over mmap on the bar."""
    from pybmoe.bench import plot
    ssum, sruns = _server_summary()
    runs = stream.add_limits(_runs_by_hand())
    summary, both = stream.plot_frames(stream.summarize(runs), Path("/nonexistent"), runs, ssum, sruns)
    fig = plot.stream_figure(summary, both, "tg", title="t")
    try:
        ax, bx = fig.axes
        ticks = [t.get_text() for t in bx.get_xticklabels()]
        assert ticks == ["mmap", "defaults", "stream:8", "resident\n(no limit, warm)", "server/1 client",
                         "server/4 clients"]
        dots = next(c for c, lab in zip(*ax.get_legend_handles_labels()) if lab == "each repeat")
        assert sorted(dots.get_offsets()[:, 1]) == sorted([*runs.avg_ts, *sruns.decode_ts])
        mmap = float(summary[(summary.point == "mmap") & (summary["mode"] == "tg")].median_ts.iloc[0])
        assert f"{6.5 / mmap:.2f}x" in [t.get_text() for t in ax.texts]  # server/1 client: the median of 6 and 7
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_the_plots_take_the_server_point_from_the_folder(tmp_path):
    """stream.plot(summary, out, title), as bench_stream calls it after a --server run, reads the server's
    CSVs from the folder and writes its bars into stream-tg.png (only there: the server point is decode)."""
    ssum, sruns = _server_summary()
    runs = stream.add_limits(_runs_by_hand())
    runs.to_csv(tmp_path / "stream-runs.csv", index=False)
    ssum.to_csv(tmp_path / "server-summary.csv", index=False)
    sruns.to_csv(tmp_path / "server-runs.csv", index=False)
    summary, both = stream.plot_frames(stream.summarize(runs), tmp_path)
    assert list(summary.point[-2:]) == ["server/1 client", "server/4 clients"]
    assert sorted(both[both.point == "server/4 clients"].avg_ts) == [9.0, 10.0]
    assert stream.plot(stream.summarize(runs), tmp_path, "t") == [tmp_path / "stream-tg.png"]
    assert (tmp_path / "stream-tg.png").read_bytes()[:4] == b"\x89PNG"
