"""A fast, stable subset of llama.cpp's own server test suite, run against our llama-server with the
expert cache engaged on a loopback RPC device (see tests/engine/upstream_server/ and docs/server-tests.md)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "upstream_server"))
import run as upstream  # noqa: E402

pytest.importorskip("openai")
pytest.importorskip("requests")
pytest.importorskip("filelock")

#: files of the suite that pass against the generated model (about a minute on 2 cores); the plugin
#: skips, with their reasons, the tests that need a hub model, the internet or the web UI
SUBSET = [
    "unit/test_basic.py",
    "unit/test_tokenize.py",
    "unit/test_ignore_eos.py",
    "unit/test_kv_keep_only_active.py",
    "unit/test_compat_gcp.py",
    "unit/test_metrics.py",
]

#: tests of those files that expect the output of upstream's stories260K model (its BOS id, its
#: words); they fail the same way with the cache off (docs/server-tests.md)
DESELECT = [
    "unit/test_tokenize.py::test_tokenize_with_bos",
]


@pytest.fixture(scope="module")
def suite_dir() -> Path:
    try:
        return upstream.upstream_tests_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_upstream_server_subset_passes_with_the_cache(suite_dir, tmp_path):
    args = [*SUBSET, *(a for d in DESELECT for a in ("--deselect", d))]
    res = upstream.run(args, tmp_path, timeout_s=600)
    log = (res.work / "pytest.log").read_text(errors="replace")
    counts = res.counts()
    bad = [f"{upstream.nodeid(o)}: {o.message}" for o in res.outcomes if o.status in ("failed", "error")]
    assert res.returncode == 0 and not bad, "\n".join(bad) + "\n" + log[-4000:]
    assert sorted(counts) == sorted(SUBSET), counts
    passed = sum(c.get("passed", 0) for c in counts.values())
    assert passed >= 20, counts
    # every server that loaded a model (a router loads none) ran with the cache on all 4 MoE layers
    with_model = [s for s in res.servers if s["model"]]
    assert len(with_model) >= 15, res.servers
    assert all(s["cache_layers"] == "4 of 4" for s in with_model), with_model
