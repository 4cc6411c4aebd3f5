"""ctypes bindings for pybmoe's C API, and :class:`Llama`, ``llama_cpp.Llama`` with expert placement
and the expert cache.

The C functions live in the patched ``libllama`` that ``llama_cpp`` loads (declared in
``ggml-ext/llama-moe.h``, the engine's exported C API: the public param structs, and so the
``llama_cpp`` ABI, are unchanged). ``tests/engine/test_bindings.py`` checks the ctypes layout of
:class:`MoeCacheStatsC` against the C compiler's ``sizeof``/``offsetof``.

Example (experts in host memory, every layer on a device, 8 cache slots per layer)::

    llm = pybmoe.Llama(model_path="model.gguf", n_gpu_layers=99, cpu_moe=True,
                       moe_expert_cache=8, rpc_servers="127.0.0.1:50052")
    llm("Hello", max_tokens=32, temperature=0)
    llm.moe_cache_stats().hits
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import difflib
import inspect
import itertools
import logging
import os
import re
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .flags import parse_admit
from .servers import wait_for_endpoint

# llama-moe.h's constants, each under its name there (tests/build/test_abi.py holds every LLAMA_MOE_* name
# of the package to the header's value)
LLAMA_MOE_CACHE_AUTO = -1                  # n_slots: size each device from its free memory
LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT = 1024   # MiB the cache leaves free on each device
LLAMA_MOE_CACHE_ERR_NO_ROOM = -3           # init: fixed slots do not fit a device (a load error)
LLAMA_MOE_STREAM_AUTO = -1                 # budget_mib: size from available memory
LLAMA_MOE_STREAM_FLOOR_AUTO = -1           # floor_mib: 1/16 of the memory limit, 64 .. 1536 MiB
LLAMA_MOE_STREAM_IO_THREADS_DEFAULT = 4    # read lanes
LLAMA_MOE_STREAM_ERR_BUDGET = -3           # init: a budget under the mechanical minimum (a load error)
LLAMA_MOE_DENSE_MMAP = 0                   # the dense weights stay memory-mapped (stock)
LLAMA_MOE_DENSE_WARM = 1                   # one sequential buffered read at load
LLAMA_MOE_DENSE_ANON = 2                   # read into anonymous memory
LLAMA_MOE_DENSE_AUTO = 3                   # anon or mmap, picked at load
LLAMA_MOE_ERR = -1                         # refused or failed; the log line before says why
LLAMA_MOE_ERR_BUSY = -2                    # a setter called while a graph is computed (during a generation)
LLAMA_MOE_STREAM_IO_THREADS_MAX = 64       # the most read lanes the stream tier takes
# llama_model_moe_apply's results (enum llama_moe_apply_status), those the bindings tell apart
LLAMA_MOE_APPLY_OK = 0
LLAMA_MOE_APPLY_ERR_CACHE_NO_ROOM = -3      # fixed slots do not fit a device
LLAMA_MOE_APPLY_ERR_CACHE_OFF = -4          # strict: the cache asked for did not engage
LLAMA_MOE_APPLY_ERR_CACHE_ADMIT = -5        # the admission window was refused
LLAMA_MOE_APPLY_ERR_CACHE_UPLOAD = -6       # the upload budget is under one expert
LLAMA_MOE_APPLY_ERR_STREAM_BUDGET = -7      # the budget cannot hold one layer step
LLAMA_MOE_APPLY_ERR_STREAM_OFF = -8         # strict: the stream tier asked for did not engage
LLAMA_MOE_APPLY_ERR_DENSE = -10             # the dense weights' policy could not be applied
LLAMA_MOE_APPLY_ERR_TRACE = -11             # the routing trace cannot be written
LLAMA_MOE_APPLY_ERR_REPLAY = -12            # the routing trace to replay was refused
#: ``dense_weights=`` values and their llama-moe.h modes (``--dense-weights``)
DENSE_POLICIES = {"mmap": LLAMA_MOE_DENSE_MMAP, "warm": LLAMA_MOE_DENSE_WARM, "anon": LLAMA_MOE_DENSE_ANON,
                  "auto": LLAMA_MOE_DENSE_AUTO}
EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # upstream's LLM_FFN_EXPS_REGEX (--cpu-moe)
# ggml-backend.h's enum ggml_backend_dev_type (tests/build/test_abi.py holds them to the built tree's header)
GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1
GGML_BACKEND_DEVICE_TYPE_IGPU = 2


class MoeCacheStatsC(ctypes.Structure):
    """Mirror of ``struct llama_moe_cache_stats`` (ggml-ext/llama-moe.h)."""

    _fields_ = [
        ("hits", ctypes.c_uint64),
        ("misses", ctypes.c_uint64),
        ("uploads", ctypes.c_uint64),
        ("upload_bytes", ctypes.c_uint64),
        ("resident_bytes", ctypes.c_uint64),
        ("alloc_bytes", ctypes.c_uint64),
        ("n_steps", ctypes.c_uint64),
        ("n_layers", ctypes.c_int32),
        ("n_slots", ctypes.c_int32),
        ("n_inserts", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("n_expert_used", ctypes.c_int32),
        ("sync", ctypes.c_int32),
        ("upload_wait_us", ctypes.c_uint64),
        ("n_h2d", ctypes.c_uint64),
        ("n_waits", ctypes.c_uint64),
        ("upload_file_bytes", ctypes.c_uint64),
        ("upload_busy_us", ctypes.c_uint64),
        ("n_publish", ctypes.c_uint64),
        ("warmup_uploads", ctypes.c_uint64),
        ("warmup", ctypes.c_int32),
        ("n_syncs", ctypes.c_uint64),
        ("n_step_moves", ctypes.c_int32),
        ("layer_demand_mib", ctypes.c_double),
        ("token_demand_mib", ctypes.c_double),
        ("admit_window", ctypes.c_int32),
        ("n_bypassed", ctypes.c_uint64),
    ]


class MoeCacheDeviceStatsC(ctypes.Structure):
    """Mirror of ``struct llama_moe_cache_device_stats`` (ggml-ext/llama-moe.h)."""

    _fields_ = [
        ("name", ctypes.c_char * 128),
        ("n_slots", ctypes.c_int64),
        ("alloc_bytes", ctypes.c_uint64),
        ("n_banks", ctypes.c_int32),
        ("n_layers", ctypes.c_int32),
        ("n_resident", ctypes.c_int64),
        ("n_slots_now", ctypes.c_int64),
        ("hits", ctypes.c_uint64),
        ("misses", ctypes.c_uint64),
    ]


class MoeStreamStatsC(ctypes.Structure):
    """Mirror of ``struct llama_moe_stream_stats`` (ggml-ext/llama-moe.h)."""

    _fields_ = [
        ("hits", ctypes.c_uint64),
        ("misses", ctypes.c_uint64),
        ("read_bytes", ctypes.c_uint64),
        ("resident_bytes", ctypes.c_uint64),
        ("budget_bytes", ctypes.c_uint64),
        ("min_bytes", ctypes.c_uint64),
        ("total_bytes", ctypes.c_uint64),
        ("n_tokens", ctypes.c_uint64),
        ("io_wait_us", ctypes.c_uint64),
        ("major_faults", ctypes.c_uint64),
        ("n_layers", ctypes.c_int32),
        ("direct_io", ctypes.c_int32),
        ("prefetch_bytes", ctypes.c_uint64),
        ("prefetch_used", ctypes.c_uint64),
        ("kv_committed_bytes", ctypes.c_uint64),
        ("kv_capacity_bytes", ctypes.c_uint64),
        ("kv_released_bytes", ctypes.c_uint64),
        ("free_bytes", ctypes.c_uint64),
        ("n_yields", ctypes.c_uint64),
        ("n_grows", ctypes.c_uint64),
        ("elastic", ctypes.c_int32),
    ]


#: ``llama_moe_fit_measure_cb`` (llama-moe.h): the contexts' host bytes at (n_ctx, n_seq); the bindings pass none
MoeFitMeasureC = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)


class MoeParamsC(ctypes.Structure):
    """Mirror of ``struct llama_moe_params`` (ggml-ext/llama-moe.h): every tier option, for
    ``llama_model_moe_apply``. Start from ``llama_moe_default_params()``."""

    _fields_ = [
        ("cache_slots", ctypes.c_int32),
        ("cache_mib", ctypes.c_int32),
        ("cache_inserts", ctypes.c_int32),
        ("cache_floor_mib", ctypes.c_int32),
        ("cache_ceil_mib", ctypes.c_int32),
        ("cache_max_batch", ctypes.c_int32),
        ("cache_admit_window", ctypes.c_int32),
        ("cache_warmup", ctypes.c_int32),
        ("cache_upload_mib", ctypes.c_int32),
        ("cache_sync", ctypes.c_bool),
        ("stream_mib", ctypes.c_int32),
        ("stream_floor_mib", ctypes.c_int32),
        ("stream_ceil_mib", ctypes.c_int32),
        ("stream_io_threads", ctypes.c_int32),
        ("dense_weights", ctypes.c_int32),
        ("trace_path", ctypes.c_char_p),
        ("route_replay_path", ctypes.c_char_p),
        ("n_ubatch", ctypes.c_int32),
        ("strict", ctypes.c_bool),
        ("fit_measure", MoeFitMeasureC),
        ("fit_user_data", ctypes.c_void_p),
        ("fit_n_ctx", ctypes.c_uint32),
        ("fit_n_seq", ctypes.c_uint32),
        ("fit_n_ctx_min", ctypes.c_uint32),
        ("fit_unified", ctypes.c_bool),
        ("fit_user_sized", ctypes.c_bool),
    ]


class MoeApplyReportC(ctypes.Structure):
    """Mirror of ``struct llama_moe_apply_report`` (ggml-ext/llama-moe.h): each tier's init result
    (> 0 the layers it took, 0 inert, < 0 asked for and off), the fit's result, the context to create."""

    _fields_ = [
        ("cache", ctypes.c_int32),
        ("stream", ctypes.c_int32),
        ("fit", ctypes.c_int32),
        ("n_ctx", ctypes.c_uint32),
        ("n_seq", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class MoeStreamStats:
    """The stream tier's counters (cumulative since it started).

    hits / misses: (layer, expert) lookups found in RAM / read from the file first; read_mib,
    resident_mib, budget_mib, min_mib (the mechanical minimum: the least budget the tier takes), total_mib (every streamed expert):
    MiB; tokens: tokens served; io_wait_s: seconds the graph waited for reads; major_faults: the
    process's major page faults since the tier started; direct_io: O_DIRECT reads (else buffered);
    prefetch_mib / prefetch_used_mib: MiB the prefetch read ahead during prefill steps, and of them the
    MiB a step then used. resident_mib can exceed budget_mib by the prefetch window, which decode
    holds as cache entries (docs/stream-tier.md, "Prefetch"). kv_committed_mib / kv_capacity_mib: what the
    contexts' host KV caches hold now (the pages written) and their capacity, MiB; kv_released_mib: MiB
    freed cells gave back; free_mib: the memory free at the governor's last reading; yields / grows: the
    times the governor shrank and grew the budget; elastic: the contexts commit memory as they fill and the
    budget follows the memory (docs/stream-tier.md, "Serving under a memory limit"). These are the
    fields of the engine's ``moe-stream:`` summary line (which ``verbose=False`` does not print).
    """

    hits: int
    misses: int
    read_mib: float
    resident_mib: float
    budget_mib: float
    min_mib: float
    total_mib: float
    tokens: int
    io_wait_s: float
    major_faults: int
    n_layers: int
    direct_io: bool
    prefetch_mib: float = 0.0
    prefetch_used_mib: float = 0.0
    kv_committed_mib: float = 0.0
    kv_capacity_mib: float = 0.0
    kv_released_mib: float = 0.0
    free_mib: float = 0.0
    yields: int = 0
    grows: int = 0
    elastic: bool = False

    @property
    def read_mib_per_token(self) -> float:
        """MiB read per token served (0 before the first token)."""
        return self.read_mib / self.tokens if self.tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """hits / lookups, 0..1 (0 when nothing was looked up)."""
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class _Override(ctypes.Structure):
    """``struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }``"""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class MoeCacheDeviceStats:
    """One device's share of the expert cache (``MoeCacheStats.devices``).

    name: its buffer type (e.g. ``CUDA0``, ``RPC0[127.0.0.1:50052]``); slots: resident slots
    allocated at load over its layers (slots per layer x layers, or the pool's); slots_now: the same
    now (``set_moe_cache_slots`` changes it); allocated_mib: MiB of its companions; banks: the pool's
    banks there (its layers of one expert shape share one; 0: slots per layer); n_layers: cached
    layers on it; resident: experts resident now; hits / misses: lookups of its layers.
    """

    name: str
    slots: int
    slots_now: int
    allocated_mib: float
    banks: int
    n_layers: int
    resident: int
    hits: int
    misses: int


@dataclass(frozen=True)
class MoeCacheStats:
    """The expert cache's counters (cumulative over the model's life).

    hits / misses: expert lookups served by a slot / computed from host memory; uploads: experts
    copied into slots; upload_mib, resident_mib, allocated_mib: MiB; steps: graphs the cache served;
    n_slots: slots per layer now (set_moe_cache_slots changes it; allocated_mib stays); n_layers:
    cached layers. sync: deterministic upload visibility (``moe_expert_cache_sync``);
    upload_wait_s: seconds steps waited for uploads; h2d: host-to-device calls the cache issued
    (merged upload runs + table publishes); waits: blocking waits; upload_file_mib: MiB of the
    uploads read from the GGUF (the rest came from memory: the map, a host buffer or the stream
    tier); upload_busy_s: seconds the uploader spent copying; publishes: of h2d, table publishes
    (one per device per step that changed a table); warmup: experts per layer the prefill warm-up
    uploads (0 = off); warmup_uploads: uploads it scheduled; syncs: scheduler synchronizes the
    cache waited on (only before a step that changes a table); step_moves: the upload budget in
    experts per step (0 = unlimited); layer_demand_mib / token_demand_mib: expert MiB requested per
    served step by the widest cached layer / by all cached layers (the BigMoeOnEdge seed's
    layer_demand_MiB and token_demand_MiB); admit_window: the second-miss window in steps (0 =
    admit always); bypassed: misses the second-miss rule did not upload. These are the fields of the
    engine's ``moe-cache:`` summary line (which ``verbose=False`` does not print). devices: each
    device's share (:class:`MoeCacheDeviceStats`: its slots or pool, resident experts, hits, misses).
    """

    hits: int
    misses: int
    uploads: int
    upload_mib: float
    resident_mib: float
    allocated_mib: float
    steps: int
    n_layers: int
    n_slots: int
    n_inserts: int
    n_expert: int
    n_expert_used: int
    sync: bool = False
    upload_wait_s: float = 0.0
    h2d: int = 0
    waits: int = 0
    upload_file_mib: float = 0.0
    upload_busy_s: float = 0.0
    publishes: int = 0
    warmup_uploads: int = 0
    warmup: int = 0
    syncs: int = 0
    step_moves: int = 0
    layer_demand_mib: float = 0.0
    token_demand_mib: float = 0.0
    admit_window: int = 0
    bypassed: int = 0
    devices: tuple["MoeCacheDeviceStats", ...] = ()

    @property
    def upload_gbps(self) -> float:
        """The uploader's own rate while copying, GB/s (10^9 bytes; 0 before the first upload)."""
        return self.upload_mib * 1024 * 1024 / 1e9 / self.upload_busy_s if self.upload_busy_s else 0.0

    @property
    def hit_rate(self) -> float:
        """hits / lookups, 0..1 (0 when nothing was looked up)."""
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


_libs: dict[str, ctypes.CDLL] = {}


def _llama_lib() -> ctypes.CDLL:
    from llama_cpp import llama_cpp as lc
    lib = lc._lib
    if "llama" not in _libs:
        lib.llama_model_moe_cache_init.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
        lib.llama_model_moe_cache_init.restype = ctypes.c_int32
        lib.llama_model_moe_cache_init_auto.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
        lib.llama_model_moe_cache_init_auto.restype = ctypes.c_int32
        lib.llama_model_moe_cache_set_slots.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.llama_model_moe_cache_set_sync.argtypes = [ctypes.c_void_p, ctypes.c_bool]
        lib.llama_model_moe_cache_set_sync.restype = ctypes.c_int32
        lib.llama_model_moe_cache_set_slots.restype = ctypes.c_int32
        lib.llama_model_moe_cache_get_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(MoeCacheStatsC)]
        lib.llama_model_moe_cache_get_stats.restype = ctypes.c_bool
        lib.llama_model_moe_cache_n_devices.argtypes = [ctypes.c_void_p]
        lib.llama_model_moe_cache_n_devices.restype = ctypes.c_int32
        lib.llama_model_moe_cache_get_device_stats.argtypes = [ctypes.c_void_p, ctypes.c_int32,
                                                               ctypes.POINTER(MoeCacheDeviceStatsC)]
        lib.llama_model_moe_cache_get_device_stats.restype = ctypes.c_bool
        lib.llama_model_moe_stream_set_budget_mib.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.llama_model_moe_stream_set_budget_mib.restype = ctypes.c_int32
        lib.llama_model_moe_stream_get_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(MoeStreamStatsC)]
        lib.llama_model_moe_stream_get_stats.restype = ctypes.c_bool
        lib.llama_moe_default_params.argtypes = []
        lib.llama_moe_default_params.restype = MoeParamsC
        lib.llama_model_moe_apply.argtypes = [ctypes.c_void_p, ctypes.POINTER(MoeParamsC), ctypes.POINTER(MoeApplyReportC)]
        lib.llama_model_moe_apply.restype = ctypes.c_int32
        lib.llama_moe_stream_hint_lazy_load.argtypes = [ctypes.c_char_p]
        lib.llama_moe_stream_hint_lazy_load.restype = None
        _libs["llama"] = lib
    return lib


