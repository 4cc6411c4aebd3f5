"""The contexts and the disk tier's budget fitted together before any context is allocated, on a fake
``/proc`` tree (``PYBMOE_MEM_ROOT``): no root, no real limit. These are the static plan's tests
(``PYBMOE_MOE_STREAM_ELASTIC=0``: a context's KV cache committed at creation); the elastic plan, the
default, is tested in test_stream_elastic.py.

The model: 2 layers, 16 experts, top-3, Q8_0, trained context 16384 tokens (one entry 0.50 MiB, a
cache cycle of 3.0 MiB; the KV cache about 1 KiB a token). ``pybmoe-logits`` creates its context
through common, as ``llama-server`` does. The oracles:

- the fit's measure of a context (a no_alloc probe) equals the host memory the created context
  reports, to the 0.1 MiB of the lines;
- the budget it leaves is recomputed here from the rule: whole entries of (entry + page rounding)
  from the room (available - dense - floor) less the contexts;
- a default context that would leave the budget under its target shrinks to the largest context
  (256-token grid, >= 4096) that keeps it; the target is the larger of the cycle + 10 % and all of
  the budget the least context (4096 tokens) leaves (LLAMA_MOE_FIT_KEEP_PCT, 100 %);
- a context the user sized runs as asked (the cycle WARN when under it), or is refused in one line;
- every run's tokens and logits equal an all-resident run's at the same context.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pybmoe import engine, models

SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320, n_ctx_train=16384)
MIB = 1024 * 1024
PAGE = os.sysconf("SC_PAGESIZE")
FLOOR = 64 * MIB  # auto's floor under a 1000 MiB MemTotal: 1/16 of it, at least 64 MiB
MARGIN = 0.10


@pytest.fixture(scope="module")
def model() -> Path:
    return models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))


@pytest.fixture(scope="module")
def facts(model):
    import gguf
    r = gguf.GGUFReader(str(model))
    dense = sum(int(t.n_bytes) for t in r.tensors if "_exps.weight" not in t.name)
    per_layer: dict[str, list[int]] = {}
    for t in r.tensors:
        if "_exps.weight" in t.name:
            per_layer.setdefault(t.name.split(".")[1], []).append(int(t.n_bytes) // SHAPE["n_expert"])
    entry = max(sum(v) for v in per_layer.values())
    n_proj = max(len(v) for v in per_layer.values())
    return dict(dense=dense, entry=entry, cost=entry + 2 * PAGE * n_proj,
                cycle=SHAPE["n_layer"] * SHAPE["n_expert_used"] * entry)


def run(model, tmp, root: Path | None, extra: list[str], name: str, ctx: int | None = None,
        elastic: bool = False) -> engine.LogitsRun:
    env = {k: v for k, v in os.environ.items() if k != "PYBMOE_MEM_ROOT"}
    env["PYBMOE_MOE_STREAM_ELASTIC"] = "1" if elastic else "0"
    if root is not None:
        env["PYBMOE_MEM_ROOT"] = str(root)
    return engine.run_logits(model, tmp / f"{name}.bin", ["-ngl", "0", "--no-repack", "-ub", "1", "-b", "64", *extra],
                             n_predict=4, ctx=ctx, env=env)


def fit_line(log: str) -> str:
    return next(ln for ln in log.splitlines() if "moe-stream: fit:" in ln or "-> fit:" in ln)


def ctx_mib(log: str, n: int) -> float:
    """The host memory the fit measured for a context of n tokens (the asked one, or the one it shrank to)."""
    line = fit_line(log)
    m = re.search(rf"\({n} tokens\) takes ([\d.]+) MiB", line) or re.search(rf"to {n} tokens \(([\d.]+) MiB\)", line)
    assert m, line
    return float(m.group(1))


def created_ctx(log: str) -> tuple[int, float | None]:
    """(n_ctx, host MiB) of the context the run created (pybmoe-logits' ``n_ctx`` line; the tier's
    on_context line, which auto prints: None for a fixed budget)."""
    n = int(re.search(r"^n_ctx (\d+) n_seq", log, re.M).group(1))
    m = re.search(r"a context takes ([\d.]+) MiB of host memory", log)
    return n, float(m.group(1)) if m else None


def target_mib(line: str) -> tuple[float, float | None]:
    """(the target, the least context's budget or None) a default context's fit line names, MiB."""
    m = re.search(r"under ([\d.]+) MiB, (?:90|100) % of the ([\d.]+) MiB the least context leaves", line)
    if m:
        return float(m.group(1)), float(m.group(2))
    return float(re.search(r"cache cycle of [\d.]+ MiB \+ 10 % = ([\d.]+) MiB", line).group(1)), None


def budget_entries(facts, avail: int, ctx_bytes: int) -> int:
    room = (avail - facts["dense"] - FLOOR) // facts["cost"]
    return min(room - (-(-ctx_bytes // facts["cost"])), SHAPE["n_layer"] * SHAPE["n_expert"])


@pytest.fixture(scope="module")
def sizes(model, tmp_path_factory):
    """The fit's measures of the contexts this module needs, from a roomy run each (MiB)."""
    tmp = tmp_path_factory.mktemp("sizes")
    full = run(model, tmp, None, ["--moe-stream-cache-mb", "auto"], "full")
    least = run(model, tmp, None, ["--moe-stream-cache-mb", "auto"], "least", ctx=4096)
    assert "kept" in fit_line(full.log) and "kept" in fit_line(least.log)
    out = {16384: ctx_mib(full.log, 16384), 4096: ctx_mib(least.log, 4096)}
    # the probe measures what the context then takes
    for r, n in ((full, 16384), (least, 4096)):
        assert created_ctx(r.log) == (n, pytest.approx(out[n], abs=0.051)), r.log[-2000:]
    assert out[16384] > out[4096] + 8
    return out


def half_room(facts, sizes, tmp_path, mem_root) -> tuple[Path, float, float]:
    """A fake tree with room for the least context, the cycle + 10 % and half of what the full context
    needs beyond the least: (its root, the MiB available, the cycle + 10 % in bytes)."""
    want = facts["cycle"] * (1 + MARGIN)
    avail_mib = (facts["dense"] + FLOOR + want) / MIB + sizes[4096] + (sizes[16384] - sizes[4096]) / 2 + 1
    return mem_root(tmp_path, avail_mib=avail_mib, total_mib=1000), avail_mib, want


def test_a_default_context_shrinks_to_keep_the_cycle_and_stays_exact(model, facts, sizes, tmp_path, mem_root):
    root, avail_mib, want = half_room(facts, sizes, tmp_path, mem_root)
    r = run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "shrunk")
    line = fit_line(r.log)
    assert "the default context (16384 tokens)" in line and "-> shrunk to" in line, line
    # the full context does not fit beside the tier's minimum here: the line does not offer it
    assert "(-c 16384 would be refused)" in line and "restores" not in line, line
    n, mib = created_ctx(r.log)
    assert 4096 <= n < 16384 and n % 256 == 0, line
    assert mib == pytest.approx(ctx_mib(r.log, n), abs=0.051)
    avail = int(avail_mib * 1024) * 1024
    entries = budget_entries(facts, avail, int(mib * MIB))
    # the target: all of what the least context leaves (here above the cycle + 10 %), by hand
    target, least = target_mib(line)
    least_entries = budget_entries(facts, avail, int(sizes[4096] * MIB))
    assert least == pytest.approx(least_entries * facts["entry"] / MIB, abs=facts["entry"] / MIB + 0.051)
    assert target * MIB >= want and target == pytest.approx(
        least_entries * facts["entry"] / MIB, abs=facts["entry"] / MIB + 0.051)
    want = target * MIB
    assert entries * facts["entry"] >= want - 0.051 * MIB  # the budget keeps the target
    assert f"budget {entries * facts['entry'] / MIB:.1f} MiB" in line or \
        f"budget {(entries - 1) * facts['entry'] / MIB:.1f} MiB" in line, (line, entries)
    assert "below the cache cycle" not in r.log
    # the largest such context: what it leaves over the target is less than 256 more tokens and one entry
    # would take (the KV cache is linear in the tokens)
    per_token = (sizes[16384] - sizes[4096]) * MIB / (16384 - 4096)
    assert entries * facts["entry"] - want < 256 * per_token + 2 * facts["cost"], (entries, want, per_token)
    # and the output is that of an all-resident run at the same context
    base = run(model, tmp_path, None, [], "base", ctx=n)
    assert r.tokens == base.tokens and r.logits == base.logits


