"""Shared fixtures: the patched binaries, a loopback RPC device and the tiny models.

No test touches the network: models come from pybmoe.models (vocab from the pinned tree).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pybmoe import engine, models


@pytest.fixture(scope="session")
def model_q8() -> Path:
    """The embedded default model (qwen3moe, 4 layers, 16 experts, top-4, Q8_0)."""
    return models.default_model_path("Q8_0")


@pytest.fixture(scope="session")
def model_f16() -> Path:
    return models.default_model_path("F16")


@pytest.fixture(scope="session")
def model_q4k() -> Path:
    return models.default_model_path("Q4_K")


@pytest.fixture(scope="session")
def rpc():
    """A loopback ggml-rpc-server, the stand-in device, for the whole session."""
    with engine.RpcServer(threads=1) as r:
        yield r