def _ggml(name: str) -> ctypes.CDLL:
    """libggml / libggml-base / libggml-cpu next to the patched libllama (already loaded by it)."""
    if name not in _libs:
        from llama_cpp import llama_cpp as lc
        _libs[name] = ctypes.CDLL(str(Path(lc._lib._name).resolve().parent / f"lib{name}.so"))
    return _libs[name]


def cpu_buffer_type() -> int:
    """The CPU backend's buffer type (what --cpu-moe places experts in)."""
    f = _ggml("ggml-cpu").ggml_backend_cpu_buffer_type
    f.restype = ctypes.c_void_p
    return f()


def buffer_type_by_name(name: str) -> int:
    """A buffer type by name (``CPU``, ``CUDA0``, ``RPC0[host:port]``, ...).

    Raises:
        ValueError: no device has a buffer type of that name.
    """
    base, reg = _ggml("ggml-base"), _ggml("ggml")
    reg.ggml_backend_dev_count.restype = ctypes.c_size_t
    reg.ggml_backend_dev_get.restype = ctypes.c_void_p
    reg.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    names = []
    for i in range(reg.ggml_backend_dev_count()):
        buft = base.ggml_backend_dev_buffer_type(reg.ggml_backend_dev_get(i))
        n = base.ggml_backend_buft_name(buft).decode()
        if n == name:
            return buft
        names.append(n)
    raise ValueError(f"no buffer type named {name!r}; accepted: {', '.join(names)}")


