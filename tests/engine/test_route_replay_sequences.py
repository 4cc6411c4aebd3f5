"""Route replay per sequence (ggml-ext/llama-moe-replay.h): each sequence of a context replays its own
stream of the trace (the trace cut into the context's n_seq_max streams, the i-th sequence seen taking
the i-th), however the sequences' tokens share the ubatches; the engine's own trace of that run is
what the simulator replays to the engine's hits and misses.

The contexts are made through the llama_cpp C API on the model of a pybmoe ``Llama`` (which opens the
replay and the trace), so the test chooses each ubatch's tokens and sequences exactly.
"""
from __future__ import annotations

import pytest

from pybmoe import models
from pybmoe.routing import sim
from pybmoe.routing import trace as tr

pd = pytest.importorskip("pandas")

SHAPE = dict(n_layer=2, n_expert=16, n_expert_used=3, n_embd=512, n_ff_exp=320)
N_TOK = 40  # the replayed trace's tokens: two streams of 20


def expert(t: int, layer: int, rank: int) -> int:
    """The replayed trace's expert of token ``t``: distinct per rank, different for every token."""
    return (5 * t + 3 * layer + rank) % SHAPE["n_expert"]


def write_trace(path, n_tok: int = N_TOK) -> None:
    rows = [f"synth,decode,{t},{t},{il},{r},{expert(t, il, r)},-1"
            for t in range(n_tok) for il in range(SHAPE["n_layer"]) for r in range(SHAPE["n_expert_used"])]
    path.write_text("# pybmoe-trace v1\nworkload,phase,ubatch,token,layer,rank,expert,hit\n" + "\n".join(rows) + "\n")


def decode(ctx, steps: list[list[tuple[int, int]]]) -> None:
    """Each step one ubatch of (sequence, token) pairs, each with its logits."""
    import llama_cpp
    pos: dict[int, int] = {}
    for step in steps:
        b = llama_cpp.llama_batch_init(len(step), 0, 2)
        try:
            for i, (seq, tok) in enumerate(step):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos.get(seq, 0), 1, 1
                b.seq_id[i][0] = seq
                pos[seq] = pos.get(seq, 0) + 1
            b.n_tokens = len(step)
            assert llama_cpp.llama_decode(ctx, b) == 0
        finally:
            llama_cpp.llama_batch_free(b)


def test_two_sequences_replay_their_own_streams_and_the_simulator_equals_the_engine(tmp_path):
    import llama_cpp
    from pybmoe.engine import bindings
    model_path = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    replay, seen = tmp_path / "replay.csv", tmp_path / "seen.csv"
    write_trace(replay)
    # a budget of 12 experts of the 32 (the least at ubatch 16): the hits depend on the order of the lookups
    llm = bindings.Llama(model_path, n_ctx=256, n_ubatch=16, n_gpu_layers=0, verbose=False, repack=False,
                         moe_stream_cache_mb=6, moe_route_replay=replay, moe_trace=seen)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 256, 16, 16, 2, 2, 2
    ctx = llama_cpp.llama_init_from_model(llm._model.model, cp)
    assert ctx
    # sequence 1 runs first (stream 0), then 0 (stream 1): a shared prompt ubatch, then decode steps in an
    # uneven interleaving, some of both sequences at once
    steps = [[(1, 100), (1, 101), (1, 102), (0, 200), (0, 201)], [(0, 202)], [(1, 103)], [(1, 104)],
             [(0, 203), (1, 105)], [(1, 106), (0, 204)], [(0, 205)]]
    try:
        decode(ctx, steps)
    finally:
        llama_cpp.llama_free(ctx)
    stats = llm.moe_stream_stats()
    del llm
    # what each (ubatch, position) of the run replayed: its sequence's next token in its own stream
    want: dict[int, int] = {}
    token, n_seen = 0, {1: 0, 0: 0}
    stream_start = {1: 0, 0: N_TOK // 2}
    for step in steps:
        for seq, _ in step:
            want[token] = stream_start[seq] + n_seen[seq]
            n_seen[seq] += 1
            token += 1
    df = pd.read_csv(seen, comment="#")
    got = {k: tuple(g.sort_values("rank").expert) for k, g in df.groupby(["token", "layer"])}
    assert len(got) == token * SHAPE["n_layer"], sorted(got)
    for (t, il), ids in got.items():
        assert ids == tuple(expert(want[t], il, r) for r in range(SHAPE["n_expert_used"])), (t, il, want[t])
    # sequence 0's tokens are those of stream 1, never one of sequence 1's
    assert {want[t] for t in want} == set(range(7)) | set(range(20, 26))
    # and the simulator, replaying the engine's own trace, gets the engine's hit or miss at every lookup
    t = tr.read_trace(seen)
    engine_hit = t.frame["ram_hit"].to_numpy()
    assert (engine_hit >= 0).all()
    want_sim = sim.simulate(t, t.meta.extra["stream_policy"], budget_entries=int(t.meta.extra["stream_entries"]), phase="all",
                            lend_entries=int(t.meta.extra["stream_lend"]))
    bad = (engine_hit != want_sim.predicted).nonzero()[0]
    assert bad.size == 0, f"{bad.size} of {len(engine_hit)} lookups differ, first rows {bad[:5].tolist()}"
    assert (int((engine_hit == 1).sum()), int((engine_hit == 0).sum())) == (stats.hits, stats.misses)
    assert stats.hits > 0 and stats.misses > 0
