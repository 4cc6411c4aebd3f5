"""The patch series against the pinned upstream: list, check, export and rebase.

``patches/series`` names ``NNNN-topic.patch`` files made by ``git format-patch``
from the commits of the vendored work tree (see :mod:`pybmoe.build.vendor`). Each patch
carries a DEP-3 style header in its message: a Description of why, ``Forwarded``
and ``Last-Update``.

Workflow::

    pybmoe vendor                  # materialise vendor/src/... with the series applied
    (edit + git commit inside vendor/src/llama_cpp_python-*/)
    pybmoe patches export          # rewrite patches/ from those commits
    pybmoe patches check           # the series applies cleanly to a fresh pin

    pybmoe patches rebase --onto 0.3.40    # replay the series onto another llama.cpp tree (a
                                           # version, a tarball, a directory, DIR --ref REF)
    (on a conflict: resolve in vendor/rebase/<sdist>/, git am --continue, then)
    pybmoe patches rebase --continue vendor/rebase/<sdist>
    pybmoe patches export --from vendor/rebase/<sdist>
"""
from __future__ import annotations

import dataclasses
import email.header
import json
import re
import shutil
import tempfile
from pathlib import Path

from . import trees, vendor


def subject(patch: Path) -> str:
    """The ``Subject`` of a ``git format-patch`` file, the patch's one-line summary (its commit's
    first line): the header unfolded (a line that starts with white space continues the one before,
    RFC 5322), MIME encoded-words decoded, without the ``[PATCH ...]`` prefix; ``?`` when it has none."""
    head = patch.read_text(errors="replace").split("\n\n", 1)[0]
    m = re.search(r"^Subject:(.*(?:\n[ \t].*)*)", head, re.M)
    if not m:
        return "?"
    text = str(email.header.make_header(email.header.decode_header(re.sub(r"\n[ \t]+", " ", m.group(1)).strip())))
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", text).strip()


def list_series(root: Path | None = None) -> list[tuple[str, str]]:
    """``[(file name, Subject)]`` of the series, in order (:func:`subject`)."""
    root = root or vendor.project_root()
    return [(p.name, subject(p)) for p in vendor.series(root)]


#: The header of the series' table in docs/patches.md (:func:`series_table`).
TABLE_HEAD = ("| patch | subject | notes |", "|---|---|---|")
_CELL_SEP = re.compile(r"(?<!\\)\|")


def table_rows(markdown: str) -> list[tuple[str, str, str]]:
    """``[(patch number, subject, notes)]`` of the series' table in ``markdown`` (the table under
    :data:`TABLE_HEAD`), cells as written (``\\|`` kept); ``[]`` when it has none."""
    lines = markdown.splitlines()
    for i in range(len(lines) - 1):
        if tuple(ln.strip() for ln in lines[i:i + 2]) == TABLE_HEAD:
            rows = []
            for ln in lines[i + 2:]:
                if not ln.startswith("|"):
                    break
                cells = [c.strip() for c in _CELL_SEP.split(ln.strip())[1:-1]]
                rows.append(tuple((cells + ["", "", ""])[:3]))
            return rows
    return []


def series_table(root: Path | None = None, notes: dict[str, str] | None = None) -> str:
    """The series as a Markdown table, one row per patch in order: its number, its subject
    (:func:`subject`; ``|`` escaped) and ``notes[number]`` (empty where there is none). The table of
    docs/patches.md is this, its notes kept (``pybmoe patches list --markdown``)."""
    notes = notes or {}
    rows = list(TABLE_HEAD)
    for name, subj in list_series(root):
        n = name.split("-", 1)[0]
        cell, note = subj.replace("|", "\\|"), notes.get(n, "")
        rows.append(f"| {n} | {cell} |" + (f" {note} |" if note else " |"))
    return "\n".join(rows) + "\n"


#: The page whose table lists the series (:func:`docs_table`), relative to the checkout.
PATCHES_DOC = Path("docs") / "patches.md"


def docs_table(root: Path | None = None) -> str:
    """The table :data:`PATCHES_DOC` holds when it is up to date: :func:`series_table` with the notes
    the page has now, by patch number (a patch new to the series gets none)."""
    root = root or vendor.project_root()
    doc = root / PATCHES_DOC
    rows = table_rows(doc.read_text()) if doc.is_file() else []
    return series_table(root, {n: note for n, _, note in rows})