#: endpoint -> the device handles its ggml-rpc-server added to the process's backend registry
_rpc_devices: dict[str, list[int]] = {}


def _registry_api():
    """libggml's device registry and libggml-base's device accessors, with their ctypes signatures."""
    base, reg = _ggml("ggml-base"), _ggml("ggml")
    reg.ggml_backend_dev_count.restype = ctypes.c_size_t
    reg.ggml_backend_dev_get.restype = ctypes.c_void_p
    reg.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_name.restype = ctypes.c_char_p
    base.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_name.restype = ctypes.c_char_p
    base.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    base.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    base.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return base, reg


@dataclass(frozen=True)
class Device:
    """One device of the process's backend registry."""

    handle: int        # ggml_backend_dev_t
    type: int          # enum ggml_backend_dev_type (0 CPU, 1 GPU, 2 IGPU, 3 ACCEL, 4 META)
    name: str          # CPU, CUDA0, RPC0, ...
    backend: str       # the registry entry's name: CPU, CUDA, RPC, ...


def registry_devices() -> list[Device]:
    """Every device in the process's backend registry, in registry order (RPC devices stay there
    from :func:`add_rpc_server` on, for the life of the process)."""
    base, reg = _registry_api()
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        d = reg.ggml_backend_dev_get(i)
        out.append(Device(d, base.ggml_backend_dev_type(d), base.ggml_backend_dev_name(d).decode(),
                          base.ggml_backend_reg_name(base.ggml_backend_dev_backend_reg(d)).decode()))
    return out


