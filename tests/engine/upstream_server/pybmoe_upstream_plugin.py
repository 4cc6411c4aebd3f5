"""pytest plugin: run llama.cpp's own server test suite offline, against our llama-server, cache on.

Loaded with ``-p pybmoe_upstream_plugin`` (this directory on ``sys.path``) by ``run.py``, which
runs the suite from a scratch copy of ``tools/server/tests`` of the vendored tree. Nothing of
upstream is edited; the plugin rebinds, at configure time, what the suite's ``utils`` module
exposes:

* every model preset (``ServerPreset.*``) that names a hub model is pointed at a generated tiny
  qwen3moe model (:mod:`pybmoe.models`), or skipped with a reason when no generated model can
  stand in for it (embedding, rerank and vision models, the hub-backed router);
* ``ServerProcess`` starts ``$LLAMA_SERVER_BIN_PATH``, a wrapper script written here that execs
  the patched ``llama-server`` with ``--moe-expert-cache 8`` and the loopback-RPC placement of
  :func:`pybmoe.engine.host_experts_args` appended, so every server runs with the expert cache
  engaged on a stand-in device; a start that would download (``--hf-repo``, ``--model-url``,
  ``--mmproj-url``) is skipped instead;
* ``download_file`` maps the speculative-decoding draft model to a generated model of the same
  vocabulary and skips every other download (LoRA adapters, media);
* ``wget`` is replaced by a module that refuses to download, so nothing reaches the network.

Each server's log goes to a file; ``$PYBMOE_UPSTREAM_REPORT`` (a JSON-lines file) receives one
record per server start: ``{"test": nodeid, "log": path, "model": bool, "cache_layers": "4 of 4" | null}``
(``model`` is false for a router, which loads no model itself).

Environment read here: ``PYBMOE_UPSTREAM_WORK`` (scratch directory for the wrapper, models and
logs; required), ``PYBMOE_UPSTREAM_SLOTS`` (cache slots per layer, default 8; 0 keeps the same
placement on the RPC device with the cache off: the baseline a failure is compared with, since
cache on and off must then compute bit-identical output).
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys
import types
from pathlib import Path

import pytest

from pybmoe import engine, models

#: slots per layer given to every server (the generated model has 16 experts, top-4)
SLOTS = int(os.environ.get("PYBMOE_UPSTREAM_SLOTS", "8"))

#: presets that no generated model can stand in for -> skip reason
SKIPPED_PRESETS = {
    "bert_bge_small": "needs a hub download: ggml-org/models bert-bge-small (an embedding model)",
    "bert_bge_small_with_fa": "needs a hub download: ggml-org/models bert-bge-small (an embedding model)",
    "jina_reranker_tiny": "needs a hub download: jina-reranker-v1-tiny-en (a rerank model)",
    "tinygemma3": "needs a hub download: ggml-org/tinygemma3-GGUF (a vision model with its mmproj)",
}

#: tests that cannot pass against this build, whatever the model -> skip reason
_NO_UI = "pybmoe builds llama-server without the web UI (LLAMA_BUILD_UI=OFF: the build has no network to fetch it)"
_ROUTER_HUB = ("the router is asked for hub models (ggml-org/tinygemma3-GGUF, ...) that are not in the offline "
               "model cache")
SKIPPED_TESTS = {
    "unit/test_basic.py::test_no_ui": _NO_UI,
    "unit/test_security.py::test_access_static_assets_without_api_key": _NO_UI,
    "unit/test_proxy.py::test_mcp_proxy": "needs the internet (proxies a request to http://example.com)",
    **{f"unit/test_router.py::{t}": _ROUTER_HUB for t in (
        "test_router_chat_completion_stream[ggml-org/tinygemma3-GGUF:Q8_0-True]", "test_router_unload_model",
        "test_router_models_max_evicts_lru", "test_router_queue_does_not_evict_busy_model",
        "test_router_queue_coalesces_requests_for_same_model", "test_router_queue_client_disconnect_keeps_model",
        "test_router_queue_is_fifo", "test_router_queue_two_waiters_share_one_eviction",
        "test_router_no_models_autoload", "test_router_api_key_required", "test_router_dedup_cache_models",
        "test_router_download_model")},
    **{f"unit/test_stream.py::{t}": _ROUTER_HUB for t in (
        "test_stream_resume_and_stop_with_slashed_model_name", "test_stream_stop_during_model_load",
        "test_stream_resumes_after_reload_during_model_load")},
}

#: downloads that a generated model replaces: file name -> generator seed (same Qwen2 vocab)
DRAFT_MODELS = {"stories15M-q4_0.gguf": 1}

_CACHE_LINE = re.compile(r"moe-cache: (\d+ of \d+) MoE layers cached")

_state: dict = {"rpc": None, "work": None, "test": None, "starts": 0}


class _NoDownload(types.ModuleType):
    """Stands in for ``wget``: the suite runs offline."""

    def download(self, url, out=None, *a, **kw):  # noqa: D401
        pytest.skip(f"needs a download: {url}", allow_module_level=True)


def _install_wget_stub() -> None:
    sys.modules["wget"] = _NoDownload("wget")


_install_wget_stub()


def _work() -> Path:
    w = os.environ.get("PYBMOE_UPSTREAM_WORK")
    if not w:
        raise pytest.UsageError("PYBMOE_UPSTREAM_WORK is not set (run the suite through tests/engine/upstream_server/run.py)")
    return Path(w)


def _write_wrapper(work: Path, rpc_endpoint: str) -> Path:
    exe = engine.find_binary("llama-server")
    extra = ["--moe-expert-cache", str(SLOTS), *engine.host_experts_args(rpc_endpoint)]
    script = work / "llama-server"
    script.write_text("#!/bin/sh\n# the patched llama-server with the expert cache on a loopback RPC device\n"
                      f"exec '{exe}' \"$@\" {' '.join(extra)}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def _draft_model(seed: int) -> str:
    path = _work() / "models" / f"draft-s{seed}.gguf"
    if not path.is_file():
        models.make_model(path, ftype="Q8_0", seed=seed)
    return str(path)


def _patch_utils(utils) -> None:
    model = str(models.default_model_path("Q8_0"))
    SP, SPr = utils.ServerPreset, utils.ServerProcess

    # a bare ServerProcess() names stories260K from the hub: use ours instead
    SPr.model_hf_repo = None
    SPr.model_hf_file = None
    SPr.model_file = model

    def wrap_preset(name, original):
        if name in SKIPPED_PRESETS:
            def skipped():
                pytest.skip(SKIPPED_PRESETS[name], allow_module_level=True)
            return staticmethod(skipped)

        def ours():
            s = original()
            if s.model_hf_repo or s.model_file:  # the router preset has no model of its own
                s.model_hf_repo = None
                s.model_hf_file = None
                s.model_file = model
            return s
        ours.__name__ = name
        return staticmethod(ours)

    for name, member in list(vars(SP).items()):
        if isinstance(member, staticmethod) and name != "load_all":
            setattr(SP, name, wrap_preset(name, member.__func__))
    SP.load_all = staticmethod(lambda: None)  # nothing to download

    start = SPr.start

    def start_ours(self, *a, **kw):
        for attr in ("model_hf_repo", "model_hf_file", "model_url", "mmproj_url"):
            v = getattr(self, attr, None)
            if v:
                pytest.skip(f"needs a hub download: {attr}={v}")
        if self.log_path is None:
            _state["starts"] += 1
            self.log_path = str(_work() / "logs" / f"server-{_state['starts']:04d}.log")
        try:
            return start(self, *a, **kw)
        finally:
            _record(self.log_path, has_model=bool(self.model_file))

    SPr.start = start_ours

    def download_file(url: str, output_file_path: str | None = None) -> str:
        name = url.rsplit("/", 1)[-1]
        if name in DRAFT_MODELS:
            return _draft_model(DRAFT_MODELS[name])
        pytest.skip(f"needs a download: {url}", allow_module_level=True)

    utils.download_file = download_file


def _record(log_path: str, has_model: bool) -> None:
    _state.setdefault("pending", []).append({"test": _state["test"], "log": log_path, "model": has_model})


def _flush_records() -> None:
    out = os.environ.get("PYBMOE_UPSTREAM_REPORT")
    pending = _state.pop("pending", [])
    if not out:
        return
    with open(out, "a") as f:
        for r in pending:
            try:
                text = Path(r["log"]).read_text(errors="replace")
            except OSError:
                text = ""
            m = _CACHE_LINE.search(text)
            r["cache_layers"] = m.group(1) if m else None
            f.write(json.dumps(r) + "\n")


def pytest_configure(config):
    work = _work()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / "models").mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(config.rootpath))
    import utils  # the suite's own module, the very object its conftest and tests import
    _patch_utils(utils)
    rpc = engine.RpcServer(threads=1, log_dir=work / "logs").start()
    _state["rpc"] = rpc
    os.environ["LLAMA_SERVER_BIN_PATH"] = str(_write_wrapper(work, rpc.endpoint))
    os.environ.setdefault("PORT", str(engine.free_port()))


def pytest_unconfigure(config):
    if _state.get("rpc"):
        _state["rpc"].stop()
        _state["rpc"] = None


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = SKIPPED_TESTS.get(item.nodeid) or SKIPPED_TESTS.get(item.nodeid.split("[", 1)[0])
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _state["test"] = item.nodeid
    yield
    _flush_records()  # after teardown: the suite's autouse fixture has stopped the servers
