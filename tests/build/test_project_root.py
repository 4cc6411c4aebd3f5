"""The checkout is found as a new user would expect: from the working directory first, then
``$PYBMOE_ROOT``, then the folder the package sits in (found when tried as a new user: after
``pip install .``, ``pybmoe patches check`` run inside the checkout said there was no
``vendor/upstream.toml`` under site-packages)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pybmoe import engine
from pybmoe.build import vendor

ROOT = Path(__file__).resolve().parents[2]


def _root(path: Path) -> Path:
    (path / "vendor").mkdir(parents=True)
    shutil.copy(ROOT / "vendor" / "upstream.toml", path / "vendor")
    return path


@pytest.fixture
def away(tmp_path, monkeypatch) -> Path:
    """No checkout anywhere: PYBMOE_ROOT unset, the package 'installed' in a folder that is not a
    checkout, the working directory outside any checkout. Returns that working directory."""
    monkeypatch.delenv("PYBMOE_ROOT", raising=False)
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setattr(vendor, "PACKAGE_PARENT", site)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert not any((d / "vendor" / "upstream.toml").is_file() for d in (cwd, *cwd.parents))
    return cwd


def test_the_working_directory_comes_first(away, tmp_path, monkeypatch):
    proj = _root(tmp_path / "proj")
    other = _root(tmp_path / "other")
    sub = proj / "docs" / "deep"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert vendor.project_root() == proj.resolve()            # walking up from a subfolder
    monkeypatch.setenv("PYBMOE_ROOT", str(other))
    monkeypatch.setattr(vendor, "PACKAGE_PARENT", other)
    assert vendor.project_root() == proj.resolve()            # before PYBMOE_ROOT and the package
    assert vendor.project_root(cwd=tmp_path / "elsewhere") == other.resolve()


def test_then_pybmoe_root_then_the_package(away, tmp_path, monkeypatch):
    env_root = _root(tmp_path / "env-root")
    pkg_root = _root(tmp_path / "pkg-root")
    monkeypatch.setattr(vendor, "PACKAGE_PARENT", pkg_root)
    monkeypatch.setenv("PYBMOE_ROOT", str(env_root))
    assert vendor.project_root() == env_root.resolve()
    monkeypatch.setenv("PYBMOE_ROOT", str(tmp_path / "not-a-checkout"))
    assert vendor.project_root() == pkg_root
    monkeypatch.delenv("PYBMOE_ROOT")
    assert vendor.project_root() == pkg_root


def test_no_checkout_names_the_three_places(away, monkeypatch):
    assert vendor.find_project_root() is None
    with pytest.raises(vendor.VendorError) as ei:
        vendor.project_root()
    msg = str(ei.value)
    assert f"no vendor/upstream.toml in {away.resolve()} or any folder above it" in msg
    assert "PYBMOE_ROOT (not set)" in msg and str(vendor.PACKAGE_PARENT) in msg
    assert "run from a pybmoe checkout or set PYBMOE_ROOT" in msg


def test_the_dev_build_of_the_working_checkout_is_searched(away, tmp_path, monkeypatch):
    proj = _root(tmp_path / "proj")
    monkeypatch.chdir(proj)
    assert proj.resolve() / "build" / "dev" / "bin" in engine.bin_dirs()


def test_installed_package_run_inside_a_checkout(fake_root, tmp_path):
    """The new user's commands: pybmoe imported from a folder that is not a checkout (as from
    site-packages), no PYBMOE_ROOT, run in a subfolder of a checkout: the checkout's series is
    listed (its extra patch shows it is this checkout's); outside any checkout, a clear error."""
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "pybmoe", site / "pybmoe", ignore=shutil.ignore_patterns("__pycache__", "bin", "*.so"))
    proj = fake_root("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
                     "Subject: [PATCH] bogus: only in this checkout\n\n---\n")
    sub = proj / "patches"
    env = {k: v for k, v in os.environ.items() if k not in ("PYBMOE_ROOT", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "patches", "list"], cwd=sub, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "9999-bogus.patch  bogus: only in this checkout" in r.stdout
    away = tmp_path / "away"
    away.mkdir()
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "patches", "list"], cwd=away, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "pybmoe patches: error: no vendor/upstream.toml in" in r.stderr and "set PYBMOE_ROOT" in r.stderr