def test_a_user_sized_context_runs_as_asked_under_the_cycle_or_is_refused(model, facts, sizes, tmp_path, mem_root):
    # room for the least context and the tier's minimum, not for the cycle
    avail_mib = (facts["dense"] + FLOOR) / MIB + sizes[4096] + 2.5
    root = mem_root(tmp_path, avail_mib=avail_mib, total_mib=1000)
    r = run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "asked", ctx=4096)
    line = fit_line(r.log)
    assert "the context as asked (4096 tokens)" in line and "runs as asked" in line, line
    assert created_ctx(r.log)[0] == 4096
    assert r.log.count("is below the cache cycle") >= 1
    base = run(model, tmp_path, None, [], "base", ctx=4096)
    assert r.tokens == base.tokens and r.logits == base.logits
    # the full context does not fit beside the minimum: refused in one line, before any context exists
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "too-big", ctx=16384)
    err = [ln for ln in str(e.value).splitlines() if "-> fit:" in ln]
    assert len(err) == 1 and "the context as asked (16384 tokens)" in err[0], str(e.value)[-2000:]
    assert "under the tier's minimum" in err[0] and "give a smaller -c" in err[0]
    assert "a context takes" not in str(e.value)  # no context was created


def test_a_default_context_that_cannot_fit_even_at_its_least_is_refused(model, facts, sizes, tmp_path, mem_root):
    avail_mib = (facts["dense"] + FLOOR) / MIB + sizes[4096] / 2
    root = mem_root(tmp_path, avail_mib=avail_mib, total_mib=1000)
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "refused")
    err = [ln for ln in str(e.value).splitlines() if "-> fit:" in ln]
    assert len(err) == 1, str(e.value)[-2000:]
    assert "even the least context, 4096 tokens" in err[0] and "give the process more memory" in err[0]


