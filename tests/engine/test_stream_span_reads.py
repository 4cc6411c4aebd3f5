"""Span reads: a dense set of a layer's experts (a prefill's step, or its prefetch) is read as one
buffered sequential stream per projection, and only the admitted experts' bytes are copied out
(``llama_moe_stream::read_jobs``, docs/stream-tier.md "Span reads"). Timing only: the logits stay
bit-identical to an all-resident run, and the engine's hits and misses still equal the simulator's.

``PYBMOE_MOE_STREAM_READS=span`` makes every dense set a span read (the default, ``auto``, only those of
8 MiB or more: the test models' layers are 8 MiB in all), ``runs`` none.
"""
from __future__ import annotations

import os
import re

import pytest

from pybmoe import models
from pybmoe.routing import sim

from test_stream_identity import ARCHS, SHAPE, budgets, run


def span_mib(log: str) -> float:
    """The summary's ``span reads <R> MiB`` (the last context's)."""
    found = re.findall(r"span reads ([0-9.]+) MiB", log)
    assert found, log[-2000:]
    return float(found[-1])


def reads_env(mode: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYBMOE_MOE_STREAM_READS": mode, **extra}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ub", [7, 32, 512])
def test_span_reads_keep_the_logits_bit_identical(arch, ub, tmp_path):
    model = models.cached_model_path(models.ModelSpec(arch=arch, **SHAPE))
    base = run(model, tmp_path, ub, [], f"base-{ub}")
    for name, mib in budgets(model, ub).items():
        r = run(model, tmp_path, ub, ["--moe-stream-cache-mb", str(mib)], f"span-{ub}-{mib}", env=reads_env("span"))
        assert r.logits == base.logits, f"{arch}: {name} budget {mib} MiB at ubatch {ub}: logits differ"
        assert span_mib(r.log) > 0, f"{arch} {name}: no span read"
    r = run(model, tmp_path, ub, ["--moe-stream-cache-mb", str(budgets(model, ub)["min"])], f"runs-{ub}",
            env=reads_env("runs"))
    assert r.logits == base.logits and span_mib(r.log) == 0.0


def test_span_reads_through_the_buffered_fallback_and_a_split_gguf(tmp_path):
    """O_DIRECT refused (the injected refusal), and a split GGUF whose layers' experts sit in other files
    than the first: both read spans of the right file at the right offsets."""
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    base = run(model, tmp_path, 32, [], "base")
    r = run(model, tmp_path, 32, ["--moe-stream-cache-mb", "8"], "nodirect",
            env=reads_env("span", PYBMOE_MOE_STREAM_NO_ODIRECT="1"))
    assert "direct_io=0" in r.log and span_mib(r.log) > 0
    assert r.logits == base.logits
    split = tmp_path / "split" / "split.gguf"
    split.parent.mkdir()
    models.writer.write_model(models.ModelSpec(arch="qwen3moe", **SHAPE), split, split_max_tensors=8)
    first = sorted(split.parent.glob("split-*-of-*.gguf"))[0]
    for mib in (8, 12):
        r = run(first, tmp_path, 32, ["--moe-stream-cache-mb", str(mib)], f"split-{mib}", env=reads_env("span"))
        assert r.logits == base.logits, f"split GGUF at {mib} MiB: logits differ"
        assert span_mib(r.log) > 0


@pytest.mark.parametrize("ub,mib", [(4, 8), (512, 8), (512, 12)])
def test_the_engines_hits_with_span_reads_equal_the_simulators(tmp_path, ub, mib):
    """The prefetch and the step's reads both go through spans; the policy does not see it."""
    from pybmoe.routing import trace as tr
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **{**SHAPE, "n_layer": 3}))
    p = tmp_path / f"trace-{ub}-{mib}.csv"
    r = run(model, tmp_path, ub, ["--moe-stream-cache-mb", str(mib), "--moe-trace", str(p)], f"trace-{ub}-{mib}",
            env=reads_env("span"))
    assert span_mib(r.log) > 0
    t = tr.read_trace(p)
    engine_hit = t.frame["ram_hit"].to_numpy()
    want = sim.simulate(t, t.meta.extra["stream_policy"], mib=mib, model=model, phase="all")
    bad = (engine_hit != want.predicted).nonzero()[0]
    assert bad.size == 0, f"{bad.size} of {len(engine_hit)} lookups differ, first rows {bad[:5].tolist()}"
