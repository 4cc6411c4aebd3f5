// pybmoe: the stream tier's start-up: which layers it streams, the budget (fixed or auto from
// available memory, floor, ceiling, the mechanical minimum), the reservations the expert tensors are
// rebound to, the read lanes, the preamble and the cliff guard. See llama-moe-stream.h.
//
// Holds: load-time decisions and their log lines. Must not hold: anything that runs per step
// (llama-moe-stream.cpp).

#include "llama-moe-fit.h"
#include "llama-moe-memory.h"
#include "llama-moe-model.h"

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

int32_t llama_moe_stream_init(llama_model * model, int32_t budget_mib, int32_t floor_mib, int32_t ceil_mib,
                              int32_t io_threads, int32_t n_ubatch) {
    const bool is_auto = budget_mib == LLAMA_MOE_STREAM_AUTO;
    if (model == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-stream: no model\n", __func__);
        return -1;
    }
    if ((budget_mib < 0 && !is_auto) || (floor_mib < 0 && floor_mib != LLAMA_MOE_STREAM_FLOOR_AUTO) || ceil_mib < 0 || io_threads < 1 || io_threads > 64 || n_ubatch < 1) {
        LLAMA_LOG_ERROR("%s: moe-stream: budget (%d MiB), floor (%d MiB; -1 = auto) and ceiling (%d MiB) must be >= 0, io threads (%d) "
                "1 .. 64 and the ubatch (%d) >= 1\n", __func__, budget_mib, floor_mib, ceil_mib, io_threads, n_ubatch);
        return -1;
    }
    if (budget_mib == 0) {
        return 0;
    }
    // the policy: global LRU with the scan guard (llama-moe-residency.h), or plain global LRU
    const char * pol_env = getenv("PYBMOE_MOE_STREAM_POLICY");
    const std::string policy = pol_env && *pol_env ? pol_env : "global-lru-scan";
    if (policy != "global-lru-scan" && policy != "global-lru") {
        LLAMA_LOG_ERROR("%s: moe-stream: PYBMOE_MOE_STREAM_POLICY=%s; accepted: global-lru-scan (the default), global-lru\n",
                __func__, policy.c_str());
        return -1;
    }
    const auto & hp = model->hparams;
    if (hp.n_expert == 0) {
        LLAMA_LOG_WARN("%s: moe-stream: model has no MoE layers; --moe-stream-cache-mb is inert\n", __func__);
        return 0;
    }
    llama_moe_cache * mc = model->moe_cache;
    if (mc == nullptr || mc->sources.empty()) {
        LLAMA_LOG_ERROR("%s: moe-stream: the model was not loaded from a GGUF file path, so expert bytes have no "
                "source; the stream tier is OFF\n", __func__);
        return -1;
    }
    auto & st = mc->stream;
    if (st.on()) {
        LLAMA_LOG_ERROR("%s: moe-stream: already on\n", __func__);
        return -1;
    }
    const int32_t n_expert = (int32_t) hp.n_expert;
    const int32_t n_used   = (int32_t) hp.n_expert_used();

    // the host-resident MoE layers whose expert bytes are the GGUF's
    std::vector<int> ils;
    std::map<std::string, std::vector<int>> not_streamed; // reason -> layers
    int n_moe = 0;
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

    // sizes: an entry is one expert of one layer, all its projections
    size_t  entry   = 0;
    int64_t total   = 0;
    double  cycle   = 0.0;
    int     n_proj_max = 1;
    for (int il : ils) {
        const auto & layer = model->layers[il];
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        const int n_proj = llama_moe_layer_exps(layer, exps);
        n_proj_max = std::max(n_proj_max, n_proj);
        size_t e = 0;
        for (int p = 0; p < n_proj; ++p) {
            e += exps[p]->nb[2];
        }
        entry  = std::max(entry, e);
        total += (int64_t) e * n_expert;
        cycle += (double) e * std::min(n_used, n_expert);
    }
    const int64_t min_entries = std::min<int64_t>(n_expert, (int64_t) n_used * n_ubatch);
    const int64_t min_bytes   = min_entries * (int64_t) entry;
    const double  mib = 1024.0 * 1024.0;

    // expert waves (llama-moe-waves.h): a budget under min_bytes runs the steps that need more than it holds
    // in waves, reading 2 experts per read lane ahead of the layer's slowest compute thread in each projection;
    // the least budget is then one token's top-k beside that window. They need patch 0033's hook in the CPU
    // backend. PYBMOE_MOE_STREAM_WAVES=0 turns them off (the least budget is min_bytes again)
    const char *  wv_env = getenv("PYBMOE_MOE_STREAM_WAVES");
    const bool    hook   = llama_moe_inflight::install();
    st.waves_on     = hook && !(wv_env && atoi(wv_env) == 0) && min_entries > n_used;
    st.wave_entries = st.waves_on ? std::min<int64_t>(2 * (int64_t) io_threads, n_expert) : 0;
    st.n_used       = n_used;
    st.entry_bytes  = entry;
    st.min_bytes    = min_bytes;
    const int64_t least_entries = st.least_bytes() / (int64_t) entry;
    const int64_t least_bytes   = least_entries * (int64_t) entry;

    // what the process needs beside the budget, known at load: the dense weights in host memory (every
    // token touches them; BigMoeOnEdge's auto over-asks when it sizes before them) and the pages an
    // entry's partial pages commit beyond its bytes (the read lanes read in place and hold no buffers:
    // llama_moe_read::in_place). The contexts' KV cache, compute and output buffers are set aside as
    // each context is created (on_context).
    int64_t dense = 0;
    for (const auto & [name, t] : model->tensors_by_name) {
        if (t->buffer != nullptr && ggml_backend_buffer_is_host(t->buffer) && name.find("_exps.weight") == std::string::npos) {
            dense += (int64_t) ggml_nbytes(t);
        }
    }
#if !defined(_WIN32)
    const int64_t page = (int64_t) sysconf(_SC_PAGESIZE);
#else
    const int64_t page = 4096;
#endif
    // an entry commits up to one partial page at each end of each projection beyond its bytes
    const int64_t entry_cost = (int64_t) entry + 2 * page * n_proj_max;

    // the prefetch window (llama-moe-stream.h), when the ubatch allows steps that want half of a layer or more
    // (a prefill): by default a quarter of a layer's experts with a fixed budget; with auto, an eighth of the
    // memory auto sizes from, from a quarter of a layer up to a whole one (on a 4 GiB model under a 1370 MiB
    // limit: prefill +18 % with a quarter, +27 % with a whole layer; each window entry is one entry less of
    // auto's budget: docs/stream-tier.md, "Prefetch"). PYBMOE_MOE_STREAM_PREFETCH: 0 off, 1 a whole layer,
    // N > 1 N experts
    const char * pf_env = getenv("PYBMOE_MOE_STREAM_PREFETCH");
    int64_t prefetch = pf_env ? atoll(pf_env) : -1;
    const int64_t prefetch_min = (n_expert + 3) / 4;
    prefetch = prefetch < 0 ? prefetch_min : prefetch == 1 ? n_expert : std::min<int64_t>(prefetch, n_expert);
    if (2 * min_entries < n_expert) {
        prefetch = 0;
    }

    const llama_moe_mem_avail m = llama_moe_read_mem_avail();
    st.avail_bytes  = (int64_t) m.avail();
    st.limit_bytes  = (int64_t) m.limit();
    st.dense_bytes  = dense;
    st.entry_cost   = entry_cost;
    st.prefetch_entries = prefetch;
    st.is_auto      = is_auto;

    int64_t budget = 0;
    const int64_t limit = (int64_t) m.limit();
    // the floor: what auto leaves free for everything it does not count (code pages, the heap, other
    // processes), and what a fixed budget is clamped to leave. Default: 1/16 of the memory the process lives
    // in (the cgroup's limit, else MemTotal), from 64 MiB up to the BigMoeOnEdge seed's 1536 MiB: 81 MiB in a
    // 1300 MiB container, 1536 MiB on a 24 GiB machine
    const bool floor_auto = floor_mib == LLAMA_MOE_STREAM_FLOOR_AUTO;
    int64_t floor = floor_auto ? std::clamp<int64_t>(limit / 16, (int64_t) LLAMA_MOE_STREAM_FLOOR_MIN_MIB << 20,
            (int64_t) LLAMA_MOE_STREAM_FLOOR_MIB_DEFAULT << 20) : (int64_t) floor_mib << 20;
    st.floor_bytes = floor;
    st.cycle_bytes = (int64_t) cycle;
    if (is_auto) {
        if (pf_env == nullptr && prefetch > 0) {
            const int64_t held = ((int64_t) m.avail() - dense - floor) / entry_cost;
            prefetch = std::clamp<int64_t>(held / 8, prefetch_min, n_expert);
            st.prefetch_entries = prefetch;
        }
        const int64_t room = (int64_t) m.avail() - dense - prefetch * entry_cost;
        const int64_t want = room - floor;
        int64_t room_entries = want > 0 ? want / entry_cost : 0; // what the memory holds, before the caps
        // the caps: the ceiling (a budget, as a fixed one) and every streamed expert
        int64_t cap_entries = (int64_t) n_expert * (int64_t) ils.size();
        if (ceil_mib > 0) {
            cap_entries = std::min<int64_t>(cap_entries, ((int64_t) ceil_mib << 20) / (int64_t) entry);
        }
        int64_t entries = std::min(room_entries, cap_entries);
        std::string note;
        if (entries < min_entries) {
            // a floor larger than the room must not turn auto into a refusal while a working budget exists:
            // the floor shrinks to what is left above the minimum, never below LLAMA_MOE_STREAM_FLOOR_MIN_MIB
            const int64_t left = room - min_entries * entry_cost;
            if (left >= ((int64_t) LLAMA_MOE_STREAM_FLOOR_MIN_MIB << 20) && (ceil_mib == 0 || ((int64_t) ceil_mib << 20) >= min_bytes)) {
                note = format("; WARNING the floor of %.0f MiB leaves less than the minimum, so auto takes the minimum and "
                        "leaves %.0f MiB free", floor / mib, left / mib);
                st.floor_bytes = left;
                entries = min_entries;
                room_entries = min_entries;
            }
        }
        if (entries < min_entries && entries >= least_entries) {
            note += format("; under one layer step's largest set (%lld experts at ubatch %d): a step that needs more "
                    "reads the rest in expert waves while the layer computes", (long long) min_entries, n_ubatch);
        }
        budget = entries * (int64_t) entry;
        LLAMA_LOG("%s: moe-stream: auto: %s -> %.0f MiB available - %.0f MiB dense weights in host memory - %.0f MiB "
                "prefetch window (%lld experts) - %.0f MiB floor%s%s -> %lld experts of %.3f MiB (+%.0f KiB page rounding each) = budget %.0f MiB (experts %.0f MiB, "
                "minimum %.0f MiB); each context's host memory (KV cache, compute, output) is set aside when it is "
                "created%s\n", __func__, m.describe().c_str(), m.avail() / mib, dense / mib,
                (double) (prefetch * entry_cost) / mib, (long long) prefetch, floor / mib,
                floor_auto ? format(" (auto: 1/16 of the %.0f MiB %s, %d .. %d MiB)", limit / mib,
                        m.cgroup_limit ? "limit" : "of RAM", LLAMA_MOE_STREAM_FLOOR_MIN_MIB,
                        LLAMA_MOE_STREAM_FLOOR_MIB_DEFAULT).c_str() : "",
                ceil_mib > 0 ? format(", ceil %d MiB", ceil_mib).c_str() : "", (long long) entries, entry / mib,
                (entry_cost - (int64_t) entry) / 1024.0, budget / mib, total / mib, min_bytes / mib, note.c_str());
        if (entries < least_entries) {
            LLAMA_LOG_ERROR("%s: moe-stream: auto: %.0f MiB available - %.0f MiB dense weights - %.0f MiB prefetch window "
                    "leaves %.0f MiB, under the "
                    "mechanical minimum of %.1f MiB (%lld experts of %.2f MiB: %s) "
                    "plus %d MiB; give the process more memory%s\n", __func__,
                    m.avail() / mib, dense / mib, (double) (prefetch * entry_cost) / mib, std::max<int64_t>(room, 0) / mib,
                    least_bytes / mib, (long long) least_entries, entry / mib,
                    st.waves_on ? format("top-k %d and the expert waves' window of %lld", n_used, (long long) st.wave_entries).c_str()
                                : format("the most one layer step needs at ubatch %d", n_ubatch).c_str(),
                    LLAMA_MOE_STREAM_FLOOR_MIN_MIB, st.waves_on ? "" : " or a smaller -ub");
            return LLAMA_MOE_STREAM_ERR_BUDGET;
        }
        st.auto_room_entries = room_entries;
        st.auto_cap_entries  = cap_entries;
    } else {
        budget = (int64_t) budget_mib << 20;
        if (budget < least_bytes) {
            if (st.waves_on) {
                LLAMA_LOG_ERROR("%s: moe-stream: %d MiB is under the mechanical minimum of %.1f MiB: one token's top-%d "
                        "experts beside the expert waves' window of %lld, %lld experts of %.2f MiB; give at least %lld MiB\n",
                        __func__, budget_mib, least_bytes / mib, n_used, (long long) st.wave_entries,
                        (long long) least_entries, entry / mib, (long long) ((least_bytes + (1 << 20) - 1) >> 20));
            } else {
                LLAMA_LOG_ERROR("%s: moe-stream: %d MiB is under the mechanical minimum of %.1f MiB: one layer step at ubatch %d "
                        "can need min(n_expert %d, top-k %d x %d tokens) = %lld experts of %.2f MiB; give at least %lld MiB "
                        "or a smaller -ub\n", __func__, budget_mib, min_bytes / mib, n_ubatch, n_expert, n_used, n_ubatch,
                        (long long) min_entries, entry / mib, (long long) ((min_bytes + (1 << 20) - 1) >> 20));
            }
            return LLAMA_MOE_STREAM_ERR_BUDGET;
        }
        if (budget > total) {
            LLAMA_LOG_INFO("%s: moe-stream: %d MiB is more than every streamed expert (%.1f MiB); clamped to that\n",
                    __func__, budget_mib, total / mib);
            budget = total;
        }
    }

    // reservations: each expert tensor is rebound to anonymous memory of its size, committed as
    // experts are read, so that experts sit at their offsets e * nb[2] and nothing else changes
    st.layer_of_il.assign(model->layers.size(), -1);
    for (int il : ils) {
        const auto & layer = model->layers[il];
        llama_moe_stream_layer l;
        l.il = il;
        l.li = (int32_t) st.layers.size();
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        l.n_proj = llama_moe_layer_exps(layer, exps);
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
                return -1;
            }
            l.region[p] = r;
            l.base[p] = (uint8_t *) r + lead;
#endif
        }
        st.layer_of_il[il] = l.li;
        st.layers.push_back(std::move(l));
    }
    std::string err;
    if (!st.reader.open(mc->sources.paths, io_threads, /*want_direct =*/ true, err)) {
        LLAMA_LOG_ERROR("%s: moe-stream: cannot open %s to read experts; the stream tier is OFF\n", __func__, err.c_str());
        st.unmap();
        st.layers.clear();
        return -1;
    }
    if (!st.reader.fallback_reason.empty()) {
        LLAMA_LOG_WARN("%s: moe-stream: WARNING %s: reading experts through the page cache (buffered) instead\n",
                __func__, st.reader.fallback_reason.c_str());
    }
    // page frames (llama-moe-frames.h), one pool per projection: an entry's interior pages there in one frame.
    // Each mapped interior splits its reservation into up to 2 more mappings (and, moved, its frame's place
    // in the park into up to 2 more); the frames stop at a quarter of vm.max_map_count (65530 by default), so
    // that the process keeps most of it (an entry past that keeps anonymous pages). PYBMOE_MOE_STREAM_FRAMES=0
    // turns them off, =memfd maps memfd pages instead of moving anonymous ones (the A/Bs of docs/stream-tier.md)
    {
        const size_t pg = (size_t) page;
        int64_t max_map_count = 65530;
        if (FILE * f = fopen("/proc/sys/vm/max_map_count", "r")) {
            long long v = 0;
            if (fscanf(f, "%lld", &v) == 1 && v > 0) {
                max_map_count = v;
            }
            fclose(f);
        }
        const int64_t n_entries  = (int64_t) n_expert * (int64_t) st.layers.size();
        const char * fr_env   = getenv("PYBMOE_MOE_STREAM_FRAMES");
        const bool   fr_memfd = fr_env && strcmp(fr_env, "memfd") == 0;
        const bool   fr_off   = fr_env && !fr_memfd && atoi(fr_env) == 0;
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
    // PYBMOE_MOE_STREAM_OVERLAP=1 on, 0 off, unset or auto: on while the contexts' compute threads leave a
    // CPU to the read lanes (llama_moe_stream::update_overlap), where it did pay (-t 1: +21 % at A, +29 % at
    // B, parity at C against -t 1 blocking); timed where every core computes, where it won on one machine
    // and lost on another (llama-moe-overlap.h; docs/stream-tier.md, "Reads behind compute")
    {
        const char * ov_env = getenv("PYBMOE_MOE_STREAM_OVERLAP");
        const bool   ov_set = ov_env && ov_env[0] != '\0' && strcmp(ov_env, "auto") != 0;
        if (ov_set && strcmp(ov_env, "0") != 0 && strcmp(ov_env, "1") != 0) {
            LLAMA_LOG_WARN("%s: moe-stream: WARNING PYBMOE_MOE_STREAM_OVERLAP=%s; accepted: 0, 1 or auto; using auto\n",
                    __func__, ov_env);
        }
        const bool ov_off  = ov_set && strcmp(ov_env, "0") == 0;
        const bool ov_on   = ov_set && strcmp(ov_env, "1") == 0;
        st.overlap_auto    = !ov_off && !ov_on;
        st.n_cpus          = llama_moe_online_cpus();
        st.overlap = !ov_off && hook;
        // where every CPU computes, auto times its first decode tokens each way (llama-moe-overlap.h)
        if (const char * tr = getenv("PYBMOE_MOE_STREAM_OVERLAP_TRIAL"); tr && tr[0] != '\0') {
            char * end = nullptr;
            const long n = strtol(tr, &end, 10);
            if (*end != '\0' || n < 1 || n > 1000) {
                LLAMA_LOG_WARN("%s: moe-stream: WARNING PYBMOE_MOE_STREAM_OVERLAP_TRIAL=%s; accepted: 1 .. 1000 decode "
                        "tokens each way; using %d\n", __func__, tr, st.overlap_trial.n_each);
            } else {
                st.overlap_trial.n_each = (int32_t) n;
            }
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
        } else if (ov_on) {
            LLAMA_LOG_WARN("%s: moe-stream: WARNING PYBMOE_MOE_STREAM_OVERLAP=1, but the CPU backend has no MUL_MAT_ID wait "
                    "hook (patch 0033): each layer step reads its misses before the layer computes\n", __func__);
        }
    }
    // only now, with everything in place: the tensors read from the reservations
    for (auto & l : st.layers) {
        for (int p = 0; p < l.n_proj; ++p) {
            l.exps[p]->data = l.base[p];
        }
    }
    st.budget_bytes = budget;
    st.total_bytes  = total;
    st.n_ubatch     = n_ubatch;
    st.lru.init((int32_t) st.layers.size(), n_expert, st.lru_entries(budget));
    st.lru.scan_guard = policy == "global-lru-scan";
    // the prefetch window's entries hold decode's experts while no step wants half of its layer: a step that
    // does evicts down to the budget first, and its prefetch then reads into the window (docs/stream-tier.md,
    // "Prefetch")
    st.lru.lend = prefetch;
#if !defined(_WIN32)
    rusage ru = {};
    getrusage(RUSAGE_SELF, &ru);
    st.majflt_at_start = ru.ru_majflt;
#endif

    LLAMA_LOG("%s: moe-stream: %zu of %d MoE layers stream their experts from %s%s: budget %.1f MiB (%lld experts of "
            "%.3f MiB%s), policy %s, %d read lanes, %s; streamed experts keep the GGUF layout (no CPU repack)\n", __func__,
            st.layers.size(), n_moe, mc->sources.paths[0].c_str(), mc->sources.paths.size() > 1 ? " and its splits" : "",
            budget / mib, (long long) st.lru.capacity, entry / mib,
            (prefetch > 0 ? format("; decode also holds the prefetch window's %lld", (long long) prefetch) : std::string()).append(
                budget < min_bytes ? format("; under one layer step's largest set of %lld experts: the rest of such a step "
                    "is read in expert waves, %lld experts ahead of the compute in each projection", (long long) min_entries,
                    (long long) st.wave_entries) : std::string()).c_str(),
            policy.c_str(), st.reader.n_lanes,
            st.reader.direct ? "O_DIRECT" : "buffered");
    // the preamble: one line, key=value (pybmoe.engine parses it)
    LLAMA_LOG("moe-stream-preamble: layers=%zu n_expert=%d top_k=%d budget_mb=%.2f cache_cycle_mb=%.2f layer_demand_mb=%.2f "
            "min_mb=%.2f least_mb=%.2f wave_experts=%lld direct_io=%d io_threads=%d entry_mb=%.4f prefetch_experts=%lld overlap=%s\n",
            st.layers.size(), n_expert,
            n_used, budget / mib, cycle / mib, entry * std::min(n_used, n_expert) / mib, min_bytes / mib, least_bytes / mib,
            (long long) st.wave_entries, st.reader.direct ? 1 : 0, st.reader.n_lanes, entry / mib, (long long) prefetch,
            !st.overlap ? "0" : st.overlap_auto ? "auto" : "1");
    if (!is_auto) {
        // a budget that does not fit beside the contexts is clamped when they are known (the fit, or each
        // context as it is created: clamp_fixed), before any step reads an expert
        st.fixed_bytes = budget;
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
    llama_moe_cache * mc = model ? model->moe_cache : nullptr;
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
    in.n_ctx       = *n_ctx > 0 ? *n_ctx : model->hparams.n_ctx_train * (in.unified ? 1 : in.n_seq);
    in.n_ctx_min   = n_ctx_min;
    in.user_sized  = user_sized;
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
        LLAMA_LOG_ERROR("%s: moe-stream: %s -> %s; %s\n", __func__, head.c_str(), line.c_str(),
                user_sized ? "give a smaller -c (or fewer -np slots, a smaller -ub) or the process more memory"
                           : "give the process more memory, or a smaller -ub");
        return LLAMA_MOE_FIT_ERR_REFUSED;
    }
    LLAMA_LOG("%s: moe-stream: %s -> %s\n", __func__, head.c_str(), line.c_str());
    // the plan's contexts are set aside now: auto's budget and a fixed one's clamp see them before they exist
    st.fit_ctx_bytes = plan.ctx_bytes;
    if (st.is_auto) {
        const int64_t before = st.budget_bytes;
        const int64_t want   = std::max(plan.budget_bytes, st.least_bytes());
        if (want != st.budget_bytes) {
            st.resize(want);
        }
        st.warn_cycle(before);
    } else {
        st.clamp_fixed(plan.ctx_bytes);
    }
    if (plan.n_ctx != in.n_ctx || plan.n_seq != in.n_seq) {
        *n_ctx = plan.n_ctx;
        *n_seq = plan.n_seq;
        return LLAMA_MOE_FIT_SHRUNK;
    }
    return plan.status == LLAMA_MOE_PLAN_KEPT ? LLAMA_MOE_FIT_KEPT : LLAMA_MOE_FIT_UNDER_CYCLE;
}
