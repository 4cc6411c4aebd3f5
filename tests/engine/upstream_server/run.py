"""Run llama.cpp's server test suite (``tools/server/tests``) against our llama-server, cache on.

    python tests/engine/upstream_server/run.py [--work DIR] [--timeout S] [--slots N] [PYTEST ARGS ...]

The suite is copied from the vendored tree (``pybmoe vendor``) into ``WORK/tree/tools/server/tests``
(next to links to the tree's ``models/`` and ``tools/mtmd/``, which some tests read by relative
path) and run there by pytest with :mod:`pybmoe_upstream_plugin`, which points its presets at
generated models and its server at the patched binary with the expert cache engaged. Nothing is
written into the vendored tree. PYTEST ARGS (default: the whole ``unit/`` directory) are passed
on; test paths are relative to the suite directory, e.g. ``unit/test_basic.py``.

Prints one line per test file (passed / failed / skipped / errors) and the reasons of the
failures and skips, and exits with pytest's status.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def upstream_tests_dir() -> Path:
    """``tools/server/tests`` of the vendored, patched llama.cpp tree.

    Raises:
        FileNotFoundError: the tree is not materialised (run ``pybmoe vendor``).
    """
    sys.path.insert(0, str(ROOT))
    from pybmoe.build import vendor
    d = vendor.llama_cpp_dir() / "tools" / "server" / "tests"
    if not (d / "utils.py").is_file():
        raise FileNotFoundError(f"no upstream server test suite at {d}; run `pybmoe vendor` first")
    return d


def prepare(work: Path) -> Path:
    """Copy the suite under ``work/tree`` (links for the paths it reads relatively); return its directory."""
    src = upstream_tests_dir()
    llama = src.parent.parent.parent
    tree = work / "tree"
    dst = tree / "tools" / "server" / "tests"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tmp", ".venv", "__pycache__", ".pytest_cache"))
    (dst / "tmp").mkdir()
    for rel in ("models", "tools/mtmd"):
        link = tree / rel
        if not link.exists():
            link.symlink_to(llama / rel)
    return dst


@dataclasses.dataclass
class Outcome:
    """One test's result from the JUnit report: ``status`` is passed | failed | error | skipped."""

    file: str
    name: str
    status: str
    message: str
    seconds: float


@dataclasses.dataclass
class RunResult:
    returncode: int
    outcomes: list[Outcome]
    servers: list[dict]    # one record per server start (see the plugin)
    work: Path

    def counts(self) -> dict[str, dict[str, int]]:
        """``{file: {status: n}}`` over every test of the run."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for o in self.outcomes:
            out[o.file][o.status] += 1
        return {f: dict(c) for f, c in sorted(out.items())}


def _parse_junit(path: Path) -> list[Outcome]:
    out = []
    if not path.is_file():
        return out
    for tc in ET.parse(path).getroot().iter("testcase"):
        cls = tc.get("classname", "")
        # a module skipped at collection is reported with no class name and the module as name
        file = (cls or tc.get("name", "?")).replace(".", "/") + ".py"
        status, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "").strip().splitlines()[0][:300] if el.get("message") else ""
                break
        out.append(Outcome(file, tc.get("name", "?"), status, msg, float(tc.get("time") or 0)))
    return out


def run(pytest_args: list[str] | None = None, work: Path | None = None, timeout_s: float | None = None,
        extra_env: dict | None = None) -> RunResult:
    """Run the suite (or the tests named in ``pytest_args``) and collect the results.

    ``timeout_s`` bounds the whole pytest run (seconds; ``subprocess.TimeoutExpired`` past it).
    """
    work = Path(work or tempfile.mkdtemp(prefix="pybmoe-upstream-"))
    work.mkdir(parents=True, exist_ok=True)
    suite = prepare(work)
    junit, report = work / "junit.xml", work / "servers.jsonl"
    for p in (junit, report):
        p.unlink(missing_ok=True)
    env = dict(os.environ, **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ROOT), env.get("PYTHONPATH")]))
    env["PYBMOE_UPSTREAM_WORK"] = str(work)
    env["PYBMOE_UPSTREAM_REPORT"] = str(report)
    env.pop("DEBUG", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "pybmoe_upstream_plugin", "-p", "no:cacheprovider",
           "--rootdir", str(suite), "-c", str(suite / "pytest.ini"), f"--junitxml={junit}", "-q", "-rfEs",
           *(pytest_args or ["unit"])]
    with open(work / "pytest.log", "wb") as log:
        r = subprocess.run(cmd, cwd=suite, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    servers = [json.loads(l) for l in report.read_text().splitlines()] if report.is_file() else []
    return RunResult(r.returncode, _parse_junit(junit), servers, work)


def nodeid(o: Outcome) -> str:
    return f"{o.file}::{o.name}"


def compare_with_baseline(res: RunResult, timeout_s: float | None = None) -> dict[str, str]:
    """Re-run every failed or errored test of ``res`` with the cache off and the same placement on
    the RPC device (``PYBMOE_UPSTREAM_SLOTS=0``), where the engine must compute bit-identical
    output; return ``{nodeid: verdict}``: ``"same without the cache"`` (it fails there too, with the
    same message unless noted: not caused by the cache) or ``"cache only: <status without the cache>"``.
    """
    bad = [o for o in res.outcomes if o.status in ("failed", "error")]
    if not bad:
        return {}
    base = run([nodeid(o) for o in bad], res.work / "baseline", timeout_s,
               extra_env={"PYBMOE_UPSTREAM_SLOTS": "0"})
    by_id = {nodeid(o): o for o in base.outcomes}
    out = {}
    for o in bad:
        b = by_id.get(nodeid(o))
        if b is not None and b.status == o.status:
            out[nodeid(o)] = "same without the cache" + ("" if b.message == o.message else " (other message)")
        else:
            out[nodeid(o)] = f"cache only: {b.status if b else 'not run'} without the cache"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--slots", type=int, default=8, help="expert cache slots per layer; 0: the cache off, same "
                    "placement on the RPC device, the baseline (default %(default)s)")
    ap.add_argument("--baseline", action="store_true", help="re-run the failures without the cache and say "
                    "which fail the same way there")
    a, rest = ap.parse_known_args(argv)
    res = run(rest or None, a.work, a.timeout, extra_env={"PYBMOE_UPSTREAM_SLOTS": str(a.slots)})
    total: dict[str, int] = defaultdict(int)
    print(f"{'file':40s} passed failed error skipped")
    for f, c in res.counts().items():
        print(f"{f:40s} {c.get('passed', 0):6d} {c.get('failed', 0):6d} {c.get('error', 0):5d} {c.get('skipped', 0):7d}")
        for k, v in c.items():
            total[k] += v
    print(f"{'total':40s} {total['passed']:6d} {total['failed']:6d} {total['error']:5d} {total['skipped']:7d}")
    verdicts = compare_with_baseline(res, a.timeout) if a.baseline and a.slots else {}
    for o in res.outcomes:
        if o.status != "passed":
            v = f" [{verdicts[nodeid(o)]}]" if nodeid(o) in verdicts else ""
            print(f"{o.status:7s} {nodeid(o)}: {o.message}{v}")
    with_model = [s for s in res.servers if s.get("model")]
    engaged = sum(1 for s in with_model if s.get("cache_layers"))
    print(f"servers started: {len(res.servers)}, {len(with_model)} with a model, "
          f"of which {engaged} with the expert cache engaged")
    print(f"logs: {res.work}")
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