def add_rpc_server(endpoint: str) -> list[int]:
    """Registers a ``ggml-rpc-server`` at ``host:port`` as a device (as ``--rpc`` does), once per
    process, and returns its device handles.

    The registry keeps the device for the life of the process, and llama.cpp's default device
    selection offloads to every registered device; :class:`Llama` therefore passes each model the
    devices of its own ``rpc_servers`` only (:func:`offload_devices`).

    Raises:
        ValueError: a malformed endpoint, or the server cannot be reached.
    """
    if endpoint in _rpc_devices:
        return _rpc_devices[endpoint]
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"rpc server {endpoint!r} must be host:port")
    # upstream aborts the process (a backtrace from "Failed to connect") where nothing listens
    if not wait_for_endpoint(endpoint, 0):
        raise ValueError(f"rpc server {endpoint} is not reachable: nothing accepts connections there (start "
                         f"ggml-rpc-server on that host and port, or fix rpc_servers)")
    lib = _ggml("ggml")
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    rpc = lib.ggml_backend_reg_by_name(b"RPC")
    if not rpc:
        raise ValueError("this build has no RPC backend")
    base = _ggml("ggml-base")
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    # a generation on a lost server fails (llama_decode returns an error, a RuntimeError here) instead
    # of aborting the interpreter, as a server process does (docs/loopback.md)
    fail_on_loss = base.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_set_fail_on_loss")
    if fail_on_loss:
        ctypes.CFUNCTYPE(None, ctypes.c_bool)(fail_on_loss)(True)
    add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(
        base.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server"))
    reg = add(endpoint.encode())
    if not reg:
        raise ValueError(f"cannot reach the rpc server at {endpoint}")
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_register(reg)
    base, _ = _registry_api()
    _rpc_devices[endpoint] = [base.ggml_backend_reg_dev_get(reg, i) for i in range(base.ggml_backend_reg_dev_count(reg))]
    return _rpc_devices[endpoint]


def offload_devices(rpc_endpoints: Sequence[str]) -> list[int] | None:
    """The devices a model of these ``rpc_servers`` offloads to: None where llama.cpp's default
    selection (every registered RPC device, then the GPUs, else the integrated GPUs) is already
    that; else the explicit list without the RPC devices other models registered: this model's
    RPC devices in the order given, then the GPUs, else the integrated GPUs.

    (llama.cpp's default also drops a GPU that a second backend lists under the same device id; a
    model of a process that registered other models' RPC servers does not get that filter.)
    """
    mine = [d for ep in rpc_endpoints for d in add_rpc_server(ep)]
    devs = registry_devices()
    if not any(d.backend == "RPC" and d.handle not in mine for d in devs):
        return None
    gpus = [d.handle for d in devs if d.type == GGML_BACKEND_DEVICE_TYPE_GPU and d.backend != "RPC"]
    igpus = [d.handle for d in devs if d.type == GGML_BACKEND_DEVICE_TYPE_IGPU]
    return mine + (gpus or igpus)


def _device_names(handles: Sequence[int] | None) -> list[str]:
    """The names of the devices a model offloads to (``handles`` from :func:`offload_devices`)."""
    devs = registry_devices()
    if handles is None:
        return [d.name for d in devs if d.type in (GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU)]
    by = {d.handle: d.name for d in devs}
    return [by.get(h, hex(h)) for h in handles]


#: The largest count the engine takes (its C API's int32: MiB, slots, lanes, steps).
COUNT_MAX = 2**31 - 1


def _check_count(name: str, v, auto: int | None = None, lo: int = 0, hi: int = COUNT_MAX, what: str = "") -> int:
    """``v`` as the engine's count: an int in ``lo .. hi``, or ``"auto"`` where the engine takes it
    (``auto``: the value that says auto there, e.g. LLAMA_MOE_CACHE_AUTO, returned for it). Raises
    ValueError naming ``name``, the value and the real range (``what`` follows the range, e.g. "MiB"
    or "(the slots allocated at load)")."""
    if auto is not None and v == "auto":
        return auto
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > hi:
        accepted = f"an integer in {lo} .. {hi}" + (f" {what}" if what else "") + (" or 'auto'" if auto is not None
                                                                                    else "")
        raise ValueError(f"{name}={v!r} is invalid; accepted: {accepted}")
    return v


def _import_llama_cpp():
    import llama_cpp
    import llama_cpp._internals as internals
    return llama_cpp, internals


llama_cpp, _internals = _import_llama_cpp()

#
# the engine's log: one callback for the process, as llama_cpp's own, but quiet when asked
#

# ggml.h's enum ggml_log_level (llama_cpp 0.3.36's _logger maps an older enum: it shows WARN lines as
# errors and hides ERROR lines as debug at verbose=False; tests/build/test_abi.py holds these to the
# built tree's ggml.h)
GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO = 0, 1, 2
GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 3, 4, 5
#: the engine's recent lines, (sequence number, level, text): the reasons errors carry
_log_recent: collections.deque = collections.deque(maxlen=256)
_log_seq = itertools.count(1)
_log_state = {"last": GGML_LOG_LEVEL_NONE, "seq": 0}
#: the RPC servers the engine has reported lost ("ggml-rpc: RPC server HOST:PORT is lost: ...")
_lost_servers: set[str] = set()
_LOST_RE = re.compile(r"ggml-rpc: RPC server (\S+) is lost")
_TRANSPORT_RE = re.compile(r"^(send|recv) failed\b.*RPC server (\S+?)(?: closed the connection)?$")


def _verbose() -> bool:
    """llama_cpp's verbosity (``Llama(verbose=...)`` sets it for the process)."""
    from llama_cpp import _logger
    return _logger.logger.level <= logging.INFO


def _log_shown(level: int, text: str) -> bool:
    """Whether a line reaches stderr. ``verbose=True``: every line, as llama_cpp prints them.
    ``verbose=False``: errors, and the warnings of pybmoe's tiers (a tier that was asked for and did
    not engage, an inert flag, a lost RPC server); nothing else, not the tiers' load and summary lines
    (level NONE, which llama_cpp would print at any verbosity)."""
    if _verbose():
        return True
    late = _TRANSPORT_RE.match(text.strip())
    if late and late.group(2) in _lost_servers:
        return False  # a socket error on a server already reported lost (and raised) adds nothing
    return level == GGML_LOG_LEVEL_ERROR or (level == GGML_LOG_LEVEL_WARN and ("moe-" in text or "ggml-rpc" in text))


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data) -> None:
    if level == GGML_LOG_LEVEL_CONT:
        level = _log_state["last"]
    else:
        _log_state["last"] = level
    line = text.decode("utf-8", errors="replace")
    n = next(_log_seq)
    _log_recent.append((n, level, line))
    _log_state["seq"] = n
    lost = _LOST_RE.search(line)
    if lost:
        _lost_servers.add(lost.group(1))
    if _log_shown(level, line):
        print(line, end="", flush=True, file=sys.stderr)


_log_lock = threading.Lock()
_log_installed = False


def _install_log() -> None:
    """Makes :func:`_log_callback` the engine's log callback. llama.cpp has one for the process, so
    this is done once, when the first :class:`Llama` is made (importing this module leaves
    llama_cpp's own in place); from then on the lines of every model of the process, a stock
    ``llama_cpp.Llama``'s too, are kept as reasons and shown as :func:`_log_shown` says."""
    global _log_installed
    with _log_lock:
        if not _log_installed:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            _log_installed = True


def _log_mark() -> int:
    """The sequence number of the engine's last line (for :func:`_log_reasons`)."""
    return _log_state["seq"]


def _log_reasons(since: int) -> str:
    """The engine's WARN and ERROR lines after ``since`` (:func:`_log_mark`), joined: the reason an
    error carries, whatever the verbosity."""
    # a lost RPC server is logged once, by whichever call saw it first (maybe before ``since``)
    lines = [t.strip() for n, lvl, t in list(_log_recent)
             if (n > since or "ggml-rpc: RPC server" in t) and lvl in (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR)
             and t.strip()]
    lines.sort(key=lambda t: "is lost" not in t)  # a lost RPC server first: the cause of what follows
    return "; ".join(dict.fromkeys(lines))


def _with_reason(msg: str, since: int) -> str:
    why = _log_reasons(since)
    return f"{msg}; the engine said: {why}" if why else msg


#: One pybmoe.Llama loads at a time in the process: the tiers size themselves from the memory free at
#: their start (``auto``), which a second load at the same time would count as free too.
_load_lock = threading.Lock()
#: every open pybmoe.Llama: closed at interpreter exit while the interpreter still runs, so that no
#: engine thread enters the log callback of an interpreter that is shutting down
_live: "weakref.WeakSet[Llama]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for llm in list(_live):
        with contextlib.suppress(Exception):
            llm.close()


#: llama_cpp.Llama's default ``n_ubatch`` (tokens), the largest ubatch the tiers are sized for when none is given
N_UBATCH_DEFAULT = inspect.signature(llama_cpp.Llama.__init__).parameters["n_ubatch"].default


def _llama_cpp_params() -> set[str]:
    return set(inspect.signature(llama_cpp.Llama.__init__).parameters) - {"self", "kwargs"}


def _check_kwargs(ours: set[str], kwargs: dict) -> None:
    """An unknown ``moe_*``/``dense_*`` keyword (or one close to a pybmoe keyword) is a TypeError
    naming the closest valid name; llama_cpp.Llama would ignore it, leaving the tier off."""
    theirs = _llama_cpp_params()
    for k in kwargs:
        if k in theirs:
            continue
        close = difflib.get_close_matches(k, sorted(ours), n=1, cutoff=0.6)
        if k.startswith(("moe_", "dense_")) or difflib.get_close_matches(k, sorted(ours), n=1, cutoff=0.85):
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"pybmoe.Llama got an unexpected keyword argument {k!r}{hint}")


#: The message of the RuntimeError that any use of a closed :class:`Llama` raises.
CLOSED = ("this pybmoe.Llama is closed: close() or the end of its with block freed the model; create a new "
          "Llama to use it again")


#: What a closed llama_cpp object still answers: its close() and __del__ (and Python's own names).
_CLOSED_KEEP = frozenset({"close", "_exit_stack", "sampler", "custom_samplers"})
_closed_classes: dict[type, type] = {}