def export(root: Path | None = None, tree: Path | None = None) -> list[str]:
    """Regenerate ``patches/*.patch`` and ``patches/series`` from a work tree's commits.

    ``tree`` is the git work tree holding the base (tag ``pybmoe-base``) and one commit per
    patch on top; it defaults to the pinned tree under ``vendor/src/``, and may be a rebase
    tree (``vendor/rebase/<sdist>``). The output is stable: exporting right after
    :func:`pybmoe.build.vendor.ensure_tree` reproduces the files byte for byte.

    Raises:
        VendorError: the work tree is missing, has no ``pybmoe-base`` tag, is in the middle of
            a ``git am``, or has uncommitted edits.
    """
    root = root or vendor.project_root()
    if tree is None:
        tree = vendor.tree_dir(root, vendor.load_pin(root))
    tree = Path(tree)
    if not (tree / ".git").is_dir():
        raise vendor.VendorError(f"no work tree at {tree}; run `pybmoe vendor` first")
    if vendor._git(tree, "rev-parse", "-q", "--verify", vendor.BASE_TAG, check=False).returncode != 0:
        raise vendor.VendorError(f"{tree} has no {vendor.BASE_TAG} tag; it is not a pybmoe work tree")
    if _am_in_progress(tree):
        raise vendor.VendorError(f"{tree} is in the middle of `git am`; resolve and `git am --continue` first")
    if vendor.is_dirty(tree):
        raise vendor.DirtyTreeError(f"{tree} has uncommitted edits; commit them before exporting")
    pdir = root / "patches"
    with tempfile.TemporaryDirectory() as tmp:
        vendor._git(tree, "format-patch", "-q", "--no-signature", "--zero-commit", "--no-stat",
                    "--full-index", "-N", "-o", tmp, f"{vendor.BASE_TAG}..HEAD")
        new = sorted(Path(tmp).glob("*.patch"))
        for old in pdir.glob("*.patch"):
            old.unlink()
        pdir.mkdir(exist_ok=True)
        for p in new:
            shutil.copyfile(p, pdir / p.name)
    names = [p.name for p in new]
    (pdir / "series").write_text("".join(n + "\n" for n in names))
    (tree / ".git" / "pybmoe-series.sha256").write_text(vendor.series_digest(root))
    return names


# ------------------------------------------------------------------ applying, one patch at a time

CLEAN, FUZZY, CONFLICTED, FAILED, NOT_REACHED = "clean", "fuzzy", "conflicted", "failed", "not reached"


@dataclasses.dataclass(frozen=True)
class PatchResult:
    """How one patch went onto a base.

    ``status``: ``clean`` (applies exactly where it was made), ``fuzzy`` (applied, but needed
    line offsets or a 3-way merge), ``conflicted`` (the 3-way merge left conflicts), ``failed``
    (does not apply, no 3-way attempted) or ``not reached`` (after a patch that stopped the run).
    ``detail`` says why (offsets, the 3-way fallback, the conflicted files).
    """

    patch: str
    status: str
    detail: str = ""


_OFFSET = re.compile(r"Hunk #\d+ succeeded at \d+ \(offset (-?\d+) lines?\)")


def _am_in_progress(tree: Path) -> bool:
    gd = vendor._git(tree, "rev-parse", "--git-dir").stdout.strip()
    return (tree / gd / "rebase-apply").is_dir()


def _conflicted_files(tree: Path) -> list[str]:
    r = vendor._git(tree, "diff", "--name-only", "--diff-filter=U", check=False)
    return [l for l in r.stdout.splitlines() if l]


def apply_one(tree: Path, patch: Path, three_way: bool) -> PatchResult:
    """``git am`` one patch onto ``tree``'s HEAD and classify it (see :class:`PatchResult`).

    Without ``three_way`` a patch that does not apply is aborted (``failed``, HEAD unchanged).
    With it, a conflicted patch is left in the ``git am`` state for a hand resolution.
    """
    probe = vendor._git(tree, "apply", "--check", "-v", str(patch), check=False)
    offsets = _OFFSET.findall(probe.stdout + probe.stderr)
    args = ["am", "-q", "--keep-cr", "--committer-date-is-author-date"]
    if three_way:
        args.append("-3")
    r = vendor._git(tree, *args, str(patch), check=False)
    out = (r.stdout + r.stderr).strip()
    if r.returncode != 0:
        if not three_way:
            vendor._git(tree, "am", "--abort", check=False)
            return PatchResult(patch.name, FAILED, out[-3000:])
        files = _conflicted_files(tree)
        why = ("conflicts in " + ", ".join(files)) if files else out[-3000:]
        return PatchResult(patch.name, CONFLICTED, why)
    if probe.returncode != 0:
        return PatchResult(patch.name, FUZZY, "needed a 3-way merge")
    if offsets:
        return PatchResult(patch.name, FUZZY, f"{len(offsets)} hunk(s) at offsets "
                                               f"{', '.join(sorted(set(offsets), key=int))} lines")
    return PatchResult(patch.name, CLEAN)


