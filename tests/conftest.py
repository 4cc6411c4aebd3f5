"""Shared fixtures: the patched binaries, a loopback RPC device and the tiny models.

No test touches the network: models come from pybmoe.models (vocab from the pinned tree).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.build import vendor
from pybmoe.routing import trace
from pybmoe.routing.granite import GRANITE_TRACE

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def granite_raw() -> dict:
    """The granite-3.0-1b-a400m routing trace as its raw JSON (24 layers, 32 experts, top-8; the copy
    bundled in pybmoe/data/, identical to shared/data/'s: tests/routing/test_trace.py)."""
    return json.loads(GRANITE_TRACE.read_text())


@pytest.fixture(scope="session")
def granite() -> trace.Trace:
    """The same trace read by pybmoe.routing.trace."""
    return trace.read_trace(GRANITE_TRACE)


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


@pytest.fixture(scope="session")
def pin():
    """The pinned upstream (vendor/upstream.toml)."""
    return vendor.load_pin(ROOT)


@pytest.fixture(scope="session")
def sdist(pin):
    """The pinned sdist, fetched once into the pybmoe cache."""
    return vendor.fetch_sdist(pin, vendor.cache_dir())


@pytest.fixture
def fake_root(tmp_path):
    """A factory of project roots under tmp_path with our pin and patch series (so vendored and
    rebase trees land there); ``extra_patch`` appends a patch named 9999-bogus.patch to the series."""
    def make(extra_patch: str | None = None) -> Path:
        root = tmp_path / "proj"
        (root / "vendor").mkdir(parents=True)
        shutil.copy(ROOT / "vendor" / "upstream.toml", root / "vendor")
        shutil.copytree(ROOT / "patches", root / "patches")
        if extra_patch:
            (root / "patches" / "9999-bogus.patch").write_text(extra_patch)
            with open(root / "patches" / "series", "a") as f:
                f.write("9999-bogus.patch\n")
        return root
    return make

