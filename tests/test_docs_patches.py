"""The docs and the patch series (issue 41): the table of docs/patches.md is the series as
``patches/series`` holds it (every patch, in order, by its subject), and every patch number the
README and docs/ name is a patch of the series.

The table is written by ``pybmoe patches list --markdown`` (:func:`pybmoe.build.patches.docs_table`)
from each patch's ``Subject``, keeping the notes the page has, so a patch added, dropped, renamed
or reordered fails here until the table is written again. (docs/architecture.md counted 19
patches when the series had 34.)
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path

from pybmoe.build import patches, vendor
from pybmoe.cli import patches as patches_cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/benchmarks/<run>/README.md too


def _table(text: str) -> str:
    """The series' table of a page, as written."""
    lines = text.splitlines()
    i = next((k for k in range(len(lines)) if tuple(lines[k:k + 2]) == patches.TABLE_HEAD), None)
    assert i is not None, f"no table under the header {patches.TABLE_HEAD[0]!r}"
    j = i
    while j < len(lines) and lines[j].startswith("|"):
        j += 1
    return "\n".join(lines[i:j]) + "\n"


def test_the_patch_table_is_the_series():
    got = _table((ROOT / patches.PATCHES_DOC).read_text())
    want = patches.docs_table(ROOT)
    diff = "".join(difflib.unified_diff(got.splitlines(True), want.splitlines(True), "docs/patches.md",
                                        "patches/series"))
    assert got == want, "the table of docs/patches.md is not the series; `pybmoe patches list --markdown` " \
                        "writes it:\n" + diff
    rows = patches.table_rows(got)
    series = vendor.series(ROOT)
    assert [n for n, _, _ in rows] == [p.name[:4] for p in series] and len(rows) == len(series) >= 34
    # the subjects unfolded: 0002's Subject header spans two lines of the patch
    assert rows[1][1] == "ggml-backend: no device but the CPU accepts MUL_MAT_ID with a skip table"
    assert rows[3][1] == r"common: --moe-expert-cache N\|auto and its companion flags"  # `|` escaped in a cell


def test_pybmoe_patches_list_markdown_prints_the_table(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert patches_cli.main(["list", "--markdown"]) == 0
    assert capsys.readouterr().out == patches.docs_table(ROOT)


def test_a_patch_new_to_the_series_gets_a_row_and_a_dropped_one_goes(tmp_path):
    """The table follows the series, not the page: in a copy of the checkout's series with the last
    patch dropped and the first one's subject changed, the table loses the last row, takes the new
    subject, and keeps the other rows' notes."""
    (tmp_path / "patches").mkdir()
    (tmp_path / "docs").mkdir()
    series = vendor.series(ROOT)
    for p in series[:-1]:
        (tmp_path / "patches" / p.name).write_bytes(p.read_bytes())
    first = tmp_path / "patches" / series[0].name
    first.write_text(re.sub(r"^Subject: .*$", "Subject: [PATCH] ggml: a subject\n that spans two lines",
                            first.read_text(), count=1, flags=re.M))
    (tmp_path / "patches" / "series").write_text("".join(p.name + "\n" for p in series[:-1]))
    (tmp_path / patches.PATCHES_DOC).write_text((ROOT / patches.PATCHES_DOC).read_text())
    old = patches.table_rows((ROOT / patches.PATCHES_DOC).read_text())
    new = patches.table_rows(patches.docs_table(tmp_path))
    assert len(new) == len(old) - 1
    assert new[0] == ("0001", "ggml: a subject that spans two lines", old[0][2])
    assert new[1:] == old[1:-1]


def _named(text: str) -> set[int]:
    """The patch numbers a page names: ``patch NNNN``, ``patches NNNN and NNNN``, ``NNNN–NNNN``."""
    out = set()
    for m in re.finditer(r"\bpatch(?:es)? ((?:\d{4}(?:, | and | or |–|-|\.\.))*\d{4})\b", text):
        out |= {int(n) for n in re.findall(r"\d{4}", m.group(1))}
    for a, b in re.findall(r"\b(0\d{3}) ?(?:–|\.\.) ?(0\d{3})\b", text):
        out |= {int(a), int(b)}
    return out


def test_every_patch_the_docs_name_is_in_the_series():
    last = len(vendor.series(ROOT))
    assert {int(p.name[:4]) for p in vendor.series(ROOT)} == set(range(1, last + 1))
    bad = {f"{d.relative_to(ROOT)}: {n:04d}" for d in DOCS for n in _named(d.read_text()) if not 1 <= n <= last}
    assert not bad, f"patches the docs name that the series (0001 .. {last:04d}) does not have: {sorted(bad)}"
    assert _named("patch 0033's hook; patches 0016 and 0017; 0009–0013; 0001..0019") == {33, 16, 17, 9, 13, 1, 19}


def test_no_page_gives_the_series_a_span_it_does_not_have():
    """Where a page names the series with its span (``patches/series 0001..NNNN``, ``the series,
    0001–NNNN``), the span ends at the last patch (docs/architecture.md's picture said 0001..0019)."""
    last = len(vendor.series(ROOT))
    span = re.compile(r"(?:patches/series|the series)\W{0,12}(?:<br/>)?\W{0,4}0001 ?(?:–|\.\.) ?(\d{4})\b")
    bad = {f"{d.relative_to(ROOT)}: {m.group(0)}" for d in DOCS for m in span.finditer(d.read_text())
           if int(m.group(1)) != last}
    assert not bad, sorted(bad)
    assert [m.group(1) for m in span.finditer('series["patches/series<br/>0001..0019 (DEP-3)"]')] == ["0019"]