def format_table(results: list[PatchResult]) -> str:
    """The per-patch report: one ``patch | status | detail`` row per patch."""
    w = max([len("patch")] + [len(r.patch) for r in results])
    rows = [f"{'patch':{w}s} | {'status':11s} | detail", f"{'-' * w}-+-{'-' * 11}-+-------"]
    for r in results:
        detail = r.detail.splitlines()[0] if r.detail else ""
        rows.append(f"{r.patch:{w}s} | {r.status:11s} | {detail}")
    return "\n".join(rows)


def check(root: Path | None = None, log=print) -> bool:
    """Apply the series to a fresh copy of the pinned upstream (no 3-way); report per patch.

    Logs :func:`format_table` and, for a failing patch, git's message. Returns True when every
    patch applies (``clean``, or ``fuzzy`` by line offsets only), False at the first that does not.

    Raises:
        VendorError: the sdist cannot be fetched or does not match the pin.
    """
    root = root or vendor.project_root()
    pin = vendor.load_pin(root)
    sdists = vendor.fetch_pin(pin)
    results: list[PatchResult] = []
    names = [p.name for p in vendor.series(root)]
    with tempfile.TemporaryDirectory(prefix="pybmoe-check-") as tmp:
        tree = Path(tmp) / pin.stem
        vendor.unpack_pin(pin, tree, *sdists)
        for p in vendor.series(root):
            res = apply_one(tree, p, three_way=False)
            results.append(res)
            if res.status == FAILED:
                break
    ok = all(r.status in (CLEAN, FUZZY) for r in results)
    results += [PatchResult(n, NOT_REACHED) for n in names[len(results):]]
    log(format_table(results))
    for r in results:
        if r.status == FAILED:
            log(f"\n{r.patch} does not apply to {pin.stem} (llama.cpp {pin.llama_cpp}):\n{r.detail}")
    return ok


# ------------------------------------------------------------------------------------- rebase

_STATE = "pybmoe-rebase.json"


@dataclasses.dataclass
class RebaseResult:
    """The outcome of :func:`rebase`: ``tree`` is the work tree, ``results`` one row per patch;
    ``source`` says where the base came from (:meth:`pybmoe.build.trees.Source.describe`),
    ``digest`` is its digest (``sha256:<hex>`` of a tarball, ``files-sha256:<hex>`` of a
    directory or a git ref, see :mod:`pybmoe.build.trees`)."""

    tree: Path
    source: str
    digest: str
    results: list[PatchResult]

    @property
    def ok(self) -> bool:
        """True when no patch conflicted (every one is ``clean`` or ``fuzzy``)."""
        return all(r.status in (CLEAN, FUZZY) for r in self.results)


def resolve_onto(onto: str, root: Path | None = None, ref: str | None = None) -> trees.Source:
    """The llama.cpp tree named by ``onto`` (and ``ref``): see :func:`pybmoe.build.trees.resolve`.

    Raises:
        ValueError: (:class:`~pybmoe.build.trees.SourceError`) bad ``onto`` or ``ref``.
        VendorError: a version's download failed.
    """
    return trees.resolve(onto, ref, root)


def _old_series_into(root: Path, tree: Path) -> None:
    """Make the blobs the patches were made against available to ``git am -3`` in ``tree``: the
    pinned base plus the series, committed in a scratch repo and fetched as ``refs/pybmoe/pinned``."""
    pin = vendor.load_pin(root)
    sdists = vendor.fetch_pin(pin)
    with tempfile.TemporaryDirectory(prefix="pybmoe-pinned-") as tmp:
        old = Path(tmp) / pin.stem
        vendor.unpack_pin(pin, old, *sdists)
        for p in vendor.series(root):
            if vendor._git(old, "am", "-q", "--keep-cr", str(p), check=False).returncode != 0:
                vendor._git(old, "am", "--abort", check=False)
                break  # the blobs up to here still help
        vendor._git(tree, "fetch", "-q", "--no-tags", str(old), "+HEAD:refs/pybmoe/pinned")


def _replay(tree: Path, state: dict, log, keep_going: bool = False) -> list[PatchResult]:
    results = [PatchResult(**r) for r in state["done"]]
    for i in range(len(results), len(state["patches"])):
        p = Path(state["patches"][i])
        res = apply_one(tree, p, three_way=True)
        if res.status == CONFLICTED and keep_going:
            vendor._git(tree, "am", "--abort", check=False)
            res = PatchResult(res.patch, res.status, res.detail + " (skipped: the rest is replayed without it)")
        results.append(res)
        state["done"] = [dataclasses.asdict(r) for r in results]
        (tree / ".git" / _STATE).write_text(json.dumps(state, indent=1))
        if res.status == CONFLICTED and not keep_going:
            break
    return results + [PatchResult(Path(n).name, NOT_REACHED) for n in state["patches"][len(results):]]


