"""``pybmoe backend-ops``: the duplicate-expert-id MUL_MAT_ID cases of ``test-backend-ops``, per backend.

An expert cache maps every miss of a token to one dummy slot, so a token's expert ids repeat. The
patch series adds 96 ``MUL_MAT_ID`` cases with duplicate ids to ``test-backend-ops`` (ids drawn with
replacement, ``dup=replace``, or one repeated pair per row, ``dup=pair``; f16, bf16, q8_0, q4_0,
q4_K, q6_K; 1..256 tokens). ``test-backend-ops`` compares each backend with the CPU. This command
runs those cases on every backend of the build (the CPU itself with ``-b CPU``, which checks that
the cases build and run there; the CPU's repacked kernel is checked against the generic one by
``pybmoe-test-skip``), prints one table per backend (passed / failed / not supported, per weight
type) and exits 1 on any failure, 2 when ``test-backend-ops`` itself fails.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from .. import engine

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BACKEND = re.compile(r"^Backend \d+/\d+: (\S+)")
# a failed case is printed after its error on the same line: "[MUL_MAT_ID] ERR = ... MUL_MAT_ID(...): FAIL"
_CASE = re.compile(r"(?:^|\s)MUL_MAT_ID\((?P<params>[^)]*)\): (?P<result>OK|FAIL|not supported)")


@dataclass(frozen=True)
class CaseResult:
    """One test-backend-ops case: backend name, weight type, tokens, duplicate mode, result."""

    backend: str
    type_a: str
    n: int          # tokens
    dup: str        # "replace" or "pair"
    result: str     # "OK", "FAIL" or "not supported"


def parse(output: str) -> list[CaseResult]:
    """The duplicate-id cases in ``test-backend-ops`` console output (ANSI colours allowed)."""
    out: list[CaseResult] = []
    backend = "?"
    for raw in output.splitlines():
        line = _ANSI.sub("", raw)
        m = _BACKEND.match(line)
        if m:
            backend = m.group(1)
            continue
        m = _CASE.search(line)
        if not m:
            continue
        params = dict(kv.split("=", 1) for kv in m.group("params").split(",") if "=" in kv)
        if "dup" not in params:
            continue
        out.append(CaseResult(backend, params["type_a"], int(params["n"]), params["dup"], m.group("result")))
    return out


def table(results: list[CaseResult]) -> str:
    """One block per backend: per weight type, cases passed / failed / not supported."""
    lines: list[str] = []
    for backend in dict.fromkeys(r.backend for r in results):
        rows = [r for r in results if r.backend == backend]
        lines.append(f"backend {backend}")
        lines.append(f"  {'type':<6} {'passed':>6} {'failed':>6} {'unsupp.':>7}  failed cases (n, dup)")
        for t in dict.fromkeys(r.type_a for r in rows):
            rs = [r for r in rows if r.type_a == t]
            fails = [f"{r.n}/{r.dup}" for r in rs if r.result == "FAIL"]
            lines.append(f"  {t:<6} {sum(r.result == 'OK' for r in rs):>6} {len(fails):>6} "
                         f"{sum(r.result == 'not supported' for r in rs):>7}  {' '.join(fails)}")
    return "\n".join(lines)


class UnknownBackendError(ValueError):
    """A ``-b`` name that is none of the build's backends (``test-backend-ops`` skips every one of
    them and runs nothing); the message names it and the accepted names."""


def devices(output: str) -> list[str]:
    """The backends (devices) ``test-backend-ops`` lists in its output, in its order (``Backend i/N: NAME``)."""
    return [m.group(1) for m in (_BACKEND.match(_ANSI.sub("", ln)) for ln in output.splitlines()) if m]


def run(backends: list[str] | None = None, timeout: float = 1800) -> tuple[list[CaseResult], str, int]:
    """Run the cases; ``backends`` names ``-b`` filters (default: ``CPU``, then every other backend).

    Returns ``(results, output, worst exit status of test-backend-ops)``.
    Raises :class:`engine.EngineError` when ``test-backend-ops`` is not built, and
    :class:`UnknownBackendError` for a name that is none of the build's backends.
    """
    exe = str(engine.find_binary("test-backend-ops"))
    runs = [["-b", b] for b in backends] if backends else [["-b", "CPU"], []]  # [] = all non-CPU backends
    results: list[CaseResult] = []
    text, worst = "", 0
    for extra in runs:
        r = subprocess.run([exe, "-o", "MUL_MAT_ID", "-p", "dup=", *extra], capture_output=True, text=True,
                           timeout=timeout)
        names = devices(r.stdout)
        if extra and names and extra[1] not in names:
            raise UnknownBackendError(f"-b {extra[1]}: this build has no such backend; accepted: {', '.join(names)} "
                                      "(names are case-sensitive)")
        text += r.stdout + r.stderr
        results += parse(r.stdout)
        worst = max(worst, r.returncode)
    return results, text, worst
