// pybmoe: the stream tier's start-up: which layers it streams, the budget (fixed or auto from
// available memory, floor, ceiling, the mechanical minimum), the reservations the expert tensors are
// rebound to, the read lanes, the preamble and the cliff guard. See llama-moe-stream.h.
//
// Holds: load-time decisions and their log lines. Must not hold: anything that runs per step
// (llama-moe-stream.cpp).

#include "llama-moe-fit.h"
#include "llama-moe-governor.h"
#include "llama-moe-memory.h"
#include "llama-moe-model.h"
#include "llama-moe-stream-sizing.h"
#include "llama-moe-switches.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>

#if !defined(_WIN32)
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#include <sched.h>
#endif

// the CPUs this process may run on (its affinity mask; a container's CPU quota is not counted), >= 1
static int32_t llama_moe_online_cpus() {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
        return CPU_COUNT(&set);
    }
#endif
    return (int32_t) std::max(1u, std::thread::hardware_concurrency());
}

// CPU buffers whose bytes are the GGUF's (a repacked layout is not)
static bool llama_moe_buft_holds_gguf_layout(ggml_backend_buffer_type_t buft) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    const char * name = ggml_backend_buft_name(buft);
    if (dev != nullptr && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        return ggml_backend_buft_is_host(buft); // a device's pinned host memory
    }
    return strcmp(name, "CPU") == 0 || strcmp(name, "CPU_Mapped") == 0;
}

static_assert(LLAMA_MOE_STREAM_SIZING_FLOOR_MIN_MIB == LLAMA_MOE_STREAM_FLOOR_MIN_MIB, "llama-moe.h and the sizing agree");
static_assert(LLAMA_MOE_STREAM_SIZING_FLOOR_MAX_MIB == LLAMA_MOE_STREAM_FLOOR_MIB_DEFAULT, "llama-moe.h and the sizing agree");

