#!/usr/bin/env bash
# pybmoe test command (the README's second command; CI runs it through .ci/run).
# Creates .venv if needed, builds and installs pybmoe with its test extras, runs pytest; arguments go to
# pytest (tools/test.sh -m "not slow": the fast subset).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
mkdir -p build
# compile commands name the checkout's absolute paths; relative to it, a fresh clone elsewhere hits
# the same ccache entries (docs/build.md)
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
t0=$(date +%s)
if ! python -m pip install -v '.[test]' > build/pip-install.log 2>&1; then
    tail -n 150 build/pip-install.log
    echo "pybmoe: pip install failed (full log: build/pip-install.log)" >&2
    exit 1
fi
grep -E "^-- pybmoe|pybmoe vendor|ccache found|Successfully installed" build/pip-install.log || true
echo "pybmoe: pip install took $(( $(date +%s) - t0 )) s"
python -c "import pybmoe.engine as e; [e.find_binary(n) for n in e.BINARIES]; import llama_cpp; print('pybmoe installed; llama_cpp', llama_cpp.__version__)"
# one line per test file with its seconds (tests/conftest.py); the whole suite takes about 27 minutes on
# 2 cores, `tools/test.sh -m "not slow"` about 3 (docs/build.md)
echo "pybmoe: running the tests${*:+ ($*)}"
exec python -m pytest -ra --durations=10 "$@" tests