def test_a_fixed_budget_is_clamped_beside_a_default_context_that_keeps_the_cycle(model, facts, sizes, tmp_path, mem_root):
    # the fixed budget (12 MiB) does not fit beside the full context; the context shrinks to keep the cycle,
    # and the budget is clamped to what is left
    root, avail_mib, want = half_room(facts, sizes, tmp_path, mem_root)
    r = run(model, tmp_path, root, ["--moe-stream-cache-mb", "12"], "fixed")
    line = fit_line(r.log)
    assert "-> shrunk to" in line and "the fixed budget of 12 MiB does not fit beside the contexts: clamped" in line, line
    n, _ = created_ctx(r.log)
    mib = ctx_mib(r.log, n)
    warns = [ln for ln in r.log.splitlines() if "WARNING --moe-stream-cache-mb 12 MiB does not fit" in ln]
    assert len(warns) == 1, r.log[-3000:]
    entries = budget_entries(facts, int(avail_mib * 1024) * 1024, int(mib * MIB))
    target, _ = target_mib(line)
    assert entries * facts["entry"] >= min(want, target * MIB) - 0.051 * MIB and entries * facts["entry"] < 12 * MIB
    base = run(model, tmp_path, None, [], "base", ctx=n)
    assert r.tokens == base.tokens and r.logits == base.logits


def test_a_shrunk_line_names_the_full_context_only_where_it_runs(model, facts, sizes, tmp_path, mem_root):
    """A line may only suggest what would run: where the full context does not fit beside the tier's minimum,
    the shrunk line says so instead of naming ``-c 16384``; where it names it (half_room), that runs."""
    avail_mib = (facts["dense"] + FLOOR + facts["cycle"] * (1 + MARGIN)) / MIB + sizes[4096] + 1
    root = mem_root(tmp_path, avail_mib=avail_mib, total_mib=1000)
    r = run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "shrunk-tight")
    line = fit_line(r.log)
    assert "-> shrunk to" in line and "restores" not in line, line
    assert "the full context does not fit beside the tier's minimum here (-c 16384 would be refused)" in line, line
    with pytest.raises(engine.EngineError, match="under the tier's minimum"):
        run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "full-refused", ctx=16384)
    # room for the full context beside the minimum (11 entries) and a little: still shrunk (the least context
    # leaves more), and the line's flags run
    least = float(re.search(r"least_mb=([\d.]+)", r.log).group(1))
    avail2 = (facts["dense"] + FLOOR) / MIB + sizes[16384] + least * facts["cost"] / facts["entry"] + 1.5
    root2 = mem_root(tmp_path / "roomy", avail_mib=avail2, total_mib=1000)
    line2 = fit_line(run(model, tmp_path, root2, ["--moe-stream-cache-mb", "auto"], "shrunk-roomy").log)
    assert "-> shrunk to" in line2 and "-c 16384 restores the full context" in line2, line2
    ran = run(model, tmp_path, root2, ["--moe-stream-cache-mb", "auto"], "restored", ctx=16384)
    assert created_ctx(ran.log)[0] == 16384 and "the context as asked (16384 tokens)" in fit_line(ran.log)


@pytest.mark.parametrize("asked, np, expect", [(4000, 1, "4096 tokens"), (14080, 4, "4 slots x 3584 tokens")])
def test_the_plan_is_for_the_context_upstream_creates(model, tmp_path, asked, np, expect):
    """llama_context pads -c to 256 tokens, and each slot's share to 256 again when the slots do not share
    the cache: the plan measures that context (-c 14080 -np 4 is 14336 tokens), not the one asked."""
    # pybmoe-logits' slots do not share one cache (common's default outside the server)
    extra = ["--moe-stream-cache-mb", "auto"] + (["-np", str(np)] if np > 1 else [])
    r = run(model, tmp_path, None, extra, f"pad-{asked}", ctx=asked)
    line = fit_line(r.log)
    assert f"the context as asked ({expect})" in line, line
    n, mib = created_ctx(r.log)
    assert n == (4096 if np == 1 else 14336)
    if np == 1:  # (slots that do not share one cache measure 1.7 MiB under what they take: docs/stream-tier.md)
        m = re.search(r"\((?:[^()]*)\) takes ([\d.]+) MiB", line)
        assert mib == pytest.approx(float(m.group(1)), abs=0.051), (line, mib)


