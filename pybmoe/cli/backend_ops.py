"""``pybmoe backend-ops``: test-backend-ops' duplicate-expert-id MUL_MAT_ID cases, per backend
(:mod:`pybmoe.engine.backend_ops`)."""
from __future__ import annotations

import argparse
import subprocess
import sys

from .. import engine
from ..engine import backend_ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pybmoe backend-ops", description=backend_ops.__doc__.splitlines()[0])
    ap.add_argument("-b", "--backend", action="append",
                    help="a backend name, as test-backend-ops lists it (repeatable; default: CPU and all others)")
    a = ap.parse_args(argv)
    try:
        results, text, rc = backend_ops.run(a.backend)
    except (engine.EngineError, backend_ops.UnknownBackendError, subprocess.TimeoutExpired) as e:
        print(f"pybmoe backend-ops: error: {e}", file=sys.stderr)
        return 2
    if not results:
        print(text[-3000:], file=sys.stderr)
        print("pybmoe backend-ops: error: no duplicate-id case ran (is test-backend-ops from the patched tree?)",
              file=sys.stderr)
        return 2
    print(backend_ops.table(results))
    n_fail = sum(r.result == "FAIL" for r in results)
    print(f"{len(results)} cases on {len({r.backend for r in results})} backend(s): "
          f"{sum(r.result == 'OK' for r in results)} passed, {n_fail} failed, "
          f"{sum(r.result == 'not supported' for r in results)} not supported")
    if n_fail:
        return 1
    return 0 if rc == 0 else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
