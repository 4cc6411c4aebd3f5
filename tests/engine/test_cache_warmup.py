"""The prefill warm-up (--moe-expert-cache-warmup N): after a prompt the cache does not serve, each
cached layer's N most selected experts are uploaded, so decode does not start cold.

In sync mode the effect is deterministic: without warm-up nothing is resident at the first two
decode steps (a miss at step s is resident from s+2), with it the second step already hits.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.routing import trace as tr

PROMPT = ("The warm-up counts which experts the prompt used, layer by layer, and uploads the most used "
          "ones before the first token is generated, so the cache does not start cold.")


def _run(model: Path, rpc, tmp: Path, extra: list[str], name: str) -> tuple[engine.LogitsRun, "tr.Trace"]:
    trace = tmp / f"{name}.csv"
    r = engine.run_logits(model, tmp / f"{name}.bin", ["-b", "512", "-ub", "512", *engine.host_experts_args(rpc.endpoint),
                                                        *extra, "--moe-trace", str(trace)],
                          prompt=PROMPT, n_predict=8, ctx=512)
    return r, tr.read_trace(trace)


def _decode_hits(t) -> list[int]:
    """Hits per decode step, in order."""
    f = t.frame
    d = f[(f["phase"] == "decode") & (f["hit"] >= 0)]
    return [int((g["hit"] == 1).sum()) for _, g in d.groupby("ubatch", sort=True)]


def test_warmup_makes_the_second_decode_step_hit_and_changes_no_logit(model_q8, rpc, tmp_path):
    base, _ = _run(model_q8, rpc, tmp_path, [], "off")
    cold, t_cold = _run(model_q8, rpc, tmp_path, [*engine.cache_args(8, sync=True)], "cold")
    warm, t_warm = _run(model_q8, rpc, tmp_path, [*engine.cache_args(8, sync=True), "--moe-expert-cache-warmup", "4"],
                        "warm")
    assert cold.logits == base.logits and warm.logits == base.logits
    assert _decode_hits(t_cold)[:2] == [0, 0]  # cold: nothing resident before step 3
    assert _decode_hits(t_warm)[1] > 0, _decode_hits(t_warm)
    s_cold = engine.parse_cache_summaries(cold.log)[-1]
    s_warm = engine.parse_cache_summaries(warm.log)[-1]
    spec = models.read_spec(model_q8)
    assert s_cold.warmup_uploads == 0 and 0 < s_warm.warmup_uploads <= 4 * spec.n_layer
    assert sum(_decode_hits(t_warm)) > sum(_decode_hits(t_cold))


def test_warmup_in_the_default_mode_is_exact_too(model_q8, rpc, tmp_path):
    base, _ = _run(model_q8, rpc, tmp_path, [], "off")
    r, t = _run(model_q8, rpc, tmp_path, [*engine.cache_args(4), "--moe-expert-cache-warmup", "8"], "warm-async")
    assert r.logits == base.logits
    assert engine.parse_cache_summaries(r.log)[-1].warmup_uploads > 0


@pytest.mark.parametrize("value", ["-1", "many"])
def test_a_bad_warmup_value_is_refused(model_q8, rpc, tmp_path, value):
    with pytest.raises(engine.EngineError, match="--moe-expert-cache-warmup expects an integer in 0 .. 2147483647"):
        _run(model_q8, rpc, tmp_path, [*engine.cache_args(4), "--moe-expert-cache-warmup", value], "bad")