def test_a_refusal_names_the_least_memory_that_runs(model, facts, sizes, tmp_path, mem_root):
    """The refused fit line gives the memory that runs the least context (what is missing, a third more for
    what grows with the memory, and 2 MiB); the oracle: that much more runs, and what is missing is more than
    a third of it."""
    avail_mib = int((facts["dense"] + FLOOR) / MIB + sizes[4096] / 2)
    root = mem_root(tmp_path, avail_mib=avail_mib, total_mib=1000)
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "least-refused")
    m = re.search(r"give the process more memory \((\d+) MiB more available memory runs it\)", str(e.value))
    assert m, str(e.value)[-2000:]
    more = int(m.group(1))
    ok = run(model, tmp_path, mem_root(tmp_path / "ok", avail_mib=avail_mib + more, total_mib=1000),
             ["--moe-stream-cache-mb", "auto"], "least-runs")
    assert created_ctx(ok.log)[0] >= 4096  # the least context, or more where the figure's margin leaves room
    with pytest.raises(engine.EngineError, match="under the tier's minimum"):
        run(model, tmp_path, mem_root(tmp_path / "short", avail_mib=avail_mib + (more - 2) * 3 // 4 - 1, total_mib=1000),
            ["--moe-stream-cache-mb", "auto"], "least-short")


def test_memory_under_the_dense_weights_names_the_memory_that_loads(model, facts, tmp_path, mem_root):
    avail_mib = int(facts["dense"] / MIB / 2)
    root = mem_root(tmp_path, avail_mib=avail_mib, total_mib=1000)
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "under-dense")
    lines = [ln for ln in str(e.value).splitlines() if "moe-stream: auto:" in ln and "under the mechanical minimum" in ln]
    assert len(lines) == 1, str(e.value)[-2000:]
    m = re.search(r"; (\d+) MiB more available memory loads it, and each context's host memory comes beside it",
                  lines[0])
    assert m, lines[0]
    # that much more loads the tier; the context comes beside it, and where it does not fit there, the fit's
    # line names what it takes, which then runs
    more = avail_mib + int(m.group(1))
    try:
        r = run(model, tmp_path, mem_root(tmp_path / "more", avail_mib=more, total_mib=1000),
                ["--moe-stream-cache-mb", "auto"], "loads", ctx=256)
    except engine.EngineError as e2:
        assert "under the mechanical minimum" not in str(e2.value), str(e2.value)[-2000:]
        m2 = re.search(r"-> fit: .* \((\d+) MiB more available memory runs it\)", str(e2.value))
        assert m2, str(e2.value)[-2000:]
        r = run(model, tmp_path, mem_root(tmp_path / "runs", avail_mib=more + int(m2.group(1)), total_mib=1000),
                ["--moe-stream-cache-mb", "auto"], "runs", ctx=256)
    assert created_ctx(r.log)[0] == 256


def test_a_fixed_budget_over_the_memory_keeps_auto_s_budget_and_names_the_users_value(model, facts, sizes, tmp_path,
                                                                                       mem_root):
    """A fixed budget of 99999 MiB (far over every streamed expert) where less than every expert fits even
    before the context: clamped at load already (so what is sized from the budget before the contexts, the
    server's prompt cache, sees what runs), the WARN names 99999, not the clamped figure, and the budget ends
    no lower than auto's at the same memory."""
    avail_mib = (facts["dense"] + FLOOR) / MIB + sizes[4096] + 6
    assert 6 * MIB < SHAPE["n_layer"] * SHAPE["n_expert"] * facts["entry"]
    root = mem_root(tmp_path, avail_mib=avail_mib, total_mib=1000)
    auto = run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "auto-budget")
    fixed = run(model, tmp_path, root, ["--moe-stream-cache-mb", "99999"], "fixed-budget")
    assert "WARNING --moe-stream-cache-mb 99999 MiB does not fit" in fixed.log, fixed.log[-3000:]

    def budget(log: str) -> float:
        return float(re.findall(r"budget ([\d.]+) MiB \(yielded", log)[-1])
    assert budget(fixed.log) >= budget(auto.log) - facts["entry"] / MIB - 0.05, (budget(fixed.log), budget(auto.log))
    assert fixed.tokens == auto.tokens and fixed.logits == auto.logits
