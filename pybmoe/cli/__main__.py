"""``python -m pybmoe.cli ARGS``: the same as the ``pybmoe`` console script."""
import sys

from . import main

sys.exit(main())
