"""Shared fixtures: the patched binaries, a loopback RPC device and the tiny models.

No test touches the network: models come from pybmoe.models (vocab from the pinned tree).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from pybmoe import engine, models
from pybmoe.build import vendor
from pybmoe.routing import trace
from pybmoe.routing.granite import GRANITE_TRACE

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- progress by test file
# At pytest's default verbosity each test file is one line ("tests/engine/test_serve.py ....  [ 40%]");
# this adds the seconds the file took before its percentage, so a 10-minute run says where the time
# goes (tools/test.sh; `-q` or `-v` turn it off).

class _FileTimes:
    def __init__(self, config):
        self.config = config
        self.current: str | None = None
        self.t0 = 0.0
        self.done = 0
        self.total = -1

    def pytest_collection_finish(self, session):
        self.total = len(session.items)

    def _reporter(self):
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        return tr if tr is not None and tr.verbosity == 0 and getattr(tr, "showfspath", True) else None

    def _close_line(self, tr) -> None:
        if self.current is not None:
            tr.write(f" {time.monotonic() - self.t0:.0f} s")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid, location):
        tr = self._reporter()
        path = nodeid.split("::")[0]
        if tr is None or path == self.current:
            return
        self._close_line(tr)
        self.current, self.t0 = path, time.monotonic()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logfinish(self, nodeid, location):
        tr = self._reporter()
        self.done += 1
        if tr is not None and self.done == self.total:
            self._close_line(tr)  # the last file: before pytest writes [100%]
            self.current = None


def pytest_configure(config):
    config.pluginmanager.register(_FileTimes(config), "pybmoe-file-times")


# --------------------------------------------------------------------------- the slow marker
# Tests of 3 s or more (all parametrizations together; measured on the 2-core project machine,
# 2026-12-02, docs/build.md), marked `slow` here in one table rather than in each file, so that
# `tools/test.sh -m "not slow"` (its times: docs/build.md) leaves them out; CI runs everything. A new test that
# takes seconds joins this table; tests/test_readme.py checks that every name here exists.
SLOW: dict[str, str | set[str]] = {
    "tests/bench/test_bench.py": {  # the two module fixtures' sweeps: 8 s each, paid by the first test using one
        "test_default_against_sync_in_one_sweep",  # 14 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_max_batch_puts_prefill_through_the_cache",  # 13 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_floor_marks_overflow",  # 12 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_server_sweep_rows_and_cache",  # 7 s
        "test_server_sweep_summary_per_spec",
        "test_sweep_writes_tidy_csv",  # 8 s
        "test_sweep_cache_columns",
        "test_sweep_summary_and_plots",
    },
    "tests/bench/test_disk_probe.py": {  # 17 s per case beside a build (gguf's reader parses the real vocab)
        "test_the_probe_reads_distinct_expert_windows_of_the_file",
        "test_the_steps_probe_reads_top_k_experts_of_one_layer_per_step",  # 20 s beside other work, 2026-12-06
        "test_the_record_probe_reads_the_same_experts_in_fewer_reads",  # 27 s beside other work, 2026-12-06
    },
    "tests/bench/test_bench_stream.py": {  # one module fixture runs the benchmark: 17 s
        "test_every_point_and_mode_ran_and_was_written",
        "test_the_stream_points_carry_the_tiers_figures_and_mmap_none",
        "test_the_summary_gives_ratios_over_mmap",
        "test_the_limit_held_or_the_reason_is_given",
        "test_each_repeat_probes_the_disk_and_every_point_gets_its_limit",  # ran the fixture in the fast subset
    },
    "tests/bench/test_device_bench.py": {
        "test_cpu_smoke_end_to_end",  # 9 s
    },
    "tests/build/test_patches.py": {
        "test_check_exits_zero_with_every_patch_clean",  # 7 s
        "test_check_names_a_failing_patch_and_exits_nonzero",  # 10 s
        "test_rebase_conflict_stops_in_am_state_and_continues",  # 33 s
        "test_rebase_onto_the_pinned_version_is_all_clean",  # 31 s
    },
    "tests/build/test_vendor.py": {
        "test_dirty_tree_is_not_discarded",  # 5 s
        "test_failing_patch_is_named",  # 9 s
        "test_series_applies_and_export_is_a_noop",  # 6 s
    },
    "tests/engine/test_arch_identity.py": {
        "test_draft_mtp_speculation_shares_the_cache",  # 7 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_the_device_chain_adds_its_biases_on_the_device",  # 6 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_every_variant_is_bit_identical",  # 123 s
        "test_every_variant_speculates_through_the_cache",  # 11 s
    },
    "tests/engine/test_bindings_life.py": {
        "test_the_stats_carry_the_summary_lines_fields",  # 12 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_the_rpc_servers_memory_comes_back_after_del",  # 11 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_a_lost_rpc_server_never_hangs",  # 15 cases, 2-4 s each
        "test_llama_server_shows_the_inert_line_at_its_default_verbosity",  # 3 s
        "test_verbose_false_prints_nothing",  # 3 s
    },
    "tests/engine/test_cache_identity.py": {
        "test_logits_bit_identical",  # 19 s
        "test_logits_bit_identical_other_types",  # 12 s
        "test_server_text_byte_identical",  # 50 s
    },
    "tests/engine/test_cache_metrics.py": {
        "test_auto_resolving_to_zero_warns_and_is_off",  # 4 s
        "test_auto_sizes_from_the_device_and_its_ceiling",  # 4 s
        "test_cliff_warning_below_the_cycle_only",  # 14 s
        "test_preamble_and_summary_make_one_record",  # 4 s
        "test_resize_during_a_decode_is_refused",  # 4 s
        "test_runtime_shrink_is_byte_safe",  # 14 s
        "test_slots_above_n_expert_are_clamped_with_one_line",  # 4 s
    },
    "tests/engine/test_cache_sizing.py": {
        "test_auto_counts_a_draft_model",  # 5 s
        "test_a_cache_that_never_serves_warns_per_layer",  # 4 s
        "test_auto_counts_an_mtp_draft_context",  # 3 s
        "test_a_dense_model_is_inert_with_one_warn_line",  # 3 s
        "test_auto_sets_aside_the_contexts_memory",  # 6 s
        "test_experts_in_a_cpu_buffer_without_mmap_do_not_warn",  # 4 s
        "test_fit_counts_fixed_slots",  # 4 s
        "test_fit_with_auto_gives_the_cache_what_is_left",  # 4 s
        "test_router_in_host_memory_warns_why",  # 4 s
        "test_two_devices_each_sized_and_exact",  # 6 s
    },
    "tests/engine/test_engine_replay.py": {
        "test_replay_matches_engine_with_second_miss_admission",  # 4 s a case
        "test_demo_replays_granite_routing",  # 4 s
        "test_replay_matches_engine_event_for_event",  # 51 s
        "test_replay_matches_engine_on_real_routing",  # 5 s
    },
    "tests/engine/test_cache_async.py": {
        "test_both_modes_are_bit_identical_to_cache_off",  # 4-5 s a case, 9 cases
    },
    "tests/engine/test_route_replay_files.py": "*",  # 21 engine runs on mangled traces, 0.6 s each
    "tests/engine/test_load.py": {
        "test_under_load_every_answer_is_right_and_counted",  # about 70 s a configuration
    },
    "tests/engine/test_reliability.py": "*",  # 6 scenarios x 2 tiers and the device kills: about 4 min
    "tests/engine/test_route_replay.py": {
        "test_a_foreign_trace_changes_the_routing_to_exactly_it",  # 3 s
        "test_replaying_the_models_own_trace_reproduces_it",  # 3 s
    },
    "tests/engine/test_cache_pool.py": {
        "test_the_pool_is_bit_identical_at_every_small_ubatch",  # 38 s (2 idle cores, 2026-12-06)
        "test_draft_mtp_speculation_through_the_pool",  # 5 s
        "test_each_devices_pool_is_in_the_stats_and_on_metrics",  # 3 s
        "test_a_bank_of_more_than_1024_slots_is_exact",  # 8 s
    },
    "tests/engine/test_small_batches.py": {
        "test_draft_model_speculation_is_unchanged_and_says_the_draft_has_no_cache",  # 5 s
        "test_speculative_ngram_greedy_output_is_unchanged",  # 4 s
        "test_ubatches_bit_identical",  # 28 s
    },
    "tests/engine/test_stream_frames.py": {
        "test_page_frames_change_no_hit_and_no_logit",  # 13 s a case beside other work, 2026-12-06
    },
    "tests/engine/test_stream_identity.py": {
        "test_reads_go_behind_compute_by_default_when_the_threads_leave_a_cpu",  # 7 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_a_split_gguf_is_streamed_in_place",  # 14 s each
        "test_streamed_logits_equal_all_resident",  # 24 s
        "test_the_dense_policies_change_no_logit",  # 4 s
        "test_the_engines_stream_hits_equal_the_simulators_policy",  # 16 s for the 12 cases
        "test_reads_behind_compute_change_no_logit_and_no_hit",  # 3 archs x 2 ubatches, 3 runs each
        "test_a_gguf_truncated_after_load_stops_with_the_file_and_the_offset",  # 2 s each
        "test_a_budget_under_one_layer_step_reads_the_rest_in_waves_bit_identical",  # 3 archs x 2 ub x 2, 2 runs each
        "test_the_engines_hits_equal_the_simulators_with_waves",  # 4 runs
    },
    "tests/engine/test_upstream_server.py": "*",  # 37 s
    "tests/engine/test_stream_fit.py": "*",  # 12 engine runs on fake /proc trees: about 30 s
    "tests/engine/test_stream_elastic.py": {  # 5 s, 2 x 30 s (three 470-token runs each), a server's three requests
        "test_a_context_commits_its_kv_cache_as_it_fills_and_a_removed_sequence_gives_it_back",
        "test_a_context_filled_to_92_percent_is_exact",
        "test_the_budget_yields_to_another_process_and_grows_back",
        "test_a_default_context_keeps_its_full_size_where_it_fits_beside_the_minimum",
    },
    "tests/engine/test_serve_limit.py": {  # servers under a real limit, a reference server
        "test_the_server_fits_a_default_context_under_a_real_limit_and_answers",  # 6 s
        "test_an_oom_kill_of_the_server_is_named_in_one_line",  # 3 s
        "test_a_model_file_that_shrinks_under_the_server_is_named",  # 3 s
        "test_a_model_file_cut_under_the_tier_stops_the_server_in_one_line",  # 4 s
    },
    "tests/engine/test_stream_elastic_cgroup.py": "*",  # a 8192-token fill in a cgroup twice (25 s), a server with a second process (40 s)
    "tests/bench/test_bench_server.py": "*",  # one module fixture runs the benchmark with its server: 30 s
    "tests/engine/test_vulkan.py": "*",  # 4-12 s a test where a Vulkan build exists (CI builds one)
    "tests/models/test_arch_deepseek2.py": {
        "test_generates_and_the_bias_routes",  # 12 s
    },
    "tests/models/test_arch_gemma4.py": {
        "test_generates_and_applies_the_down_scales",  # 4 s
    },
    "tests/models/test_arch_gpt_oss.py": {
        "test_generates_and_applies_the_expert_biases",  # 4 s
    },
    "tests/models/test_models.py": {  # the module fixture writes the three default models: 8 s
        "test_deterministic",  # 4 s
        "test_tensors_and_hparams",
        "test_tokenizer_copied_verbatim",
        "test_weights_are_sane_and_routing_not_degenerate",
    },
    "tests/routing/test_trace_names.py": {
        "test_the_docs_first_commands_run_as_written_from_any_directory",  # 4 s
    },
    "tests/routing/test_synth.py": {
        "test_map_keeps_the_curve_at_the_same_fraction_of_experts",  # 3 s
    },
    "tests/engine/test_stream_defaults.py": {
        "test_dense_auto_picks_anon_only_for_a_fixed_budget_when_the_gguf_does_not_fit_and_stays_exact",  # 7 s
        "test_the_load_reads_only_the_dense_weights",  # 14 s
        "test_prefetch_changes_no_logit_and_its_window_is_lent_to_decode",  # 4 s
    },
    "tests/test_cli.py": {
        "test_serve_runs_llama_server_inside_the_memory_limit",  # 4 s
    },
    "tests/test_docs_commands.py": {
        "test_each_big_docs_command_writes_its_model_as_written",  # GiB-sized models and the 4 GiB probe: 5-60 s each
    },
    "tests/test_readme.py": {
        "test_the_readme_demo_sample_is_what_the_demo_prints",  # 13 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_the_readme_demo_sample_has_the_disk_tier_part",  # 10 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_the_test_commands_show_progress_by_file_and_have_a_fast_subset",  # 8 s
        "test_the_loopback_flow_runs_as_pasted",  # 10 s
        "test_pybmoe_demo_prints_the_readme_samples_lines",  # 40 s
    },
    "tests/engine/test_serve.py": {
        "test_serve_answers_openai_chat_with_the_cache",  # 5 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
        "test_demo_reports_identical_output",  # 14 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
    },
    "tests/engine/test_bindings.py": {
        "test_a_llama_offloads_to_its_own_rpc_server_only",  # 12 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
    },
    "tests/engine/test_cache_startup.py": {
        "test_a_failed_start_frees_the_slots_it_allocated",  # 6 s (a cold fast-subset run on 2 idle cores, 2026-12-06)
    },
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        try:
            rel = path.relative_to(ROOT).as_posix()
        except ValueError:
            continue
        names = SLOW.get(rel)
        if names == "*" or (names and getattr(item, "originalname", item.name) in names):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def granite_raw() -> dict:
    """The granite-3.0-1b-a400m routing trace as its raw JSON (24 layers, 32 experts, top-8; the copy
    bundled in pybmoe/data/, the published bytes: tests/routing/test_trace.py)."""
    return json.loads(GRANITE_TRACE.read_text())


@pytest.fixture(scope="session")
def granite() -> trace.Trace:
    """The same trace read by pybmoe.routing.trace."""
    return trace.read_trace(GRANITE_TRACE)


@pytest.fixture(scope="session")
def model_q8() -> Path:
    """The embedded default model (qwen3moe, 4 layers, 16 experts, top-4, Q8_0)."""
    return models.default_model_path("Q8_0")


@pytest.fixture(scope="session")
def model_f16() -> Path:
    return models.default_model_path("F16")


@pytest.fixture(scope="session")
def model_q4k() -> Path:
    return models.default_model_path("Q4_K")


_RPC: list[engine.RpcServer] = []  # the session's loopback device, once started


@pytest.fixture(scope="session")
def rpc():
    """A loopback ggml-rpc-server, the stand-in device, for the whole session."""
    with engine.RpcServer(threads=1) as r:
        _RPC.append(r)
        yield r
        _RPC.clear()


def pytest_runtest_setup(item):
    """A test whose engine crashed the session's RPC server (`Remote RPC server crashed`) fails; the
    tests after it get the server back, on the same port, instead of failing to connect one by one."""
    if _RPC and "rpc" in getattr(item, "fixturenames", ()) and _RPC[0].proc and _RPC[0].proc.poll() is not None:
        dead = _RPC[0]
        print(f"\nconftest: the session's ggml-rpc-server exited ({dead.proc.returncode}); restarting it on "
              f"{dead.endpoint}")
        dead.start()


@pytest.fixture(scope="session")
def pin():
    """The pinned upstream (vendor/upstream.toml)."""
    return vendor.load_pin(ROOT)


@pytest.fixture(scope="session")
def sdist(pin):
    """The pinned sdist, fetched once into the pybmoe cache."""
    return vendor.fetch_sdist(pin, vendor.cache_dir())


def write_files(d: Path, files: dict[str, str]) -> None:
    """Write ``{relative path: text}`` under the folder ``d`` (folders made as needed)."""
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)


def tar_folder(out: Path, d: Path, arcname: str) -> Path:
    """``out``: a .tar.gz of the folder ``d``, stored as ``arcname``."""
    import tarfile
    with tarfile.open(out, "w:gz") as tf:
        tf.add(d, arcname=arcname)
    return out


@pytest.fixture(scope="session")
def engine_sdist(pin):
    """The pinned engine sdist ([engine] of vendor/upstream.toml), fetched once; None without one."""
    return vendor.fetch_engine(pin.engine, vendor.cache_dir()) if pin.engine else None


@pytest.fixture
def fake_root(tmp_path):
    """A factory of project roots under tmp_path with our pin and patch series (so vendored and
    rebase trees land there); ``extra_patch`` appends a patch named 9999-bogus.patch to the series."""
    def make(extra_patch: str | None = None) -> Path:
        root = tmp_path / "proj"
        (root / "vendor").mkdir(parents=True)
        shutil.copy(ROOT / "vendor" / "upstream.toml", root / "vendor")
        shutil.copytree(ROOT / "patches", root / "patches")
        if extra_patch:
            (root / "patches" / "9999-bogus.patch").write_text(extra_patch)
            with open(root / "patches" / "series", "a") as f:
                f.write("9999-bogus.patch\n")
        return root
    return make



# --------------------------------------------------------------------------- a fake /proc and cgroup tree
# The engine reads the memory it may use under $PYBMOE_MEM_ROOT when set (ggml-ext/llama-moe-memory.h):
# the disk tier's sizing and the contexts' fit are tested on such trees, with no root and no real limit.
MIB = 2**20


def write_meminfo(root: Path, avail_mib: float, total_mib: float = 32768) -> None:
    """(Re)writes a fake tree's proc/meminfo: MemTotal, and MemFree = MemAvailable = avail_mib (MiB). A run
    reading the tree sees the new figures at its next read (another process took or gave back memory)."""
    (root / "proc" / "meminfo").write_text(f"MemTotal:       {int(total_mib * 1024)} kB\n"
                                           f"MemFree:        {int(avail_mib * 1024)} kB\n"
                                           f"MemAvailable:   {int(avail_mib * 1024)} kB\n")


def _mem_root(tmp: Path, *, avail_mib: float, total_mib: float = 32768, cgroup: str | None = None,
              limit_mib: float = 0, usage_mib: float = 0, cache_mib: float = 0) -> Path:
    """A folder with proc/meminfo, proc/self/cgroup and (v1 or v2) the cgroup's files, for
    ``PYBMOE_MEM_ROOT`` (sizes in MiB)."""
    root = tmp / f"root-{cgroup}-{avail_mib}-{limit_mib}"
    (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    write_meminfo(root, avail_mib, total_mib)
    if cgroup == "v1":
        (root / "proc" / "self" / "cgroup").write_text("12:cpu,cpuacct:/\n5:memory:/box\n0::/\n")
        d = root / "sys" / "fs" / "cgroup" / "memory" / "box"
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(f"{int(limit_mib * MIB)}\n")
        (d / "memory.usage_in_bytes").write_text(f"{int(usage_mib * MIB)}\n")
        (d / "memory.stat").write_text(f"cache 0\nrss 0\ntotal_cache {int(cache_mib * MIB)}\ntotal_rss 0\n")
    elif cgroup == "v2":
        (root / "proc" / "self" / "cgroup").write_text("0::/box\n")
        d = root / "sys" / "fs" / "cgroup" / "box"
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(f"{int(limit_mib * MIB)}\n")
        (d / "memory.current").write_text(f"{int(usage_mib * MIB)}\n")
        (d / "memory.stat").write_text(f"anon 0\nfile {int(cache_mib * MIB)}\n")
    else:
        (root / "proc" / "self" / "cgroup").write_text("0::/\n")
    return root


@pytest.fixture
def mem_root():
    """``mem_root(tmp, avail_mib=, total_mib=32768, cgroup=None|"v1"|"v2", limit_mib=, usage_mib=,
    cache_mib=)``: a fake tree for ``PYBMOE_MEM_ROOT`` (its path)."""
    return _mem_root
