"""The disk tier at its defaults, on a fake ``/proc`` and cgroup tree (``PYBMOE_MEM_ROOT``): no root,
no real limit. The arithmetic of ``--moe-stream-cache-mb auto`` is recomputed here from the GGUF and
the rule in docs/stream-tier.md, and must equal the engine's to the entry:

- budget entries = (available - dense weights - floor) // (entry + page rounding),
  where available = min(MemAvailable, cgroup limit - (usage - page cache)) and the floor is
  1/16 of the limit (the cgroup's, else MemTotal), 64 .. 1536 MiB;
- each context's host memory (KV cache, compute, output) is then set aside in whole entries;
- a floor that leaves less than the minimum shrinks while 64 MiB stay free; below that, a refusal
  in one line with the arithmetic;
- a fixed budget that does not fit is clamped (one WARN); ``--dense-weights auto`` picks anon exactly when
  the GGUF is larger than what is available, and every pick stays bit-identical.

The model: 2 layers, 16 experts, top-3, Q8_0 (one entry 0.50 MiB, 16 MiB of experts), ~80 MiB dense.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from pybmoe import engine, models

SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320)
MIB = 1024 * 1024
PAGE = os.sysconf("SC_PAGESIZE")


@pytest.fixture(scope="module")
def model() -> Path:
    return models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))


@pytest.fixture(scope="module")
def facts(model):
    """dense bytes, one entry's bytes, the largest projection's expert bytes, projections per entry,
    the number of streamed entries, the minimum at ubatch 1 (top-3), from the GGUF itself."""
    import gguf
    r = gguf.GGUFReader(str(model))
    dense = sum(int(t.n_bytes) for t in r.tensors if "_exps.weight" not in t.name)
    exps = [t for t in r.tensors if "_exps.weight" in t.name]
    per_layer: dict[str, list[int]] = {}
    for t in exps:
        per_layer.setdefault(t.name.split(".")[1], []).append(int(t.n_bytes) // SHAPE["n_expert"])
    entry = max(sum(v) for v in per_layer.values())
    proj = max(max(v) for v in per_layer.values())
    n_proj = max(len(v) for v in per_layer.values())
    return dict(dense=dense, entry=entry, proj=proj, n_proj=n_proj, total=SHAPE["n_layer"] * SHAPE["n_expert"],
                min_entries=SHAPE["n_expert_used"], file=model.stat().st_size)


def cost(f) -> int:
    return f["entry"] + 2 * PAGE * f["n_proj"]


def run(model, tmp, root: Path | None, extra: list[str], name: str, n_predict: int = 4) -> engine.LogitsRun:
    env = {k: v for k, v in os.environ.items() if k != "PYBMOE_MEM_ROOT"}
    if root is not None:
        env["PYBMOE_MEM_ROOT"] = str(root)
    return engine.run_logits(model, tmp / f"{name}.bin", ["-ngl", "0", "--no-repack", "-ub", "1", "-b", "64", *extra],
                             n_predict=n_predict, ctx=128, env=env)


def expected_entries(f, avail: int, limit: int, floor: int | None = None) -> int:
    if floor is None:
        floor = min(max(limit // 16, 64 * MIB), 1536 * MIB)
    return min((avail - f["dense"] - floor) // cost(f), f["total"])


def auto_line(log: str) -> str:
    return next(ln for ln in log.splitlines() if "moe-stream: auto:" in ln and "available" in ln)


@pytest.mark.parametrize("cgroup", ["v1", "v2", None])
def test_auto_follows_the_rule_under_a_cgroup_and_without_one(model, facts, tmp_path, cgroup, mem_root):
    base = run(model, tmp_path, None, [], "base")
    room_mib = (facts["dense"]) / MIB + 64 + 6  # 6 MiB of experts above the floor
    if cgroup:
        # the limit is what the process lives in; its usage less its page cache is gone already
        limit, usage, cache = 1000.0, 1000.0 - room_mib + 300, 300.0
        root = mem_root(tmp_path, avail_mib=20000, cgroup=cgroup, limit_mib=limit, usage_mib=usage, cache_mib=cache)
        avail, lim = int(limit * MIB) - int(usage * MIB) + int(cache * MIB), int(limit * MIB)
    else:
        root = mem_root(tmp_path, avail_mib=room_mib, total_mib=1000)  # a plain machine: MemAvailable binds
        avail, lim = int(room_mib * 1024) * 1024, 1000 * MIB
    r = run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], f"auto-{cgroup}")
    line = auto_line(r.log)
    want = expected_entries(facts, avail, lim)
    assert 3 <= want < facts["total"], want  # the room binds, not the experts' total
    assert f"-> {want} experts of" in line, line
    assert "64 MiB floor (auto: 1/16 of the 1000 MiB" in line and "PYBMOE_MEM_ROOT" in line
    assert f"budget_mb={want * facts['entry'] / MIB:.2f}" in r.log
    # the context's host memory comes off in whole entries, once it exists
    ctx = re.search(r"a context takes ([\d.]+) MiB of host memory", r.log)
    assert ctx, r.log[-3000:]
    taken = -(-int(float(ctx.group(1)) * MIB) // cost(facts))
    after = max(want - taken, facts["min_entries"])
    assert f"-> budget {after * facts['entry'] / MIB:.2f} MiB ({after} experts)" in r.log, r.log[-3000:]
    assert r.tokens == base.tokens and r.logits == base.logits


def test_a_floor_larger_than_the_room_shrinks_to_the_minimum_with_a_warn(model, facts, tmp_path, mem_root):
    base = run(model, tmp_path, None, [], "base")
    room_mib = (facts["dense"]) / MIB + 64 + 3  # the minimum (1.5 MiB) + 64 fit, a 500 MiB floor not
    root = mem_root(tmp_path, avail_mib=room_mib, total_mib=1000)
    r = run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto", "--moe-stream-floor-mb", "500"], "floor")
    line = auto_line(r.log)
    assert f"-> {facts['min_entries']} experts of" in line
    # a WARN line of its own, which the server's verbosity shows
    warns = [ln for ln in r.log.splitlines() if "WARNING the floor of 500 MiB (--moe-stream-floor-mb) leaves less than "
             "the tier's minimum: auto takes the minimum" in ln]
    assert len(warns) == 1, r.log[-3000:]
    assert r.logits == base.logits


def test_the_tier_s_companion_flags_without_the_tier_are_named(model, tmp_path):
    r = run(model, tmp_path, None, ["--moe-stream-floor-mb", "100", "--moe-stream-io-threads", "8"], "companions")
    assert r.log.count("WARNING --moe-stream-floor-mb 100 --moe-stream-io-threads 8 have no effect without the "
                       "stream tier (--moe-stream-cache-mb N|auto)") == 1, r.log[-3000:]
    one = run(model, tmp_path, None, ["--moe-stream-ceil-mb", "50"], "companion")
    assert "WARNING --moe-stream-ceil-mb 50 has no effect without the stream tier" in one.log
    assert "no effect" not in run(model, tmp_path, None, [], "none").log


def test_a_count_flag_names_0_as_refused():
    for flag, value in (("--moe-stream-io-threads", "-1"), ("--moe-expert-cache-admit", "second-miss:-4")):
        r = subprocess.run([str(engine.find_binary("llama-server")), flag, value], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0 and "(0 = refused)" in r.stdout + r.stderr, (flag, r.stderr[-500:])


def test_a_limit_under_the_minimum_is_refused_in_one_line_with_the_arithmetic(model, facts, tmp_path, mem_root):
    room_mib = (facts["dense"]) / MIB + 30  # under 64 MiB + the minimum
    root = mem_root(tmp_path, avail_mib=room_mib, total_mib=1000)
    with pytest.raises(engine.EngineError) as e:
        run(model, tmp_path, root, ["--moe-stream-cache-mb", "auto"], "tiny")
    err = [ln for ln in str(e.value).splitlines() if "under the mechanical minimum" in ln]
    assert len(err) == 1, str(e.value)[-2000:]
    assert "MiB dense weights - 0 MiB prefetch window leaves" in err[0] and "3 experts of 0.50 MiB" in err[0]
    assert "cannot hold one layer step" in str(e.value)


def test_a_fixed_budget_that_does_not_fit_is_clamped_and_stays_exact(model, facts, tmp_path, mem_root):
    """A fixed budget over what fits beside the dense weights, the floor and the context is clamped to
    the largest whole-entry budget that does (one WARN with the arithmetic), never run as asked: a
    first request would read it full and get the process killed (issue 40)."""
    base = run(model, tmp_path, None, [], "base")
    room_mib = facts["dense"] / MIB + 64 + 8  # 8 MiB above the floor, for the context and the experts
    root = mem_root(tmp_path, avail_mib=room_mib, total_mib=1000)
    r = run(model, tmp_path, root, ["--moe-stream-cache-mb", "12"], "over")
    warns = [ln for ln in r.log.splitlines() if "WARNING --moe-stream-cache-mb 12 MiB does not fit" in ln]
    assert len(warns) == 1 and "MiB floor" in warns[0] and "of contexts' host memory" in warns[0], r.log[-3000:]
    # -c 128: upstream pads it to 256 tokens, and the plan is for that context
    ctx = float(re.search(r"the context as asked \(256 tokens\) takes ([\d.]+) MiB of host memory", r.log).group(1))
    avail = int(room_mib * 1024) * 1024
    # the line gives the context to 0.1 MiB: the entries it takes, from either end of that rounding
    took = {-(-int((ctx + d) * MIB) // cost(facts)) for d in (-0.05, 0.05)}
    entries = {(avail - facts["dense"] - 64 * MIB) // cost(facts) - t for t in took}
    assert all(3 <= e < 24 for e in entries), entries  # the clamp binds, above the minimum
    assert any(f"clamped to {e * facts['entry'] / MIB:.1f} MiB" in warns[0] for e in entries), (warns[0], entries)
    assert r.tokens == base.tokens and r.logits == base.logits
    ok = run(model, tmp_path, None, ["--moe-stream-cache-mb", "12"], "fits")
    assert "does not fit" not in ok.log


def test_dense_auto_picks_anon_only_for_a_fixed_budget_when_the_gguf_does_not_fit_and_stays_exact(model, facts, tmp_path, mem_root):
    base = run(model, tmp_path, None, [], "base")
    # less than the GGUF is available, but the 4 MiB budget and the dense weights fit beside each other
    avail = facts["file"] / MIB - 5
    assert (facts["dense"]) / MIB + 4 * 1.1 < avail
    small = mem_root(tmp_path, avail_mib=avail, total_mib=1000)
    r = run(model, tmp_path, small, ["--moe-stream-cache-mb", "4"], "dense-small")
    assert r.log.count("dense weights: auto -> anon: the GGUF") == 1 and "weights into anonymous memory" in r.log
    assert r.tokens == base.tokens and r.logits == base.logits
    # a budget that does not fit beside them is clamped first (the contexts' fit comes before the dense
    # policy), so that they fit beside each other then
    tight = run(model, tmp_path, small, ["--moe-stream-cache-mb", "16"], "dense-tight")
    assert tight.log.count("WARNING --moe-stream-cache-mb 16 MiB does not fit") == 1, tight.log[-3000:]
    assert tight.log.count("dense weights: auto -> anon: the GGUF") == 1 and tight.logits == base.logits
    # auto sizes the budget beside the dense weights, with its floor: they stay mapped
    auto = run(model, tmp_path, small, ["--moe-stream-cache-mb", "auto", "--moe-stream-floor-mb", "0"], "dense-auto")
    assert auto.log.count("dense weights: auto -> mmap: --moe-stream-cache-mb auto sized the budget") == 1, auto.log[-3000:]
    assert "anonymous memory" not in auto.log and auto.logits == base.logits
    roomy = run(model, tmp_path, None, ["--moe-stream-cache-mb", "auto"], "dense-roomy")
    assert roomy.log.count("dense weights: auto -> mmap: the GGUF") == 1
    assert "anonymous memory" not in roomy.log and roomy.logits == base.logits
    for policy in ("mmap", "warm", "anon", "auto"):
        p = run(model, tmp_path, small, ["--moe-stream-cache-mb", "4", "--dense-weights", policy], f"dense-{policy}")
        assert p.tokens == base.tokens and p.logits == base.logits, policy
    off = run(model, tmp_path, None, [], "dense-off")  # no tier: auto does nothing and says nothing
    assert "dense weights" not in off.log


def test_prefetch_changes_no_logit_and_its_window_is_lent_to_decode(tmp_path):
    """At ubatch 16 (a step can want half the layer) the next layer's experts are read while a prefill
    step computes: by default a window of a quarter of a layer (a fixed budget), with
    PYBMOE_MOE_STREAM_PREFETCH=1 a whole layer. The tokens and the logits are those of the same run with
    it off (PYBMOE_MOE_STREAM_PREFETCH=0). The window's entries hold decode's experts (a prefill step
    evicts down to the budget first): every lookup's hit or miss is the simulator's with the window as
    ``lend_entries`` (the trace header's ``stream_lend``), and decode hits more than with it off."""
    from pybmoe.routing import sim
    from pybmoe.routing import trace as tr
    # three layers: the last one computes only the output rows, so the prefetch into layer 1 is the one used
    model = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **{**SHAPE, "n_layer": 3}))
    base = {k: v for k, v in os.environ.items() if k != "PYBMOE_MOE_STREAM_PREFETCH"}
    args = ["-ngl", "0", "--no-repack", "-ub", "16", "-b", "256", "--moe-stream-cache-mb", "10"]
    prompt = " ".join(f"word{i}" for i in range(60))  # several ubatches of 16 tokens
    runs, decode_hits = {}, {}
    for name, env, window in (("whole", {"PYBMOE_MOE_STREAM_PREFETCH": "1"}, 16), ("default", {}, 4),
                              ("off", {"PYBMOE_MOE_STREAM_PREFETCH": "0"}, 0)):
        p = tmp_path / f"pf-{name}.csv"
        r = engine.run_logits(model, tmp_path / f"pf-{name}.bin", args + ["--moe-trace", str(p)], prompt=prompt,
                              n_predict=24, ctx=256, env={**base, **env})
        assert re.search(rf"prefetch_experts={window} overlap=auto$", r.log, re.M), name
        runs[name] = r
        t = tr.read_trace(p)
        assert int(t.meta.extra["stream_lend"]) == window
        want = sim.simulate(t, t.meta.extra["stream_policy"], mib=10, model=model, phase="all", lend_entries=window)
        engine_hit = t.frame["ram_hit"].to_numpy()
        bad = (engine_hit != want.predicted).nonzero()[0]
        assert bad.size == 0, f"{name}: {bad.size} of {len(engine_hit)} lookups differ, first rows {bad[:5].tolist()}"
        decode_hits[name] = int(((engine_hit == 1) & (t.frame["phase"] == "decode").to_numpy()).sum())
    for name in ("whole", "default"):
        used = re.search(r"prefetched ([\d.]+) MiB \(([\d.]+) MiB of it used\)", runs[name].log)
        assert used and float(used.group(2)) > 0, runs[name].log[-2000:]
        r, off = runs[name], runs["off"]
        assert r.tokens == off.tokens and r.logits == off.logits, name
    assert decode_hits["off"] < decode_hits["default"] < decode_hits["whole"], decode_hits


LOAD_SCRIPT = r"""
import os, resource, sys
import pybmoe
path, stream = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # a cold file, without root
os.close(fd)
before = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
llm = pybmoe.Llama(path, n_ctx=64, n_gpu_layers=0, repack=False, moe_stream_cache_mb=stream, verbose=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_inblock - before) * 512)
llm.close()
"""


def test_the_load_reads_only_the_dense_weights(model, facts, tmp_path):
    """Block input of the load alone (the Python binding builds the model and its context, no token):
    with the tier, at most the bytes that are not streamed experts plus 5 %; stock mmap reads the file."""
    import subprocess
    import sys

    def load(stream: int) -> int:
        r = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(model), str(stream)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return int(r.stdout.split()[-1])

    stock = load(0)
    if stock < facts["file"] // 2:
        pytest.skip(f"this file system does not account block input ({stock} bytes for a {facts['file']} byte load)")
    not_streamed = facts["file"] - facts["total"] * facts["entry"]
    streamed = load(12)
    assert streamed <= not_streamed * 1.05, (streamed, not_streamed, stock)
    assert stock >= facts["file"] * 0.9