def rebase(onto: str, root: Path | None = None, *, ref: str | None = None, force: bool = False,
           dry_run: bool = False, log=print) -> RebaseResult:
    """Replay ``patches/series`` onto another llama.cpp tree with 3-way merges.

    ``onto`` (and ``ref``) name the tree: a directory, a git checkout at ``ref``, a tarball
    holding llama.cpp at any depth, or a ``llama-cpp-python`` version (see
    :mod:`pybmoe.build.trees`); every check of them runs before any work. The tree is laid out in
    ``vendor/rebase/<name>/`` (git-ignored; ``vendor/src`` is not touched) with llama.cpp at the
    pin's ``subdir``, and committed as its base (tag ``pybmoe-base``; the message records the
    source and its digest). The pinned base with the series is fetched into it as
    ``refs/pybmoe/pinned`` so ``git am -3`` has the ancestors; then each patch is applied with
    ``git am -3``, one at a time. On the first conflict the tree is left in the ``git am`` state;
    :func:`rebase_continue` resumes after a hand resolution.

    ``dry_run``: the work tree is a temporary one, removed at the end, and a conflicted patch is
    skipped (reported, then the rest is replayed without it), so the table covers every patch.

    Raises:
        ValueError: (:class:`~pybmoe.build.trees.SourceError`) bad ``onto`` or ``ref``.
        VendorError: a version's sdist cannot be fetched, or the work tree already exists
            (``force`` discards it).
    """
    root = root or vendor.project_root()
    pin = vendor.load_pin(root)
    src = trees.resolve(onto, ref, root)
    if dry_run:
        tmp = tempfile.TemporaryDirectory(prefix="pybmoe-rebase-")
        tree = Path(tmp.name) / src.name
    else:
        tmp = None
        tree = root / "vendor" / "rebase" / src.name
        if tree.exists():
            if not force:
                raise vendor.VendorError(f"{tree} exists (an earlier rebase, perhaps mid-resolution); "
                                         "finish it with --continue, or pass --force to start over")
            shutil.rmtree(tree)
    try:
        if src.digest:
            log(f"pybmoe patches rebase: {src.path.name} {src.digest.replace(':', ' ', 1)}")
        log(f"pybmoe patches rebase: {src.describe()}; laying it out in {tree}")
        src = trees.materialise(src, tree, pin.subdir)
        if src.kind != "tarball":
            log(f"pybmoe patches rebase: {src.path.name} {src.digest.replace(':', ' ', 1)}")
        _old_series_into(root, tree)
        state = {"source": src.describe(), "digest": src.digest, "done": [],
                 "patches": [str(p) for p in vendor.series(root)]}
        (tree / ".git" / _STATE).write_text(json.dumps(state, indent=1))
        return RebaseResult(tree, src.describe(), src.digest, _replay(tree, state, log, keep_going=dry_run))
    finally:
        if tmp is not None:
            tmp.cleanup()


def rebase_continue(tree: Path, *, log=print) -> RebaseResult:
    """Resume a stopped :func:`rebase` in ``tree`` after the conflicts were resolved.

    If a ``git am`` is still in progress, runs ``git am --continue`` first (the resolved files
    must be ``git add``-ed); the patch it completes is reported as ``fuzzy`` (resolved by hand).

    Raises:
        VendorError: ``tree`` is not a rebase tree, or ``git am --continue`` fails (unresolved
            conflicts).
    """
    tree = Path(tree)
    sf = tree / ".git" / _STATE
    if not sf.is_file():
        raise vendor.VendorError(f"{tree} is not a tree made by `pybmoe patches rebase` (no .git/{_STATE})")
    state = json.loads(sf.read_text())
    done = state["done"]
    if done and done[-1]["status"] == CONFLICTED:
        if _am_in_progress(tree):
            r = vendor._git(tree, "am", "--continue", check=False)
            if r.returncode != 0:
                raise vendor.VendorError(f"git am --continue failed in {tree}; resolve the conflicts "
                                         f"and `git add` them first:\n{(r.stdout + r.stderr).strip()[-2000:]}")
        n = int(vendor._git(tree, "rev-list", "--count", f"{vendor.BASE_TAG}..HEAD").stdout.strip())
        if n != len(done):
            raise vendor.VendorError(f"{tree} has {n} patch commit(s) on its base, expected {len(done)}: "
                                     f"{done[-1]['patch']} was not committed (git am --abort or --skip?); "
                                     "start over with `pybmoe patches rebase --onto ... --force`")
        done[-1] = {"patch": done[-1]["patch"], "status": FUZZY, "detail": "conflicts resolved by hand"}
        sf.write_text(json.dumps(state, indent=1))
    elif _am_in_progress(tree):
        raise vendor.VendorError(f"{tree} is in a `git am` that pybmoe did not start; finish it by hand")
    source = state.get("source") or state.get("sdist", "?")
    digest = state.get("digest") or "sha256:" + state.get("sha256", "?")
    return RebaseResult(tree, source, digest, _replay(tree, state, log))
