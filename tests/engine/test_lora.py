"""LoRA adapters on experts: while an adapter is loaded the expert cache is bypassed (the stock
graph), with one line saying so, and the output equals the cache off with the same adapter."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gguf
from pybmoe import engine, models

RANK = 4


def write_expert_lora(model: Path, out: Path, rank: int = RANK, alpha: float = 8.0, seed: int = 7) -> Path:
    """A LoRA adapter GGUF on every layer's ``ffn_up_exps``: ``lora_a`` {n_embd, rank, n_expert} and
    ``lora_b`` {rank, n_ff_exp, n_expert} (ggml order), F16, deterministic."""
    spec = models.read_spec(model)
    meta = models.read_metadata(model)
    up = {t.name: t.shape for t in meta.tensors if t.name.endswith("ffn_up_exps.weight")}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, spec.arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, (n_embd, n_ff, n_expert) in sorted(up.items()):
        a = rng.standard_normal((n_expert, rank, n_embd), dtype=np.float32) / np.sqrt(n_embd)
        b = rng.standard_normal((n_expert, n_ff, rank), dtype=np.float32) / np.sqrt(rank)
        w.add_tensor(name + ".lora_a", a.astype(np.float16))
        w.add_tensor(name + ".lora_b", b.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _run(model: Path, rpc, tmp: Path, extra: list[str], name: str) -> tuple[bytes, str]:
    run = engine.run_logits(model, tmp / f"{name}.bin", [*engine.host_experts_args(rpc.endpoint), *extra], n_predict=12)
    return run.logits, run.log


@pytest.fixture(scope="module")
def lora(model_q8, tmp_path_factory) -> Path:
    return write_expert_lora(model_q8, tmp_path_factory.mktemp("lora") / "up-exps-lora.gguf")


def test_an_expert_lora_bypasses_the_cache_and_stays_exact(model_q8, rpc, lora, tmp_path):
    plain, _ = _run(model_q8, rpc, tmp_path, [], "plain")
    off, _ = _run(model_q8, rpc, tmp_path, ["--lora", str(lora)], "lora-off")
    on, log = _run(model_q8, rpc, tmp_path, ["--lora", str(lora), *engine.cache_args(8)], "lora-on")
    assert off != plain, "the adapter did not change the logits: it was not applied"
    assert on == off
    assert log.count("LoRA adapters are loaded: the expert cache is bypassed") == 1
