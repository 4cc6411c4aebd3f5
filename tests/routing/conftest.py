"""Fixtures of the routing tests: the replay core built from the current source, and the two
implementations every hand-worked replay runs on (the compiled core and the tests' oracle,
lru_oracle.py)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

import lru_oracle
from pybmoe.routing import sim

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def core_from_source(tmp_path_factory) -> Path | None:
    """Build pybmoe/routing/_simcore.c into a temporary folder and load it, so that every routing test
    replays through the current source rather than an installed build. Without a C compiler the
    replay uses the core :func:`pybmoe.routing.sim.core_path` finds (None is returned)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = tmp_path_factory.mktemp("simcore") / "_simcore.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(REPO / "pybmoe" / "routing" / "_simcore.c")],
                   check=True)
    assert sim.load_core(out), "the freshly built core did not load"
    return out


@pytest.fixture
def core(core_from_source) -> ctypes.CDLL:
    """The compiled core in use (skips when there is none: no compiler and no built core)."""
    if not sim.have_core():
        pytest.skip("no C compiler to build pybmoe/routing/_simcore.c and no built core")
    return sim._load_core()


@pytest.fixture(params=["oracle", "core"])
def impl(request) -> Iterator[str]:
    """Run the test twice: with lru_oracle in place of the compiled core, then with the core."""
    if request.param == "core":
        request.getfixturevalue("core")
        yield "core"
    else:
        with lru_oracle.instead_of_the_core():
            yield "oracle"
