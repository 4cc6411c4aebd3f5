"""Where the patched llama.cpp binaries are: :data:`BINARIES`, :func:`find_binary`, :class:`EngineError`.

Binaries are looked up, in order, in:

1. ``$PYBMOE_BIN_DIR``;
2. ``pybmoe/bin/`` of the package this module belongs to (what ``pip install .`` ships);
3. ``pybmoe/bin/`` in the environment's site-packages (when this module is imported from a
   source checkout but pybmoe is installed);
4. ``build/dev/bin/`` of the source checkout (a developer build made with cmake): the checkout
   :func:`pybmoe.build.vendor.project_root` finds (working directory first), else the one this
   package sits in.

Holds no process lifecycle (:mod:`.servers`) and no log parsing (:mod:`.cachelog`).
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from ..build import vendor

#: Every binary ``pip install .`` ships in ``pybmoe/bin/``: the upstream tools, pybmoe's own tools (the logits
#: oracle, the big-model writer, the bandwidth probe) and the two engine test programs.
BINARIES = ("llama-server", "llama-cli", "llama-bench", "test-backend-ops", "ggml-rpc-server", "pybmoe-logits",
            "pybmoe-make-synth", "pybmoe-bw", "pybmoe-test-skip", "pybmoe-test-residency")

#: What each of :data:`BINARIES` is, one line each (``pybmoe bin --help``).
BINARY_DOCS = {
    "llama-server": "the OpenAI-compatible HTTP server, with the expert cache and the disk tier (pybmoe serve)",
    "llama-cli": "the interactive command-line client, with the same flags",
    "llama-bench": "the benchmark (pp/tg tok/s), with the cache, insert cap, sync and route replay flags",
    "test-backend-ops": "upstream's per-backend op tests (pybmoe backend-ops runs its MUL_MAT_ID cases)",
    "ggml-rpc-server": "the RPC device server (the loopback device of the demo and of the tests)",
    "pybmoe-logits": "the logits oracle: greedy tokens and every logit to a file (identity checks)",
    "pybmoe-make-synth": "the fast writer of big synthetic qwen3moe GGUFs (every core, streamed to the file)",
    "pybmoe-bw": "the bandwidth probe: host RAM, host-to-device and device-to-device GB/s",
    "pybmoe-test-skip": "a test program of the test suite: the MUL_MAT_ID skip table on the CPU",
    "pybmoe-test-residency": "a test program of the test suite: the expert residency over a trace, against the simulator",
}
#: The test programs among :data:`BINARIES` (listed by ``pybmoe bin`` too, since the test suite finds
#: them there; ``pybmoe bin --help`` says what they are).
TEST_BINARIES = ("pybmoe-test-skip", "pybmoe-test-residency")

#: The ``pybmoe`` package folder (``pybmoe/engine/..``).
PACKAGE_DIR = Path(__file__).resolve().parent.parent


class EngineError(RuntimeError):
    """A binary is missing, failed to start, or exited with an error."""


def bin_dirs() -> list[Path]:
    """Where binaries are searched, in order."""
    dirs = []
    if os.environ.get("PYBMOE_BIN_DIR"):
        dirs.append(Path(os.environ["PYBMOE_BIN_DIR"]))
    dirs.append(PACKAGE_DIR / "bin")
    site = Path(sysconfig.get_paths()["platlib"]) / "pybmoe" / "bin"
    if site not in dirs:
        dirs.append(site)
    roots = []
    try:
        roots.append(vendor.project_root())
    except vendor.VendorError:
        pass
    roots.append(PACKAGE_DIR.parent)
    for root in roots:
        dev = root / "build" / "dev" / "bin"
        if dev not in dirs:
            dirs.append(dev)
    return dirs


def find_binary(name: str) -> Path:
    """Path of the patched binary ``name`` (one of :data:`BINARIES`).

    Raises:
        EngineError: no such binary in any of :func:`bin_dirs`.
    """
    for d in bin_dirs():
        p = d / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise EngineError(f"{name} not found in {', '.join(map(str, bin_dirs()))}; "
                      "install pybmoe with `pip install .` (or build it with cmake into build/dev)")