def _closed_class(cls: type) -> type:
    """``cls`` (llama_cpp's ``LlamaModel``, ``LlamaContext`` or ``LlamaBatch``) with every attribute but
    what its ``close()`` and ``__del__`` use raising RuntimeError (:data:`CLOSED`). A closed
    :class:`Llama`'s objects take it: the freed C pointers stay in them, and llama_cpp's tokenizer and
    samplers hold them as well as the Llama, so a call on any holder would be a segfault."""
    if cls not in _closed_classes:
        def __getattribute__(self, name: str):
            if name in _CLOSED_KEEP or name.startswith("__"):
                return object.__getattribute__(self, name)
            raise RuntimeError(CLOSED)

        _closed_classes[cls] = type(f"Closed{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})
    return _closed_classes[cls]


def _check_path(name: str, v, must_exist: bool) -> str | None:
    """``v`` (a str or path-like, or None) as a str path: with ``must_exist`` a file, else a path in an
    existing folder that is not a folder itself. Raises ValueError naming ``name`` and why."""
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
        raise ValueError(f"{name}={v!r} is invalid; accepted: a file path (str or path-like)")
    p = Path(os.fspath(v))
    if must_exist and not p.is_file():
        raise ValueError(f"{name}={os.fspath(v)!r}: " + ("is a directory" if p.is_dir() else "no such file")
                         + "; accepted: a --moe-trace CSV")
    if not must_exist and (p.is_dir() or not p.parent.is_dir()):
        why = "is a directory" if p.is_dir() else f"the folder {p.parent} does not exist"
        raise ValueError(f"{name}={os.fspath(v)!r}: {why}; accepted: the path of the CSV file to write")
    return os.fspath(p)


@dataclass(eq=False)
class _LoadPlan:
    """What :class:`Llama`'s model load needs, checked: the keywords' values as the engine takes
    them (MiB, slots, steps, lanes, tokens), and the override and device arrays the params point
    into (kept alive with the model); and what the load reports back (the slots allocated). It
    holds no reference to the Llama, so that the Llama is freed when its last reference goes, as
    llama_cpp.Llama is. ``asked``: the keywords as given, for the messages."""

    path: str
    asked: dict
    slots: int = 0
    cache_mb: int = 0                 # or MiB per device (moe_expert_cache_mb)
    inserts: int = 0
    warmup: int = 0
    upload_mb: int = 0
    sync: bool = False
    admit_window: int = 0
    floor_mb: int = LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT
    ceil_mb: int = 0
    stream_mb: int = 0
    stream_floor: int = LLAMA_MOE_STREAM_FLOOR_AUTO
    stream_ceil: int = 0
    io_threads: int = LLAMA_MOE_STREAM_IO_THREADS_DEFAULT
    dense_mode: int = LLAMA_MOE_DENSE_AUTO
    trace_path: str | None = None
    replay_path: str | None = None
    n_ubatch: int = N_UBATCH_DEFAULT
    repack: bool = True
    devices: object = None            # a NULL-terminated ggml_backend_dev_t array, or None: llama.cpp's default
    device_names: list = field(default_factory=list)
    patterns: list = field(default_factory=list)
    overrides: object = None          # a llama_model_tensor_buft_override array, ended by {NULL, NULL}
    n_overrides: int = 0
    slots_allocated: int = 0          # reported back: the slots per layer allocated at load
    loaded: bool = False              # the after-load sequence ran


def _before_load(plan: _LoadPlan, params) -> None:
    """Sets pybmoe's fields of the model params (``llama_model_params``: the tensor overrides, the
    devices, the extra buffer types) and the stream tier's lazy-load hint, right before the load."""
    if plan.n_overrides:
        params.tensor_buft_overrides = ctypes.addressof(plan.overrides)
    if plan.devices is not None:
        params.devices = ctypes.addressof(plan.devices)
    if not plan.repack or plan.stream_mb != 0:
        params.use_extra_bufts = False  # streamed experts must keep the GGUF layout
    # with the stream tier, the load leaves the host-resident experts unread (the tier reads them)
    _llama_lib().llama_moe_stream_hint_lazy_load(os.fsencode(plan.path) if plan.stream_mb != 0 else None)


def _moe_params(plan: _LoadPlan) -> MoeParamsC:
    """The plan's tier options as ``struct llama_moe_params`` (strict: a tier asked for that does not
    engage is an error). The paths' bytes live as long as the struct."""
    p = _llama_lib().llama_moe_default_params()
    p.cache_slots, p.cache_mib, p.cache_inserts = plan.slots, plan.cache_mb, plan.inserts
    p.cache_floor_mib, p.cache_ceil_mib = plan.floor_mb, plan.ceil_mb
    p.cache_admit_window, p.cache_warmup, p.cache_upload_mib = plan.admit_window, plan.warmup, plan.upload_mb
    p.cache_sync = plan.sync
    p.stream_mib, p.stream_floor_mib, p.stream_ceil_mib = plan.stream_mb, plan.stream_floor, plan.stream_ceil
    p.stream_io_threads, p.dense_weights = plan.io_threads, plan.dense_mode
    p.trace_path = os.fsencode(plan.trace_path) if plan.trace_path is not None else None
    p.route_replay_path = os.fsencode(plan.replay_path) if plan.replay_path is not None else None
    p.n_ubatch, p.strict = plan.n_ubatch, True
    return p


def _after_load(plan: _LoadPlan, model) -> None:
    """The engine's after-load sequence on ``model`` (a loaded ``llama_cpp._internals.LlamaModel``),
    before any context: ``llama_model_moe_apply``, the one entry llama-server and llama-bench call
    too (the expert cache, the stream tier, the dense policy, the trace, the replay, in that order).

    Raises:
        ValueError: a tier asked for that does not engage, or a trace the engine refuses; the
            message carries the engine's WARN and ERROR lines. The model is freed first.

    Warns:
        RuntimeWarning: a tier asked for on a model with no MoE layers (the flag is inert).
    """
    lib, m, asked = _llama_lib(), model.model, plan.asked
    mark = _log_mark()  # the reasons below are the tiers' lines, not the loader's
    params, rep = _moe_params(plan), MoeApplyReportC()
    rc = lib.llama_model_moe_apply(m, ctypes.byref(params), ctypes.byref(rep))
    cache = (f"moe_expert_cache_mb={asked['moe_expert_cache_mb']!r}" if plan.cache_mb
             else f"moe_expert_cache={asked['moe_expert_cache']!r}")
    stream = f"moe_stream_cache_mb={asked['moe_stream_cache_mb']!r}"
    if rc == LLAMA_MOE_APPLY_ERR_CACHE_OFF and not plan.device_names:
        msg = (f"{cache} needs a device to hold the slots, and this model has none: this build has no GPU "
               "backend and no rpc_servers were given; pass rpc_servers='host:port' (a ggml-rpc-server, the "
               "loopback device of the README) or install a GPU build (CMAKE_ARGS=\"-DGGML_CUDA=ON\" pip "
               "install .)")
        model.close()
        raise ValueError(msg)
    why = {  # each built only for its result (a path is None unless asked for)
        LLAMA_MOE_APPLY_ERR_CACHE_NO_ROOM: lambda: f"{cache} does not fit the device's free memory minus "
                                                   f"moe_expert_cache_floor_mb={plan.floor_mb} MiB"
                                                   + (" (or is under one slot per layer)" if plan.cache_mb else ""),
        LLAMA_MOE_APPLY_ERR_CACHE_OFF: lambda: f"{cache} was requested but the expert cache did not engage on "
                                               f"{', '.join(plan.device_names)} (no host-resident MoE layer with a "
                                               "device-resident router: give n_gpu_layers and cpu_moe; or no room)",
        LLAMA_MOE_APPLY_ERR_CACHE_ADMIT: lambda: f"moe_expert_cache_admit={asked['moe_expert_cache_admit']!r} was refused",
        LLAMA_MOE_APPLY_ERR_CACHE_UPLOAD: lambda: f"moe_expert_cache_upload_mb={plan.upload_mb} is under one expert",
        LLAMA_MOE_APPLY_ERR_STREAM_BUDGET: lambda: f"{stream} is under the mechanical minimum at n_ubatch={plan.n_ubatch}",
        LLAMA_MOE_APPLY_ERR_STREAM_OFF: lambda: f"{stream} was requested but the stream tier did not engage",
        LLAMA_MOE_APPLY_ERR_DENSE: lambda: f"dense_weights={asked['dense_weights']!r} could not be applied",
        LLAMA_MOE_APPLY_ERR_TRACE: lambda: f"moe_trace={os.fspath(asked['moe_trace'])!r}: cannot write the routing "
                                           "trace there",
        LLAMA_MOE_APPLY_ERR_REPLAY: lambda: f"moe_route_replay={os.fspath(asked['moe_route_replay'])!r}: the engine "
                                            "refused the routing trace",
    }
    if rc != LLAMA_MOE_APPLY_OK:
        model.close()
        msg = why[rc]() if rc in why else f"the engine's after-load sequence failed (llama_model_moe_apply: {rc})"
        raise ValueError(_with_reason(msg, mark))
    # as llama-server: a flag on a model with no MoE layers is inert, and says so (a WARN line there). The
    # frames up to the caller: this one, the _model setter, llama_cpp.Llama.__init__, Llama.__init__
    for flag, asked_for, result in (("moe_expert_cache", plan.slots != 0, rep.cache),
                                    ("moe_expert_cache_mb", plan.cache_mb != 0, rep.cache),
                                    ("moe_stream_cache_mb", plan.stream_mb != 0, rep.stream)):
        if asked_for and result == 0:
            warnings.warn(f"{flag}={asked[flag]!r} is inert: the model has no MoE layers", RuntimeWarning, stacklevel=5)
    if plan.slots != 0 or plan.cache_mb != 0:
        st = MoeCacheStatsC()
        if lib.llama_model_moe_cache_get_stats(m, ctypes.byref(st)):
            plan.slots_allocated = st.n_slots


class Llama(llama_cpp.Llama):
    """``llama_cpp.Llama`` that can place experts in host memory and cache them on the device.

    Args (besides every ``llama_cpp.Llama`` keyword, which passes through):
        model_path: the GGUF file, a ``str`` or a path-like (``models.default_model_path()``).
        moe_expert_cache: slots per host-resident MoE layer (int >= 0), or ``"auto"`` (size each
            device from its free memory minus ``moe_expert_cache_floor_mb``, capped by
            ``moe_expert_cache_ceil_mb``). 0 = off. Fixed slots must fit each device's free
            memory minus the floor (MiB), else ValueError. Unlike ``llama-server``, ``auto`` here
            does not measure the context's KV and compute memory first: keep the floor above it.
        moe_expert_cache_mb: the cache in MiB per device instead (int >= 0; ``--moe-expert-cache-mb``,
            upstream's ``--moe-cache-mib``): each device holds the most slots per layer that this many
            MiB hold with their staging; ``"auto"`` is ``moe_expert_cache="auto"``. A budget over a
            device's free memory minus the floor, or under one slot per layer, is a ValueError naming
            the range that fits; with ``moe_expert_cache`` as well, a ValueError. 0 = off.
        moe_expert_cache_inserts: uploads per layer per decode step (0 = unlimited).
        moe_expert_cache_upload_mb: the upload budget, MiB of expert uploads per decode step over
            all layers (``--moe-expert-cache-upload-mb``; 0 = unlimited, the default); under one
            expert is a ValueError.
        moe_expert_cache_warmup: after a prefill the cache does not serve, upload each cached
            layer's N most selected experts (``--moe-expert-cache-warmup N``; 0 = off, the default).
        moe_expert_cache_sync: deterministic upload visibility (``--moe-expert-cache-sync``): a miss
            at decode step s is resident from step s+2, each step waiting for the uploads of the one
            before. Off (the default), an upload is used from the first step after its bytes
            arrive and no step waits for one; the output is bit-identical either way.
        moe_expert_cache_admit: which misses are uploaded (``--moe-expert-cache-admit``): ``"always"``
            (the default), ``"second-miss"`` (an expert that also missed at one of its layer's last 4
            steps) or ``"second-miss:W"`` (W in 1 .. 1024 steps); anything else is a ValueError.
        cpu_moe: keep every MoE expert tensor in host memory (``--cpu-moe``): True or False (anything
            else is a ValueError, as for ``repack``).
        n_cpu_moe: keep the experts of the first N layers in host memory (``--n-cpu-moe``).
        override_tensor: ``"pattern=BUFT,..."`` or a list of ``(pattern, buft name)`` (``-ot``).
        rpc_servers: ``"host:port,..."`` (a str; anything else is a ValueError): ggml-rpc-server
            devices to offload to (``--rpc``). Each ``Llama`` offloads to its own only: a server
            another ``Llama`` of the process named stays registered, but is not this one's device.
        repack: let host weights use repacked layouts (``--no-repack`` is ``repack=False``).
        moe_stream_cache_mb: the stream tier's RAM budget in MiB (int in 0 .. 2**31 - 1), or
            ``"auto"`` (available memory minus the dense weights, the read buffers and
            ``moe_stream_floor_mb``, capped by ``moe_stream_ceil_mb``; the context's host memory
            is set aside when it is created: docs/stream-tier.md); 0 = off. The experts of
            host-resident MoE layers are read from the GGUF into it as layers need them
            (``--moe-stream-cache-mb``); repack is turned off and the load leaves them unread.
            Under the mechanical minimum it is a ValueError: the most one layer step needs at
            ``n_ubatch``, or, where a step can need more than one token's top-k, one token's top-k
            experts beside the expert waves' window (2 experts per read lane): a budget under the
            largest step reads the rest of such a step in waves while the layer computes
            (docs/stream-tier.md, "Expert waves").
        moe_stream_floor_mb: MiB ``auto`` leaves free, or ``"auto"`` (the default: 1/16 of the
            memory limit, 64 .. 1536 MiB).
        moe_stream_io_threads: the stream tier's read lanes (1 .. 64).
        dense_weights: the non-expert weights in host memory (``--dense-weights``): ``"auto"``
            (the default: with the stream tier at a fixed budget, ``"anon"`` when the GGUF is larger
            than the memory available and the budget and the dense weights fit in it, else ``"mmap"``),
            ``"mmap"``, ``"warm"`` or ``"anon"``.
        moe_trace: write every MoE layer's routing (and the tiers' hits) to this CSV file
            (``--moe-trace FILE``; ``docs/traces.md``); its folder must exist. The file is complete once
            the Llama is freed.
        moe_route_replay: MoE layers take their experts from this routing trace (a ``--moe-trace``
            CSV of the model's shape) instead of their router (``--moe-route-replay FILE``); the
            engine refuses a trace of another shape, a ValueError carrying its reason.

    Raises:
        ValueError: a ``model_path`` that is not a path (None), a bad cache value or override, a
            ``cpu_moe`` or ``repack`` that is not a bool, an ``rpc_servers`` that is not a str, an
            unreachable RPC server, or a model that does not load (as ``llama_cpp.Llama``, with the loader's reason, whatever the verbosity:
            a truncated or non-GGUF file; a directory is named as one). A cache that was asked for but cannot engage
            raises too: with no device at all (no GPU build, no ``rpc_servers``) the message says
            so; otherwise it carries the engine's WARN/ERROR lines, whatever the verbosity. An
            ``rpc_servers`` endpoint where nothing listens is a ValueError naming it.
        TypeError: an unknown ``moe_*``/``dense_*`` keyword (or one close to a pybmoe keyword); the
            message names the closest valid one.
        RuntimeError: any use of a Llama after ``close()`` or its ``with`` block (:data:`CLOSED`);
            stock ``llama_cpp.Llama`` reaches the freed model there and the interpreter dies.

    Warns:
        RuntimeWarning: a tier asked for on a model with no MoE layers (the flag is inert).

    A Llama is freed when its last reference goes, at ``close()`` or at the end of a ``with`` block;
    ``verbose=False`` prints no engine line but errors and the tiers' warnings (docs/loopback.md).
    Generation after its RPC server went away raises RuntimeError naming the server.

    What it relies on inside llama-cpp-python 0.3.36, and why. Nothing else is touched: no class or
    function of llama_cpp is replaced, importing this module changes nothing in the process, and a
    stock ``llama_cpp.Llama`` beside it loads with llama_cpp's own classes and params (only the log
    callback is the process's, below).

    - the attributes ``llama_cpp.Llama.__init__`` assigns: ``model_params`` (made, then the load) and
      ``_model`` (loaded, then the context). Their assignments are the only points between the
      params and the load, and between the load and the context: the overrides, the devices and
      the lazy-load hint go in the first, the tiers in the second (the engine takes them after the
      load and before any context). llama_cpp.Llama takes no tensor overrides or devices and has no
      hook there; the fields pybmoe sets are ones it never sets.
    - ``_model.model`` (the ``llama_model *``), which pybmoe's C API takes.
    - ``_model``, ``_ctx`` and ``_batch`` and their classes in ``llama_cpp._internals``: ``close()``
      gives each a class whose every call raises (:data:`CLOSED`), since llama_cpp's tokenizer and
      samplers keep them and a call would reach the freed pointers.
    - ``llama_cpp.llama_cpp._lib``, the loaded ``libllama`` that holds pybmoe's C API (libggml*
      are loaded from its folder), and ``llama_cpp._logger``'s level, the verbosity
      ``Llama(verbose=...)`` sets.
    - the process's one log callback (``llama_log_set``), replaced when the first Llama is made:
      the engine's WARN and ERROR lines are the reasons errors carry, at any verbosity.
    """

    def __init__(self, model_path: str | os.PathLike, *, moe_expert_cache: int | str = 0,
                 moe_expert_cache_mb: int | str = 0, moe_expert_cache_inserts: int = 0, moe_expert_cache_sync: bool = False,
                 moe_expert_cache_warmup: int = 0, moe_expert_cache_upload_mb: int = 0,
                 moe_expert_cache_floor_mb: int = LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT, moe_expert_cache_ceil_mb: int = 0,
                 moe_expert_cache_admit: str = "always", cpu_moe: bool = False, n_cpu_moe: int = 0,
                 override_tensor: str | Sequence[tuple[str, str]] | None = None,
                 rpc_servers: str | None = None, repack: bool = True, moe_stream_cache_mb: int | str = 0,
                 moe_stream_floor_mb: int | str = "auto", moe_stream_ceil_mb: int = 0,
                 moe_stream_io_threads: int = LLAMA_MOE_STREAM_IO_THREADS_DEFAULT, dense_weights: str = "auto",
                 moe_trace: str | os.PathLike | None = None, moe_route_replay: str | os.PathLike | None = None,
                 **kwargs):
        self._stack = contextlib.ExitStack()  # llama_cpp's __del__ needs it even when we raise first
        _install_log()
        _check_kwargs(set(inspect.signature(Llama.__init__).parameters) - {"self", "kwargs"}, kwargs)
        if isinstance(model_path, bytes) or not isinstance(model_path, (str, os.PathLike)) or not os.fspath(model_path):
            raise ValueError(f"model_path={model_path!r} is invalid; accepted: the path of a GGUF file (a str or "
                             "path-like, e.g. models.default_model_path())")
        if os.path.isdir(model_path):
            raise ValueError(f"model_path {os.fspath(model_path)} is a directory; accepted: a GGUF file (the first "
                             "file of a split GGUF)")
        if not isinstance(moe_expert_cache_sync, bool):
            raise ValueError(f"moe_expert_cache_sync must be True or False, got {moe_expert_cache_sync!r}")
        for name, v in (("cpu_moe", cpu_moe), ("repack", repack)):
            if not isinstance(v, bool):
                raise ValueError(f"{name}={v!r} is invalid; accepted: True or False")
        if rpc_servers is not None and not isinstance(rpc_servers, str):
            raise ValueError(f"rpc_servers={rpc_servers!r} is invalid; accepted: a str of host:port endpoints, "
                             "comma-separated (e.g. '127.0.0.1:50052'), or None")
        if dense_weights not in DENSE_POLICIES:
            raise ValueError(f"dense_weights={dense_weights!r} is invalid; accepted: {', '.join(DENSE_POLICIES)}")
        cache_mb = _check_count("moe_expert_cache_mb", moe_expert_cache_mb, auto=LLAMA_MOE_CACHE_AUTO)
        if cache_mb != 0 and moe_expert_cache != 0:
            raise ValueError(f"moe_expert_cache={moe_expert_cache!r} and moe_expert_cache_mb={moe_expert_cache_mb!r} "
                             "are mutually exclusive: give one (slots per layer, or MiB per device)")
        if cache_mb == LLAMA_MOE_CACHE_AUTO:  # MiB auto is slots auto
            moe_expert_cache, cache_mb = "auto", 0
        asked = {"moe_expert_cache": moe_expert_cache, "moe_expert_cache_mb": moe_expert_cache_mb,
                 "moe_stream_cache_mb": moe_stream_cache_mb,
                 "moe_expert_cache_admit": moe_expert_cache_admit, "dense_weights": dense_weights,
                 "moe_trace": moe_trace, "moe_route_replay": moe_route_replay}
        plan = _LoadPlan(
            os.fspath(model_path), asked,
            slots=_check_count("moe_expert_cache", moe_expert_cache, auto=LLAMA_MOE_CACHE_AUTO), cache_mb=cache_mb,
            inserts=_check_count("moe_expert_cache_inserts", moe_expert_cache_inserts),
            warmup=_check_count("moe_expert_cache_warmup", moe_expert_cache_warmup),
            upload_mb=_check_count("moe_expert_cache_upload_mb", moe_expert_cache_upload_mb),
            sync=moe_expert_cache_sync,
            admit_window=parse_admit(moe_expert_cache_admit),
            floor_mb=_check_count("moe_expert_cache_floor_mb", moe_expert_cache_floor_mb),
            ceil_mb=_check_count("moe_expert_cache_ceil_mb", moe_expert_cache_ceil_mb),
            stream_mb=_check_count("moe_stream_cache_mb", moe_stream_cache_mb, auto=LLAMA_MOE_STREAM_AUTO),
            stream_floor=_check_count("moe_stream_floor_mb", moe_stream_floor_mb, auto=LLAMA_MOE_STREAM_FLOOR_AUTO),
            stream_ceil=_check_count("moe_stream_ceil_mb", moe_stream_ceil_mb),
            io_threads=_check_count("moe_stream_io_threads", moe_stream_io_threads, lo=1, hi=LLAMA_MOE_STREAM_IO_THREADS_MAX),
            dense_mode=DENSE_POLICIES[dense_weights],
            trace_path=_check_path("moe_trace", moe_trace, must_exist=False),
            replay_path=_check_path("moe_route_replay", moe_route_replay, must_exist=True),
            n_ubatch=int(kwargs.get("n_ubatch", N_UBATCH_DEFAULT)),
            repack=repack)
        n_cpu_moe = _check_count("n_cpu_moe", n_cpu_moe)
        endpoints = [ep.strip() for ep in rpc_servers.split(",") if ep.strip()] if rpc_servers else []
        devices = offload_devices(endpoints)  # this model's RPC devices only, not other models'
        plan.devices = None if devices is None else (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        plan.device_names = _device_names(devices)

        pairs: list[tuple[str, int]] = []
        if isinstance(override_tensor, str):
            for item in filter(None, (s.strip() for s in override_tensor.split(","))):
                pattern, sep, name = item.partition("=")
                if not sep or not pattern or not name:
                    raise ValueError(f"override_tensor item {item!r} must be pattern=BUFFER_TYPE")
                pairs.append((pattern, buffer_type_by_name(name)))
        elif override_tensor:
            pairs += [(p, buffer_type_by_name(n)) for p, n in override_tensor]
        if cpu_moe:
            pairs.append((EXPS_REGEX, cpu_buffer_type()))
        pairs += [(rf"blk\.{i}{EXPS_REGEX}", cpu_buffer_type()) for i in range(n_cpu_moe)]
        plan.patterns = [p.encode() for p, _ in pairs]  # kept alive with the model
        plan.overrides = (_Override * (len(pairs) + 1))(
            *[_Override(pat, buft) for pat, (_, buft) in zip(plan.patterns, pairs)], _Override(None, None))
        plan.n_overrides = len(pairs)

        # the load steps run where llama_cpp.Llama.__init__ assigns model_params and _model (below)
        self._moe_plan = plan
        with _load_lock:
            mark = _log_mark()
            try:
                super().__init__(os.fspath(model_path), **kwargs)  # llama_cpp takes a str only
            except ValueError as e:
                if not str(e).startswith("Failed to load model"):
                    raise
                # llama_cpp says only that the load failed; the loader's lines say why, at any verbosity
                raise ValueError(_with_reason(str(e), mark)) from None
            finally:
                if not plan.loaded and plan.stream_mb != 0:
                    _llama_lib().llama_moe_stream_hint_lazy_load(None)  # no load took the hint
        _live.add(self)

    @property
    def model_params(self):
        """``llama_cpp.Llama.model_params`` (``llama_model_params``); assigned once, by
        ``llama_cpp.Llama.__init__`` before the load, when pybmoe's fields are set in it."""
        try:
            return self.__dict__["model_params"]
        except KeyError:
            raise AttributeError("model_params") from None

    @model_params.setter
    def model_params(self, params) -> None:
        self.__dict__["model_params"] = params
        plan = self.__dict__.get("_moe_plan")
        if plan is not None and not plan.loaded:
            _before_load(plan, params)

    @property
    def _model(self):
        """llama_cpp's ``LlamaModel``; assigned by ``llama_cpp.Llama.__init__`` after the load and
        before the context, when the engine's after-load sequence runs on it (:func:`_after_load`)."""
        try:
            return self.__dict__["_model"]
        except KeyError:
            raise AttributeError("_model") from None

    @_model.setter
    def _model(self, model) -> None:
        plan = self.__dict__.get("_moe_plan")
        if plan is not None and not plan.loaded:
            plan.loaded = True
            _after_load(plan, model)
        self.__dict__["_model"] = model

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Frees the model, its contexts, the cache's slots and the stream tier's RAM now (as ``del``
        of the last reference does). Safe to call more than once, and after the RPC server went away
        (frees on a lost server are no-ops). Any later use of the Llama (a generation, tokenize, the
        stats, a setter) raises RuntimeError (:data:`CLOSED`) instead of reaching the freed model."""
        _live.discard(self)
        super().close()
        # llama_cpp reaches the engine through these three (and its tokenizer through the model)
        for name in ("_model", "_ctx", "_batch"):
            obj = self.__dict__.get(name)
            for cls in (_internals.LlamaModel, _internals.LlamaContext, _internals.LlamaBatch):
                if isinstance(obj, cls):
                    obj.__class__ = _closed_class(cls)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` (or the end of the ``with`` block) has freed the model."""
        return type(self.__dict__.get("_model")) in _closed_classes.values()

    def eval(self, tokens) -> None:
        """``llama_cpp.Llama.eval``; a failed decode's RuntimeError carries the engine's reason (a lost
        RPC server names its host:port)."""
        mark = _log_mark()
        try:
            super().eval(tokens)
        except RuntimeError as e:
            if str(e) == CLOSED:
                raise
            raise RuntimeError(_with_reason(str(e), mark)) from e

    def moe_cache_stats(self) -> MoeCacheStats:
        """The expert cache's counters. Raises ValueError when the cache is off."""
        st = MoeCacheStatsC()
        if not _llama_lib().llama_model_moe_cache_get_stats(self._model.model, ctypes.byref(st)):
            raise ValueError("the expert cache is off for this model")
        mib = 1024.0 * 1024.0
        return MoeCacheStats(st.hits, st.misses, st.uploads, st.upload_bytes / mib, st.resident_bytes / mib,
                             st.alloc_bytes / mib, st.n_steps, st.n_layers, st.n_slots, st.n_inserts, st.n_expert,
                             st.n_expert_used, bool(st.sync), st.upload_wait_us / 1e6, st.n_h2d, st.n_waits,
                             st.upload_file_bytes / mib, st.upload_busy_us / 1e6, st.n_publish, st.warmup_uploads,
                             st.warmup, st.n_syncs, st.n_step_moves, st.layer_demand_mib, st.token_demand_mib,
                             st.admit_window, st.n_bypassed, self._moe_cache_devices())

    def _moe_cache_devices(self) -> tuple[MoeCacheDeviceStats, ...]:
        lib = _llama_lib()
        out = []
        for i in range(lib.llama_model_moe_cache_n_devices(self._model.model)):
            d = MoeCacheDeviceStatsC()
            if lib.llama_model_moe_cache_get_device_stats(self._model.model, i, ctypes.byref(d)):
                out.append(MoeCacheDeviceStats(d.name.decode(errors="replace"), d.n_slots, d.n_slots_now,
                                               d.alloc_bytes / 1024.0 / 1024.0, d.n_banks, d.n_layers, d.n_resident,
                                               d.hits, d.misses))
        return tuple(out)

    def moe_stream_stats(self) -> MoeStreamStats:
        """The stream tier's counters. Raises ValueError when the tier is off."""
        st = MoeStreamStatsC()
        if not _llama_lib().llama_model_moe_stream_get_stats(self._model.model, ctypes.byref(st)):
            raise ValueError("the stream tier is off for this model")
        mib = 1024.0 * 1024.0
        return MoeStreamStats(st.hits, st.misses, st.read_bytes / mib, st.resident_bytes / mib, st.budget_bytes / mib,
                              st.min_bytes / mib, st.total_bytes / mib, st.n_tokens, st.io_wait_us / 1e6,
                              st.major_faults, st.n_layers, bool(st.direct_io), st.prefetch_bytes / mib,
                              st.prefetch_used / mib, st.kv_committed_bytes / mib, st.kv_capacity_bytes / mib,
                              st.kv_released_bytes / mib, st.free_bytes / mib, st.n_yields, st.n_grows,
                              bool(st.elastic))

    def set_moe_stream_budget_mb(self, budget_mb: int) -> int:
        """Sets the stream tier's budget (MiB) between generations; a shrink evicts the least
        recently used experts at once, and a budget above every expert is clamped. Returns the
        new budget in MiB.

        Raises:
            ValueError: a bad value (the message names the accepted range), or the tier is off.
            RuntimeError: called while a graph is being computed (during a generation).
        """
        st = self.moe_stream_stats()  # ValueError when off
        lo = int(-(-st.min_mib // 1))
        whole = isinstance(budget_mb, int) and not isinstance(budget_mb, bool)
        if not whole or not lo <= budget_mb <= COUNT_MAX:
            why = "is under the mechanical minimum" if whole and 0 <= budget_mb < lo else "is invalid"
            raise ValueError(f"budget_mb={budget_mb!r} {why}; accepted: {lo} .. {int(-(-st.total_mib // 1))} MiB "
                             f"(more, up to {COUNT_MAX}, is clamped to every expert's bytes)")
        n = budget_mb
        rc = _llama_lib().llama_model_moe_stream_set_budget_mib(self._model.model, n)
        if rc == LLAMA_MOE_ERR_BUSY:
            raise RuntimeError("set_moe_stream_budget_mb was called during a generation; call it between generations")
        if rc < 0:
            raise ValueError(f"budget_mb={budget_mb} was refused (see the log)")
        return rc

    def set_moe_cache_slots(self, n_slots: int) -> int:
        """Sets the slots per layer between generations (0 .. the slots allocated at load); shrinking
        evicts at once. With the pool (``moe_expert_cache_mb`` or ``"auto"``) each bank holds
        ``n_slots x its layers`` slots, at most its slots at load, and evicts the least recently
        used entries of the bank. Returns the new count.

        Raises:
            ValueError: a bad value (the message names the accepted range), or the cache is off.
            RuntimeError: called while a graph is being computed (during a generation).
        """
        self.moe_cache_stats()  # ValueError when off
        cap = self._moe_plan.slots_allocated
        if isinstance(n_slots, int) and not isinstance(n_slots, bool) and n_slots > cap:
            raise ValueError(f"n_slots={n_slots} is out of range; accepted: 0 .. {cap} (the slots allocated at load)")
        n = _check_count("n_slots", n_slots, hi=cap, what="(the slots allocated at load)")
        rc = _llama_lib().llama_model_moe_cache_set_slots(self._model.model, n)
        if rc == LLAMA_MOE_ERR_BUSY:
            raise RuntimeError("set_moe_cache_slots was called during a generation; call it between generations")
        if rc < 0:
            raise ValueError(f"n_slots={n_slots} was refused; accepted: 0 .. {cap} (the slots allocated at load)")
        return rc
