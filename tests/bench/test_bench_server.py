"""``pybmoe bench-stream --server`` end to end on a tiny model (issue 40): the server point beside
llama-bench's, its CSVs, the answers of 4 clients at once checked against one client's, the context
the server ran with and the budget it served with. Timings are not asserted here."""
from __future__ import annotations

import pandas as pd
import pytest

from pybmoe import models
from pybmoe.bench import server, stream

SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320, n_ctx_train=16384)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    out = tmp_path_factory.mktemp("bench-server")
    return stream.bench_stream(model, out, limit_mib=1024, budgets=[], n_prompt=16, n_gen=6, repeats=1,
                               include_resident=False, probe=False, server=True)


def test_the_server_point_ran_with_one_and_four_clients_and_was_written(result):
    runs = pd.read_csv(result.out_dir / "server-runs.csv")
    assert list(runs.clients) == [1, 4] and (runs.status == "ok").all()
    assert (runs.decode_ts > 0).all() and (runs.ttft_s > 0).all() and (runs.tokens == 4 * 6).all()
    # every answer of the 4 clients is the one client's answer (or a near tie)
    four = runs[runs.clients == 4].iloc[0]
    assert four.identical + four.near_tie == 4 and four.wrong == 0
    # the 4 clients' aggregate is over the decode phase, as one client's is; the wall-time figure counts the
    # prefill too, so it is the lower of the two
    assert (runs.wall_ts > 0).all() and four.decode_ts > four.wall_ts
    summary = pd.read_csv(result.out_dir / "server-summary.csv")
    assert set(summary.clients) == {1, 4}
    bench = result.summary[(result.summary.point == "defaults") & (result.summary["mode"] == "tg")].median_ts.iloc[0]
    one = summary[summary.clients == 1].iloc[0]
    assert one.vs_bench_defaults == pytest.approx(one.median_ts / bench)
    # issue 52, item 7: the server point is plotted with the others (stream-tg.png), and flagged when noisy
    assert (runs.load_1m >= 0).all() and {"spread", "noisy", "max_load_1m"} <= set(summary.columns)
    drawn, _ = stream.plot_frames(result.summary, result.out_dir)
    assert list(drawn.point[-2:]) == ["server/1 client", "server/4 clients"]


def test_the_server_ran_its_own_default_context_and_served_with_the_fitted_budget(result):
    runs = result.server_runs
    one = runs[runs.clients == 1].iloc[0]
    # the server's defaults: 4 slots sharing the model's trained context, which fits beside the experts here
    assert one.n_slots == 4 and one.n_ctx_slot == 16384 and one.kv_unified == "true"
    assert "the default context (16384 tokens, 4 slots sharing them)" in one.fit_line and "kept" in one.fit_line
    assert one.serving_budget_mb == pytest.approx(one.budget_mb, abs=0.01) and one.budget_mb >= one.cycle_mb
    assert one.oom_kills == 0 or pd.isna(one.oom_kills)


def test_a_server_that_cannot_start_is_a_row_not_an_exception(tmp_path):
    """A context that cannot fit is refused by the server in one line: the point records ``refused``."""
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    rows = server.run_server_point(model, limit=None, cold=False, log_path=tmp_path / "s.log", clients=(1,),
                                   extra=["-c", "4096"], tier=("--moe-stream-cache-mb", "1", "--moe-stream-io-threads",
                                                               "1", "-ub", "512"))
    assert len(rows) == 1 and rows[0]["status"] == "refused", rows
    with pytest.raises(ValueError, match="clients"):
        server.run_server_point(model, limit=None, cold=False, log_path=tmp_path / "x.log", clients=(4,))
