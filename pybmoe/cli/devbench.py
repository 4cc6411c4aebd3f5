"""``python -m pybmoe.cli.devbench DIR``: the bandwidth model and plots of a ``tools/device-bench.sh``
output folder (:mod:`pybmoe.bench.devbench`). Not a ``pybmoe`` verb: the script runs it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from ..bench import devbench


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pybmoe.cli.devbench DIR [--stand-in] [--no-plots]``."""
    ap = argparse.ArgumentParser(prog="python -m pybmoe.cli.devbench",
                                 description="Bandwidth model and plots of a tools/device-bench.sh output folder.")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--stand-in", action="store_true", help="device figures are the host's (CPU smoke run)")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    try:
        df = devbench.analyze(a.folder, stand_in=a.stand_in, plots=not a.no_plots)
    except (OSError, ValueError) as e:
        print(f"pybmoe devbench: error: {e}", file=sys.stderr)
        return 2
    print(devbench.format_table(df))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
