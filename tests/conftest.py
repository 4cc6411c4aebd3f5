"""Shared fixtures: the patched binaries, a loopback RPC device and the tiny models.

No test touches the network: models come from pybmoe.models (vocab from the pinned tree).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.build import vendor
from pybmoe.routing import trace
from pybmoe.routing.granite import GRANITE_TRACE

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- progress by test file
# At pytest's default verbosity each test file is one line ("tests/engine/test_serve.py ....  [ 40%]");
# this adds the seconds the file took before its percentage, so a 10-minute run says where the time
# goes (tools/test.sh; `-q` or `-v` turn it off).

class _FileTimes:
    def __init__(self, config):
        self.config = config
        self.current: str | None = None
        self.t0 = 0.0
        self.done = 0
        self.total = -1

    def pytest_collection_finish(self, session):
        self.total = len(session.items)

    def _reporter(self):
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        return tr if tr is not None and tr.verbosity == 0 and getattr(tr, "showfspath", True) else None

    def _close_line(self, tr) -> None:
        if self.current is not None:
            tr.write(f" {time.monotonic() - self.t0:.0f} s")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid, location):
        tr = self._reporter()
        path = nodeid.split("::")[0]
        if tr is None or path == self.current:
            return
        self._close_line(tr)
        self.current, self.t0 = path, time.monotonic()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logfinish(self, nodeid, location):
        tr = self._reporter()
        self.done += 1
        if tr is not None and self.done == self.total:
            self._close_line(tr)  # the last file: before pytest writes [100%]
            self.current = None


def pytest_configure(config):
    config.pluginmanager.register(_FileTimes(config), "pybmoe-file-times")


@pytest.fixture(scope="session")
def granite_raw() -> dict:
    """The granite-3.0-1b-a400m routing trace as its raw JSON (24 layers, 32 experts, top-8; the copy
    bundled in pybmoe/data/, the published bytes: tests/routing/test_trace.py)."""
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