// the host-resident MoE layers whose expert bytes are the GGUF's: `ils`; one WARN per reason for the others
static void llama_moe_stream_pick_layers(const llama_model * model, const llama_moe_tiers * mc, int32_t n_expert,
                                         std::vector<int> & ils, int & n_moe) {
    std::map<std::string, std::vector<int>> not_streamed; // reason -> layers
    n_moe = 0;
    for (int il = 0; il < (int) model->layers.size(); ++il) {
        const auto & layer = model->layers[il];
        if (!llama_moe_is_moe_layer(layer)) {
            continue;
        }
        n_moe++;
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        const int n_proj = llama_moe_layer_exps(layer, exps);
        if (n_proj == 0) {
            not_streamed["the layer has no down experts"].push_back(il);
            continue;
        }
        ggml_backend_buffer_type_t ebuft = ggml_backend_buffer_get_type(exps[0]->buffer);
        ggml_backend_dev_t edev = ggml_backend_buft_get_device(ebuft);
        if (!ggml_backend_buft_is_host(ebuft) && edev != nullptr && ggml_backend_dev_type(edev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            continue; // experts on a device: not the host's to stream
        }
        bool ok = true;
        for (int p = 0; p < n_proj; ++p) {
            ok = ok && llama_moe_buft_holds_gguf_layout(ggml_backend_buffer_get_type(exps[p]->buffer));
        }
        if (!ok) {
            not_streamed[format("the experts are in buffer type %s, whose layout is not the GGUF's (CPU repack); run with "
                    "--no-repack", ggml_backend_buft_name(ebuft))].push_back(il);
            continue;
        }
        for (int p = 0; p < n_proj; ++p) {
            const auto it = mc->sources.tensors.find(ggml_get_name(exps[p]));
            ok = ok && it != mc->sources.tensors.end() && exps[p]->ne[2] == n_expert &&
                 it->second.nbytes == exps[p]->nb[2] * (size_t) n_expert && ggml_is_contiguous(exps[p]);
        }
        if (!ok) {
            not_streamed["expert tensors have no GGUF source of their layout"].push_back(il);
            continue;
        }
        ils.push_back(il);
    }
    for (const auto & [why, v] : not_streamed) {
        std::string list;
        for (int il : v) {
            list += (list.empty() ? "" : ",") + std::to_string(il);
        }
        LLAMA_LOG_WARN("%s: moe-stream: WARNING %zu layer(s) not streamed (%s): %s\n", __func__, v.size(), list.c_str(), why.c_str());
    }
}

// the streamed experts' shape: an entry is one expert of one layer, all its projections
struct llama_moe_stream_shape {
    size_t  entry      = 0; // the largest layer's entry, bytes
    int64_t total      = 0; // every streamed expert, bytes
    double  cycle      = 0; // every streamed layer's top-k experts, bytes (the cache cycle)
    int     n_proj_max = 1;
};

static llama_moe_stream_shape llama_moe_stream_measure(const llama_model * model, const std::vector<int> & ils,
                                                       int32_t n_expert, int32_t n_used) {
    llama_moe_stream_shape s;
    for (int il : ils) {
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        const int n_proj = llama_moe_layer_exps(model->layers[il], exps);
        s.n_proj_max = std::max(s.n_proj_max, n_proj);
        size_t e = 0;
        for (int p = 0; p < n_proj; ++p) {
            e += exps[p]->nb[2];
        }
        s.entry  = std::max(s.entry, e);
        s.total += (int64_t) e * n_expert;
        s.cycle += (double) e * std::min(n_used, n_expert);
    }
    return s;
}

// the dense weights in host memory: every token touches them (BigMoeOnEdge's auto over-asks when it sizes
// before them)
static int64_t llama_moe_host_dense_bytes(const llama_model * model) {
    int64_t dense = 0;
    for (const auto & [name, t] : model->tensors_by_name) {
        if (t->buffer != nullptr && ggml_backend_buffer_is_host(t->buffer) && name.find("_exps.weight") == std::string::npos) {
            dense += (int64_t) ggml_nbytes(t);
        }
    }
    return dense;
}

static int64_t llama_moe_page_bytes() {
#if !defined(_WIN32)
    return (int64_t) sysconf(_SC_PAGESIZE);
#else
    return 4096;
#endif
}

// the memory to add, MiB, for `lack` bytes more room: what grows with the memory is counted (auto's prefetch
// window, an eighth of the room; the server's prompt cache, a sixteenth of the budget; the floor, a
// sixteenth of a limit over 1 GiB), so a third more, and 2 MiB for the process's own use, which moves
// from run to run. The lines that refuse name it as the memory that runs
static int64_t llama_moe_stream_more_mib(int64_t lack) {
    return (lack * 4 / 3 + (1 << 20) - 1) / (1 << 20) + 2;
}

// the sizing's lines: auto's arithmetic, or why the budget is refused. false: refused (a load error)
static bool llama_moe_stream_log_sizing(const llama_moe_stream_sizing_input & in, const llama_moe_stream_sizing & sz,
                                        const llama_moe_stream & st, const llama_moe_mem_avail & m, int32_t ceil_mib,
                                        int32_t n_ubatch) {
    const double mib = 1024.0 * 1024.0;
    const int64_t least_bytes = in.least_entries * in.entry_bytes;
    const int64_t min_bytes   = in.min_entries * in.entry_bytes;
    const int64_t window      = sz.prefetch_entries * in.entry_cost;
    if (!in.is_auto) {
        const int32_t budget_mib = (int32_t) (in.budget_bytes >> 20);
        if (sz.status == LLAMA_MOE_STREAM_UNDER_MINIMUM && st.waves_on) {
            LLAMA_LOG_ERROR("%s: moe-stream: %d MiB is under the mechanical minimum of %.1f MiB: one token's top-%d "
                    "experts beside the expert waves' window of %lld, %lld experts of %.2f MiB; give at least %lld MiB\n",
                    __func__, budget_mib, least_bytes / mib, st.n_used, (long long) st.wave_entries,
                    (long long) in.least_entries, in.entry_bytes / mib, (long long) ((least_bytes + (1 << 20) - 1) >> 20));
        } else if (sz.status == LLAMA_MOE_STREAM_UNDER_MINIMUM) {
            LLAMA_LOG_ERROR("%s: moe-stream: %d MiB is under the mechanical minimum of %.1f MiB: one layer step at ubatch %d "
                    "can need min(n_expert %d, top-k %d x %d tokens) = %lld experts of %.2f MiB; give at least %lld MiB "
                    "or a smaller -ub\n", __func__, budget_mib, min_bytes / mib, n_ubatch, in.n_expert, st.n_used, n_ubatch,
                    (long long) in.min_entries, in.entry_bytes / mib, (long long) ((min_bytes + (1 << 20) - 1) >> 20));
        } else if (sz.clamped_to_total) {
            LLAMA_LOG_INFO("%s: moe-stream: %d MiB is more than every streamed expert (%.1f MiB); clamped to that\n",
                    __func__, budget_mib, in.total_bytes / mib);
        }
        return sz.status == LLAMA_MOE_STREAM_SIZED;
    }
    std::string note;
    if (sz.floor_gave_way) {
        // a line of its own at WARN: the server's verbosity shows it (a floor given, or auto's)
        LLAMA_LOG_WARN("%s: moe-stream: WARNING the floor of %.0f MiB%s leaves less than the tier's minimum: auto takes the minimum "
                "(%.1f MiB) and leaves %.0f MiB free\n", __func__, sz.floor_asked / mib,
                in.floor_bytes >= 0 ? " (--moe-stream-floor-mb)" : "", min_bytes / mib, sz.floor_bytes / mib);
    }
    if (sz.in_waves) {
        note += format("; under one layer step's largest set (%lld experts at ubatch %d): a step that needs more "
                "reads the rest in expert waves while the layer computes", (long long) in.min_entries, n_ubatch);
    }
    LLAMA_LOG("%s: moe-stream: auto: %s -> %.0f MiB available - %.0f MiB dense weights in host memory - %.0f MiB "
            "prefetch window (%lld experts) - %.0f MiB floor%s%s -> %lld experts of %.3f MiB (+%.0f KiB page rounding each) = budget %.0f MiB (experts %.0f MiB, "
            "minimum %.0f MiB); each context's host memory (KV cache, compute, output) is set aside when it is "
            "created%s\n", __func__, m.describe().c_str(), m.avail() / mib, in.dense_bytes / mib,
            (double) window / mib, (long long) sz.prefetch_entries, sz.floor_asked / mib,
            in.floor_bytes < 0 ? format(" (auto: 1/16 of the %.0f MiB %s, %d .. %d MiB)", in.limit_bytes / mib,
                    m.cgroup_limit ? "limit" : "of RAM", LLAMA_MOE_STREAM_FLOOR_MIN_MIB,
                    LLAMA_MOE_STREAM_FLOOR_MIB_DEFAULT).c_str() : "",
            ceil_mib > 0 ? format(", ceil %d MiB", ceil_mib).c_str() : "", (long long) sz.entries, in.entry_bytes / mib,
            (in.entry_cost - in.entry_bytes) / 1024.0, sz.budget_bytes / mib, in.total_bytes / mib, min_bytes / mib, note.c_str());
    if (sz.status == LLAMA_MOE_STREAM_UNDER_MINIMUM) {
        // the least memory that loads the tier: what is missing on top of the limit (the contexts come beside it)
        const int64_t need  = in.least_entries * in.entry_cost + ((int64_t) LLAMA_MOE_STREAM_FLOOR_MIN_MIB << 20);
        const int64_t short_mib = llama_moe_stream_more_mib(need - sz.room_bytes); // the room may be < 0
        const std::string least_limit = m.cgroup_limit
            ? format("a memory limit of %lld MiB loads it", (long long) ((in.limit_bytes >> 20) + short_mib))
            : format("%lld MiB more available memory loads it", (long long) short_mib);
        LLAMA_LOG_ERROR("%s: moe-stream: auto: %.0f MiB available - %.0f MiB dense weights - %.0f MiB prefetch window "
                "leaves %.0f MiB, under the "
                "mechanical minimum of %.1f MiB (%lld experts of %.2f MiB: %s) "
                "plus %d MiB; %s, and each context's host memory comes beside it (the fit line then says how much)%s\n", __func__,
                m.avail() / mib, in.dense_bytes / mib, (double) window / mib, std::max<int64_t>(sz.room_bytes, 0) / mib,
                least_bytes / mib, (long long) in.least_entries, in.entry_bytes / mib,
                st.waves_on ? format("top-k %d and the expert waves' window of %lld", st.n_used, (long long) st.wave_entries).c_str()
                            : format("the most one layer step needs at ubatch %d", n_ubatch).c_str(),
                LLAMA_MOE_STREAM_FLOOR_MIN_MIB, least_limit.c_str(), st.waves_on ? "" : "; or a smaller -ub");
    }
    return sz.status == LLAMA_MOE_STREAM_SIZED;
}

// reservations: each expert tensor is rebound to anonymous memory of its size, committed as experts are
// read, so that experts sit at their offsets e * nb[2] and nothing else changes. false: the tier is OFF
static bool llama_moe_stream_reserve(llama_moe_stream & st, const llama_model * model, const llama_moe_tiers * mc,
                                     const std::vector<int> & ils) {
    const double mib = 1024.0 * 1024.0;
    st.layer_of_il.assign(model->layers.size(), -1);
    for (int il : ils) {
        llama_moe_stream_layer l;
        l.il = il;
        l.li = (int32_t) st.layers.size();
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        l.n_proj = llama_moe_layer_exps(model->layers[il], exps);
        for (int p = 0; p < l.n_proj; ++p) {
            l.exps[p] = const_cast<ggml_tensor *>(exps[p]);
            l.src[p]  = mc->sources.tensors.at(ggml_get_name(exps[p]));
            l.expert_nbytes[p] = exps[p]->nb[2];
#if !defined(_WIN32)
            const size_t page = (size_t) sysconf(_SC_PAGESIZE);
            // the tensor starts at its file offset's place in a 4 KiB block; one block of slack after it
            const size_t lead = l.src[p].offs & 4095;
            l.region_bytes[p] = (lead + ggml_nbytes(exps[p]) + 4096 + page - 1) & ~(page - 1);
            void * r = mmap(nullptr, l.region_bytes[p], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (r == MAP_FAILED) {
                LLAMA_LOG_ERROR("%s: moe-stream: cannot reserve %.1f MiB of address space for %s; the stream tier is OFF\n",
                        __func__, l.region_bytes[p] / mib, ggml_get_name(exps[p]));
                st.layers.push_back(std::move(l));
                st.unmap();
                st.layers.clear();
                return false;
            }
            l.region[p] = r;
            l.base[p] = (uint8_t *) r + lead;
#endif
        }
        st.layer_of_il[il] = l.li;
        st.layers.push_back(std::move(l));
    }
    return true;
}

// page frames (llama-moe-frames.h), one pool per projection: an entry's interior pages there in one frame.
// Each mapped interior splits its reservation into up to 2 more mappings (and, moved, its frame's place in
// the park into up to 2 more); the frames stop at a quarter of vm.max_map_count (65530 by default), so that
// the process keeps most of it (an entry past that keeps anonymous pages). PYBMOE_MOE_STREAM_FRAMES=0 turns
// them off, =memfd maps memfd pages instead of moving anonymous ones (the A/Bs of docs/stream-tier.md)
static void llama_moe_stream_frames_init(llama_moe_stream & st, llama_moe_frames_mode mode, int32_t n_expert, int n_proj_max) {
    const size_t pg = (size_t) llama_moe_page_bytes();
    int64_t max_map_count = 65530;
    if (FILE * f = fopen("/proc/sys/vm/max_map_count", "r")) {
        long long v = 0;
        if (fscanf(f, "%lld", &v) == 1 && v > 0) {
            max_map_count = v;
        }
        fclose(f);
    }
    const int64_t n_entries  = (int64_t) n_expert * (int64_t) st.layers.size();
    const bool    fr_memfd   = mode == LLAMA_MOE_FRAMES_MEMFD;
    const bool    fr_off     = mode == LLAMA_MOE_FRAMES_OFF;
    const int64_t max_frames = std::min<int64_t>(n_entries, max_map_count / 4 / std::max(1, (fr_memfd ? 2 : 4) * n_proj_max));
    std::string why;
    size_t frame_bytes = 0;
    bool on = !fr_off;
    for (int p = 0; on && p < n_proj_max; ++p) {
        size_t most = 0;
        for (const auto & l : st.layers) {
            if (p < l.n_proj) {
                most = std::max(most, l.expert_nbytes[p] / pg);
            }
        }
        on = st.frames[p].init(n_entries, most, max_frames, fr_memfd, why);
        frame_bytes += most * pg;
    }
    if (!on) {
        for (auto & f : st.frames) {
            f.close();
        }
    }
    if (fr_off) {
        LLAMA_LOG("%s: moe-stream: page frames off (PYBMOE_MOE_STREAM_FRAMES=0): each miss faults in fresh pages\n", __func__);
    } else if (on) {
        LLAMA_LOG("%s: moe-stream: page frames: an evicted expert's %.0f KiB of whole pages go to a later miss (%s), "
                "up to %lld experts (a quarter of vm.max_map_count %lld)\n", __func__, frame_bytes / 1024.0,
                st.frames[0].moves() ? "moved" : fr_memfd ? "memfd, PYBMOE_MOE_STREAM_FRAMES=memfd" : "memfd: this kernel has no MREMAP_DONTUNMAP", (long long) max_frames, (long long) max_map_count);
    } else {
        LLAMA_LOG_WARN("%s: moe-stream: WARNING no page frames (%s): each miss faults in fresh pages, which costs CPU\n",
                __func__, why.c_str());
    }
}

// reads behind compute (llama-moe-inflight.h): the layer's MUL_MAT_IDs wait for each expert's bytes.
// PYBMOE_MOE_STREAM_OVERLAP=1 on, 0 off, unset or auto: on while the contexts' compute threads leave a CPU
// to the read lanes (llama_moe_stream::update_overlap); timed where every core computes (llama-moe-overlap.h;
// docs/stream-tier.md, "Reads behind compute" has the measurements). Also the waves' callbacks
static void llama_moe_stream_overlap_init(llama_moe_stream & st, const llama_moe_stream_switches & sw, bool hook,
                                          int32_t n_expert) {
    st.overlap_auto = sw.overlap < 0;
    st.n_cpus       = llama_moe_online_cpus();
    st.overlap      = sw.overlap != 0 && hook;
    if (sw.overlap_trial > 0) {
        st.overlap_trial.n_each = sw.overlap_trial;
    }
    if (st.overlap || st.waves_on) { // the flags and the hook's map, only when they may be used
        st.inflight.init((int64_t) n_expert * (int64_t) st.layers.size(), LLAMA_MOE_N_PROJ);
        for (const auto & l : st.layers) {
            for (int p = 0; p < l.n_proj; ++p) {
                st.inflight.register_tensor(l.exps[p], l.li, p, n_expert);
            }
        }
    }
    if (st.waves_on) {
        llama_moe_stream * tier = &st;
        st.waves.window = (int32_t) st.wave_entries;
        st.waves.read = [tier](int32_t li, int32_t p, const std::vector<int32_t> & e) { tier->wave_read(li, p, e); };
        st.waves.drop = [tier](int32_t li, int32_t p, const std::vector<int32_t> & e) { tier->wave_drop(li, p, e); };
        st.inflight.waves = &st.waves;
    }
    if (st.overlap && !st.overlap_auto) {
        LLAMA_LOG("%s: moe-stream: reads behind compute (PYBMOE_MOE_STREAM_OVERLAP=1): a decode step's misses are read "
                "while the layer computes, each expert waited for by the MUL_MAT_ID that needs it\n", __func__);
    } else if (sw.overlap == 1) {
        LLAMA_LOG_WARN("%s: moe-stream: WARNING PYBMOE_MOE_STREAM_OVERLAP=1, but the CPU backend has no MUL_MAT_ID wait "
                "hook (patch 0033): each layer step reads its misses before the layer computes\n", __func__);
    }
}

// the tier's start line and its preamble (one line, key=value: pybmoe.engine parses it)
static void llama_moe_stream_log_start(const llama_moe_stream & st, const llama_moe_tiers * mc, int n_moe, int32_t n_expert,
                                       const llama_moe_stream_shape & shape, const llama_moe_stream_switches & sw) {
    const double mib = 1024.0 * 1024.0;
    const size_t entry = shape.entry;
    const int64_t min_entries = st.min_bytes / (int64_t) entry;
    const int64_t prefetch    = st.prefetch_entries;
    const int64_t budget      = st.budget_bytes;
    const char *  policy      = sw.scan_guard ? "global-lru-scan" : "global-lru";
    LLAMA_LOG("llama_moe_stream_init: moe-stream: %zu of %d MoE layers stream their experts from %s%s: budget %.1f MiB (%lld experts of "
            "%.3f MiB%s), policy %s, %d read lanes, %s; streamed experts keep the GGUF layout (no CPU repack)\n",
            st.layers.size(), n_moe, mc->sources.paths[0].c_str(), mc->sources.paths.size() > 1 ? " and its splits" : "",
            budget / mib, (long long) st.lru.capacity, entry / mib,
            (prefetch > 0 ? format("; decode also holds the prefetch window's %lld", (long long) prefetch) : std::string()).append(
                budget < st.min_bytes ? format("; under one layer step's largest set of %lld experts: the rest of such a step "
                    "is read in expert waves, %lld experts ahead of the compute in each projection", (long long) min_entries,
                    (long long) st.wave_entries) : std::string()).c_str(),
            policy, st.reader.n_lanes, st.reader.direct ? "O_DIRECT" : "buffered");
    LLAMA_LOG("moe-stream-preamble: layers=%zu n_expert=%d top_k=%d budget_mb=%.2f cache_cycle_mb=%.2f layer_demand_mb=%.2f "
            "min_mb=%.2f least_mb=%.2f wave_experts=%lld direct_io=%d io_threads=%d entry_mb=%.4f prefetch_experts=%lld overlap=%s\n",
            st.layers.size(), n_expert, st.n_used, budget / mib, shape.cycle / mib, entry * std::min(st.n_used, n_expert) / mib,
            st.min_bytes / mib, st.least_bytes() / (int64_t) entry * (int64_t) entry / mib, (long long) st.wave_entries,
            st.reader.direct ? 1 : 0, st.reader.n_lanes, entry / mib, (long long) prefetch,
            !st.overlap ? "0" : st.overlap_auto ? "auto" : "1");
}

// the checks before anything is decided: 0 to go on, else init's result (0: off, inert; < 0: an error)
static int32_t llama_moe_stream_check(const llama_model * model, int32_t budget_mib, int32_t floor_mib, int32_t ceil_mib,
                                      int32_t io_threads, int32_t n_ubatch, bool & go) {
    go = false;
    const bool is_auto = budget_mib == LLAMA_MOE_STREAM_AUTO;
    if (model == nullptr) {
        LLAMA_LOG_ERROR("llama_moe_stream_init: moe-stream: no model\n");
        return -1;
    }
    if ((budget_mib < 0 && !is_auto) || (floor_mib < 0 && floor_mib != LLAMA_MOE_STREAM_FLOOR_AUTO) || ceil_mib < 0 || io_threads < 1 || io_threads > LLAMA_MOE_STREAM_IO_THREADS_MAX || n_ubatch < 1) {
        LLAMA_LOG_ERROR("llama_moe_stream_init: moe-stream: budget (%d MiB), floor (%d MiB; -1 = auto) and ceiling (%d MiB) must be >= 0, io threads (%d) "
                "1 .. 64 and the ubatch (%d) >= 1\n", budget_mib, floor_mib, ceil_mib, io_threads, n_ubatch);
        return -1;
    }
    if (budget_mib == 0) {
        return 0;
    }
    if (model->hparams.n_expert == 0) {
        LLAMA_LOG_WARN("llama_moe_stream_init: moe-stream: model has no MoE layers; --moe-stream-cache-mb is inert\n");
        return 0;
    }
    const llama_moe_tiers * mc = model->moe_cache;
    if (mc == nullptr || mc->sources.empty()) {
        LLAMA_LOG_ERROR("llama_moe_stream_init: moe-stream: the model was not loaded from a GGUF file path, so expert bytes have no "
                "source; the stream tier is OFF\n");
        return -1;
    }
    if (mc->stream.on()) {
        LLAMA_LOG_ERROR("llama_moe_stream_init: moe-stream: already on\n");
        return -1;
    }
    go = true;
    return 0;
}

// the C API's init, in steps: checks and switches -> layer selection -> sizing (a pure plan,
// llama-moe-stream-sizing.h) -> reservations, read lanes, page frames, reads behind compute -> the tier in
// place -> its lines
int32_t llama_moe_stream_init(llama_model * model, int32_t budget_mib, int32_t floor_mib, int32_t ceil_mib,
                              int32_t io_threads, int32_t n_ubatch) {
    bool go = false;
    if (const int32_t rc = llama_moe_stream_check(model, budget_mib, floor_mib, ceil_mib, io_threads, n_ubatch, go); !go) {
        return rc;
    }
    llama_moe_stream_switches sw;
    std::string err;
    std::vector<std::string> warns;
    if (!llama_moe_stream_switches_read(sw, err, warns)) {
        LLAMA_LOG_ERROR("%s: moe-stream: %s\n", __func__, err.c_str());
        return -1;
    }
    for (const auto & w : warns) {
        LLAMA_LOG_WARN("%s: moe-stream: WARNING %s\n", __func__, w.c_str());
    }
    llama_moe_tiers * mc = model->moe_cache;
    auto & st = mc->stream;
    const int32_t n_expert = (int32_t) model->hparams.n_expert;
    const int32_t n_used   = (int32_t) model->hparams.n_expert_used();

    std::vector<int> ils;
    int n_moe = 0;
    llama_moe_stream_pick_layers(model, mc, n_expert, ils, n_moe);
    if (n_moe == 0) {
        // a dense architecture whose GGUF carries an expert count (upstream's ernie4_5, paddleocr)
        LLAMA_LOG_WARN("%s: moe-stream: model has no MoE layers; --moe-stream-cache-mb is inert\n", __func__);
        return 0;
    }
    if (ils.empty()) {
        LLAMA_LOG_WARN("%s: moe-stream: WARNING --moe-stream-cache-mb was given but none of the %d MoE layers has "
                "host-resident experts in the GGUF layout; the stream tier is OFF\n", __func__, n_moe);
        return -1;
    }

    // sizing. Expert waves (llama-moe-waves.h): a budget under one layer step's largest set runs the steps that
    // need more than it holds in waves, reading 2 experts per read lane ahead of the layer's slowest compute
    // thread in each projection; the least budget is then one token's top-k beside that window. They need patch
    // 0033's hook in the CPU backend
    const llama_moe_stream_shape shape = llama_moe_stream_measure(model, ils, n_expert, n_used);
    const int64_t min_entries = std::min<int64_t>(n_expert, (int64_t) n_used * n_ubatch);
    const bool    hook        = llama_moe_inflight::install();
    st.waves_on     = hook && sw.waves && min_entries > n_used;
    st.wave_entries = st.waves_on ? std::min<int64_t>(2 * (int64_t) io_threads, n_expert) : 0;
    st.n_used       = n_used;
    st.entry_bytes  = shape.entry;
    st.min_bytes    = min_entries * (int64_t) shape.entry;

    const llama_moe_mem_avail m = llama_moe_read_mem_avail();
    llama_moe_stream_sizing_input in;
    in.is_auto        = budget_mib == LLAMA_MOE_STREAM_AUTO;
    in.budget_bytes   = in.is_auto ? 0 : (int64_t) budget_mib << 20;
    in.floor_bytes    = floor_mib == LLAMA_MOE_STREAM_FLOOR_AUTO ? -1 : (int64_t) floor_mib << 20;
    in.ceil_bytes     = (int64_t) ceil_mib << 20;
    in.avail_bytes    = (int64_t) m.avail();
    in.limit_bytes    = (int64_t) m.limit();
    in.dense_bytes    = llama_moe_host_dense_bytes(model);
    in.entry_bytes    = (int64_t) shape.entry;
    // an entry commits up to one partial page at each end of each projection beyond its bytes (the read lanes
    // read in place and hold no buffers: llama_moe_read::in_place)
    in.entry_cost     = (int64_t) shape.entry + 2 * llama_moe_page_bytes() * shape.n_proj_max;
    in.n_entries      = (int64_t) n_expert * (int64_t) ils.size();
    in.total_bytes    = shape.total;
    in.n_expert       = n_expert;
    in.min_entries    = min_entries;
    in.least_entries  = st.least_bytes() / (int64_t) shape.entry;
    in.prefetch_set   = sw.prefetch_set;
    in.prefetch_asked = sw.prefetch;
    const llama_moe_stream_sizing sz = llama_moe_stream_size(in);
    if (!llama_moe_stream_log_sizing(in, sz, st, m, ceil_mib, n_ubatch)) {
        return LLAMA_MOE_STREAM_ERR_BUDGET;
    }
    st.avail_bytes       = in.avail_bytes;
    st.limit_bytes       = in.limit_bytes;
    st.dense_bytes       = in.dense_bytes;
    st.entry_cost        = in.entry_cost;
    st.prefetch_entries  = sz.prefetch_entries;
    st.is_auto           = in.is_auto;
    st.floor_bytes       = sz.floor_bytes;
    st.cycle_bytes       = (int64_t) shape.cycle;
    st.auto_room_entries = sz.room_entries;
    st.auto_cap_entries  = sz.cap_entries;
    st.elastic           = sw.elastic;
    st.gov_step          = llama_moe_governor_step(in.entry_cost, in.total_bytes);

    if (!llama_moe_stream_reserve(st, model, mc, ils)) {
        return -1;
    }
    if (!st.reader.open(mc->sources.paths, io_threads, /*want_direct =*/ true, sw.no_odirect, err)) {
        LLAMA_LOG_ERROR("%s: moe-stream: cannot open %s to read experts; the stream tier is OFF\n", __func__, err.c_str());
        st.unmap();
        st.layers.clear();
        return -1;
    }
    if (!st.reader.fallback_reason.empty()) {
        LLAMA_LOG_WARN("%s: moe-stream: WARNING %s: reading experts through the page cache (buffered) instead\n",
                __func__, st.reader.fallback_reason.c_str());
    }
    llama_moe_stream_frames_init(st, sw.frames, n_expert, shape.n_proj_max);
    llama_moe_stream_overlap_init(st, sw, hook, n_expert);

    // only now, with everything in place: the tensors read from the reservations
    for (auto & l : st.layers) {
        for (int p = 0; p < l.n_proj; ++p) {
            l.exps[p]->data = l.base[p];
        }
    }
    st.budget_bytes = sz.budget_bytes;
    st.total_bytes  = shape.total;
    st.n_ubatch     = n_ubatch;
    st.lru.init((int32_t) st.layers.size(), n_expert, st.lru_entries(sz.budget_bytes));
    st.lru.scan_guard = sw.scan_guard;
    // the prefetch window's entries hold decode's experts while no step wants half of its layer: a step that
    // does evicts down to the budget first, and its prefetch then reads into the window (docs/stream-tier.md,
    // "Prefetch")
    st.lru.lend = sz.prefetch_entries;
#if !defined(_WIN32)
    rusage ru = {};
    getrusage(RUSAGE_SELF, &ru);
    st.majflt_at_start = ru.ru_majflt;
#endif
    llama_moe_stream_log_start(st, mc, n_moe, n_expert, shape, sw);
    if (!in.is_auto) {
        // a budget that does not fit beside the contexts is clamped when they are known (the fit, or each
        // context as it is created: clamp_fixed), before any step reads an expert
        st.fixed_bytes = sz.budget_bytes;
        st.fixed_asked = (int64_t) budget_mib << 20;
        st.fixed_said  = st.budget_bytes;
        if (st.avail_bytes > 0 && st.fixed_room(0) < st.budget_bytes) {
            // over what fits before any context: down to that now, so that what is sized from the budget before
            // the contexts (the server's prompt cache) sees what can run, as under auto; the clamp beside the
            // contexts (the fit, or each context as it comes) says so in its WARN, with the user's figure
            st.resize(std::max(st.fixed_room(0), st.least_bytes()), /*quiet =*/ true);
        }
    }
    st.warn_cycle(INT64_MAX); // the cliff guard (the BigMoeOnEdge seed): the fact, at load
    return (int32_t) st.layers.size();
}

int32_t llama_model_moe_stream_init(llama_model * model, int32_t budget_mib, int32_t floor_mib, int32_t ceil_mib,
                                    int32_t io_threads, int32_t n_ubatch) {
    return llama_moe_stream_init(model, budget_mib, floor_mib, ceil_mib, io_threads, n_ubatch);
}

int32_t llama_model_moe_stream_fit(llama_model * model, uint32_t * n_ctx, uint32_t * n_seq, bool unified, bool user_sized,
                                   uint32_t n_ctx_min, llama_moe_fit_measure_cb measure, void * user_data) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->stream.on() || n_ctx == nullptr || n_seq == nullptr || measure == nullptr) {
        return LLAMA_MOE_FIT_NONE;
    }
    auto & st = mc->stream;
    const double mib = 1024.0 * 1024.0;
    if (st.avail_bytes <= 0) {
        LLAMA_LOG_WARN("%s: moe-stream: fit: the memory available is not known; each context is set aside as it is created\n", __func__);
        return LLAMA_MOE_FIT_NONE;
    }
    llama_moe_fit_input in;
    in.is_auto     = st.is_auto;
    in.fixed_bytes = st.fixed_bytes;
    in.fixed_asked = st.fixed_asked;
    in.room_bytes  = st.shared_room();
    // rather than refuse: auto's floor gives way while 64 MiB stay free (as at init), a fixed budget's all of it
    in.floor_slack_bytes = std::max<int64_t>(0, st.floor_bytes - (st.is_auto ? (int64_t) LLAMA_MOE_STREAM_FLOOR_MIN_MIB << 20 : 0));
    in.entry_bytes = (int64_t) st.entry_bytes;
    in.entry_cost  = st.entry_cost;
    in.cap_bytes   = st.is_auto ? std::min(st.auto_cap_entries * (int64_t) st.entry_bytes, st.total_bytes) : st.total_bytes;
    in.cycle_bytes = st.cycle_bytes;
    in.least_bytes = st.least_bytes();
    in.margin_pct  = LLAMA_MOE_FIT_MARGIN_PCT;
    in.keep_pct    = LLAMA_MOE_FIT_KEEP_PCT;
    in.n_seq       = std::max(1u, *n_seq);
    in.unified     = unified || in.n_seq == 1;
    // the context llama_context will create: upstream's padding, so the plan measures what it will hold
    in.n_ctx       = llama_moe_fit_n_ctx(*n_ctx > 0 ? *n_ctx : model->hparams.n_ctx_train * (in.unified ? 1 : in.n_seq),
                                         in.n_seq, in.unified);
    in.n_ctx_min   = n_ctx_min;
    in.user_sized  = user_sized;
    in.elastic     = st.elastic;
    const auto plan = llama_moe_fit_make_plan(in, [&](uint32_t n, uint32_t s) { return measure(n, s, user_data); });
    const std::string line = llama_moe_fit_describe(in, plan);
    const std::string head = format("%.0f MiB available (limit %.0f MiB) - %.0f MiB dense weights - %.0f MiB prefetch window - "
            "%.0f MiB floor", st.avail_bytes / mib, st.limit_bytes / mib, st.dense_bytes / mib,
            (double) (st.prefetch_entries * st.entry_cost) / mib, st.floor_bytes / mib);
    if (plan.status == LLAMA_MOE_PLAN_UNMEASURED) {
        LLAMA_LOG_WARN("%s: moe-stream: %s\n", __func__, line.c_str());
        return LLAMA_MOE_FIT_NONE;
    }
    if (plan.status == LLAMA_MOE_PLAN_REFUSED) {
        // the least memory that runs this context: what the tier's minimum lacks beside it
        const int64_t least_cost = in.least_bytes / std::max<int64_t>(in.entry_bytes, 1) * in.entry_cost;
        const int64_t short_mib  = llama_moe_stream_more_mib(least_cost - (in.room_bytes + in.floor_slack_bytes - plan.ctx_bytes));
        const bool    limited    = llama_moe_read_mem_avail().cgroup_limit > 0;
        const std::string more   = limited
            ? format("a memory limit of %lld MiB runs it", (long long) ((st.limit_bytes >> 20) + short_mib))
            : format("%lld MiB more available memory runs it", (long long) short_mib);
        LLAMA_LOG_ERROR("%s: moe-stream: %s -> %s; %s\n", __func__, head.c_str(), line.c_str(), (user_sized
                ? format("give a smaller -c (or fewer -np slots, a smaller -ub) or the process more memory (%s)", more.c_str())
                : format("give the process more memory (%s), or a smaller -ub", more.c_str())).c_str());
        return LLAMA_MOE_FIT_ERR_REFUSED;
    }
    LLAMA_LOG("%s: moe-stream: %s -> %s\n", __func__, head.c_str(), line.c_str());
    // the plan's contexts are set aside now: auto's budget and a fixed one's clamp see them before they exist
    // (elastic: as they are empty; the governor yields as they fill)
    st.fit_ctx_bytes = st.elastic && plan.now_bytes >= 0 ? plan.now_bytes : plan.ctx_bytes;
    if (st.is_auto) {
        const int64_t before = st.budget_bytes;
        const int64_t want   = std::max(st.elastic ? plan.budget_now : plan.budget_bytes, st.least_bytes());
        if (want != st.budget_bytes) {
            st.resize(want);
        }
        st.warn_cycle(before);
    } else {
        st.clamp_fixed(st.fit_ctx_bytes);
    }
    if (plan.n_ctx != in.n_ctx || plan.n_seq != in.n_seq) {
        *n_ctx = plan.n_ctx;
        *n_seq = plan.n_seq;
        return LLAMA_MOE_FIT_SHRUNK;
    }
    return plan.status == LLAMA_MOE_PLAN_KEPT ? LLAMA_MOE_FIT_KEPT : LLAMA_MOE_FIT_UNDER_CYCLE;
}
