// pybmoe: device-resident LRU cache of host-resident MoE experts. See llama-moe-cache.h.

#include "llama-moe-cache.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-model-loader.h"
#include "llama-batch.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#if defined(_WIN32)
#define llama_moe_fseek _fseeki64
#else
#define llama_moe_fseek fseeko
#endif

namespace {

constexpr int LLAMA_MOE_N_PROJ = 3; // the most expert tensors a layer has: up, gate, down (or gate_up, down)
constexpr int LLAMA_MOE_N_BIAS = 4; // the most expert biases a layer has: up, gate, gate_up, down

// the expert tensors a layer multiplies by, in graph order, and their slot-name stems: {up, gate, down},
// {up, down} without a gate, or {gate_up, down} when fused; returns how many (0: not an expert layer)
int llama_moe_proj_list(const ggml_tensor * up, const ggml_tensor * gate, const ggml_tensor * down,
                        const ggml_tensor * gate_up, const ggml_tensor * out[LLAMA_MOE_N_PROJ],
                        const char * names[LLAMA_MOE_N_PROJ] = nullptr) {
    static const char * fused[] = { "gate_up", "down" };
    static const char * sep3 [] = { "up", "gate", "down" };
    static const char * sep2 [] = { "up", "down" };
    int n = 0;
    const char * const * nm = nullptr;
    if (down == nullptr) {
        return 0;
    }
    if (gate_up != nullptr) {
        out[n++] = gate_up; nm = fused;
    } else if (up != nullptr) {
        out[n++] = up;
        if (gate != nullptr) {
            out[n++] = gate; nm = sep3;
        } else {
            nm = sep2;
        }
    } else {
        return 0;
    }
    out[n++] = down;
    for (int p = 0; names && p < n; ++p) {
        names[p] = nm[p];
    }
    return n;
}

enum llama_moe_slot_state : uint8_t {
    LLAMA_MOE_SLOT_FREE,
    LLAMA_MOE_SLOT_UPLOADING, // written by the worker; no table entry points here
    LLAMA_MOE_SLOT_RESIDENT,
};

struct llama_moe_source {
    uint16_t file;    // index into llama_moe_cache::paths
    size_t   offs;    // tensor data offset in that file
    size_t   nbytes;  // whole tensor
};

struct llama_moe_upload {
    int32_t layer; // index into llama_moe_cache::layers
    int32_t expert;
    int32_t slot;
};

} // namespace

struct llama_moe_cache_layer {
    int32_t il        = -1;
    int32_t n_expert  = 0;
    int32_t n_used    = 0;
    int32_t n_slots   = 0; // resident capacity (--moe-expert-cache, or set at runtime)
    int32_t n_cap     = 0; // the slots allocated at load: the most n_slots can be set to
    int32_t n_stage   = 0; // extra physical slots that uploads land in while the residents keep serving
    int32_t n_phys    = 0; // n_slots + n_stage; slot n_phys is the all-zero dummy slot

    // the host tensors this layer caches (key for graph building), see llama_moe_proj_list
    int n_proj = 0;
    const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
    llama_moe_source    src [LLAMA_MOE_N_PROJ] = {};
    size_t              expert_nbytes[LLAMA_MOE_N_PROJ] = {}; // one expert's slice of each tensor

    // companions: device (router's buffer type) and host
    ggml_tensor * slots[LLAMA_MOE_N_PROJ] = {}; // [ne0, ne1, n_phys + 1]
    int n_bias = 0;                                      // llama_moe_bias_list
    const ggml_tensor * bias_host[LLAMA_MOE_N_BIAS] = {}; // the model's expert biases
    ggml_tensor       * bias_dev [LLAMA_MOE_N_BIAS] = {}; // their copies next to the slots
    ggml_tensor * dev_table  = nullptr;         // I32 [1, n_expert]
    ggml_tensor * host_table = nullptr;         // I32 [n_expert]
    ggml_tensor * observed   = nullptr;         // I32 [n_used * max_batch], -1 = not written

    // LRU state (host only; the tables above are published copies of `table`)
    std::vector<int32_t>  table;       // [n_expert] expert -> physical slot, n_phys = not resident
    std::vector<uint64_t> used;        // [n_expert] last step the expert was selected (0 = never)
    std::vector<int32_t>  slot_expert; // [n_phys]   -1 when free
    std::vector<uint8_t>  slot_state;  // [n_phys]   llama_moe_slot_state
    std::vector<int32_t>  misses_now;  // experts missed in the last observed step, in router order
    std::vector<int8_t>   hits_now;    // per lookup of the last observed step: 1 hit, 0 miss
    bool     served_now = false;       // the last ubatch's graph ran this layer through the cache
    uint64_t last_step  = 0;           // step of misses_now
    int32_t  n_resident = 0;           // <= n_slots
    bool     dirty      = false;       // table changed since the last publish

    uint64_t hits   = 0;
    uint64_t misses = 0;

    size_t expert_bytes() const {
        return expert_nbytes[0] + expert_nbytes[1] + expert_nbytes[2];
    }
};

struct llama_moe_cache {
    // sources, recorded at load
    std::vector<std::string> paths;
    std::map<std::string, llama_moe_source> sources;

    // device memory set aside ahead of the cache (the contexts' projected KV + compute), for auto
    std::map<ggml_backend_dev_t, size_t> reserve;

    // configuration
    int32_t n_slots   = 0;
    int32_t n_inserts = 0;
    int32_t max_batch = 1;

    std::vector<llama_moe_cache_layer> layers;
    std::vector<int32_t> layer_of_il; // model layer -> index into layers, -1 when not cached

    ggml_context_ptr         host_ctx;
    ggml_backend_buffer_ptr  host_buf;
    uint64_t alloc_bytes = 0;

    struct device_use {
        std::string name;   // buffer type, e.g. CUDA0, RPC0[host:port]
        int64_t     slots;  // resident slots over the layers on it
        size_t      bytes;  // companion bytes allocated there
    };
    std::vector<device_use> devices;

    // step state
    std::atomic<int32_t> n_busy { 0 }; // graphs being computed (resizing is refused meanwhile)
    mutable std::mutex mutex;
    uint64_t step = 0;
    uint64_t n_steps = 0;
    uint64_t uploads = 0;
    uint64_t upload_bytes = 0;
    std::vector<llama_moe_upload> in_flight; // enqueued at the last step, published at the next

    // upload worker
    std::thread worker;
    std::mutex  q_mutex;
    std::condition_variable q_cv;
    std::condition_variable q_done_cv;
    std::deque<llama_moe_upload> queue;
    int32_t q_busy = 0;
    bool    q_stop = false;
    std::vector<FILE *> files;
    std::vector<uint8_t> staging;

    // routing trace (--moe-trace): every MoE layer's selected ids, written by a writer thread
    struct trace_layer {
        int32_t il;
        int32_t n_used;
        ggml_tensor * obs; // I32 [n_used * trace_cap], -1 = not written
    };
    std::vector<trace_layer> tlayers;
    std::vector<int32_t>     tlayer_of_il;
    ggml_context_ptr         trace_ctx;
    ggml_backend_buffer_ptr  trace_buf;
    int64_t  trace_cap     = 0; // tokens per ubatch the trace buffers hold
    uint64_t trace_ubatch  = 0;
    uint64_t trace_token   = 0;
    FILE *   trace_file    = nullptr;
    std::thread             trace_writer;
    std::mutex              trace_mutex;
    std::condition_variable trace_cv;
    std::deque<std::string> trace_queue;
    bool                    trace_stop = false;

    bool tracing() const {
        return trace_file != nullptr;
    }

    // route replay (--moe-route-replay): every MoE layer takes its selected experts from a trace
    std::vector<int32_t>     rp_ids;        // [n_tok][n_layer][n_used], filled for every MoE layer
    std::vector<int32_t>     rp_tensor_of_il; // model layer -> index into rp_tensors, -1 when not replayed
    std::vector<ggml_tensor *> rp_tensors;  // I32 [n_used, rp_cap] per replayed layer: the next rp_cap tokens
    ggml_context_ptr         rp_ctx;
    ggml_backend_buffer_ptr  rp_buf;
    int64_t  rp_n_tok   = 0;
    int64_t  rp_cap     = 0;
    int32_t  rp_n_layer = 0;
    int32_t  rp_n_used  = 0;
    uint64_t rp_cursor  = 0; // tokens replayed so far (the next token is rp_cursor % rp_n_tok)
    std::string rp_path;

    bool replaying() const {
        return rp_n_tok > 0;
    }

    void trace_push(std::string && rows) {
        {
            std::lock_guard<std::mutex> lock(trace_mutex);
            trace_queue.push_back(std::move(rows));
        }
        trace_cv.notify_one();
    }

    void trace_writer_main() {
        for (;;) {
            std::string rows;
            {
                std::unique_lock<std::mutex> lock(trace_mutex);
                trace_cv.wait(lock, [&] { return trace_stop || !trace_queue.empty(); });
                if (trace_queue.empty()) {
                    return; // stopped and drained
                }
                rows = std::move(trace_queue.front());
                trace_queue.pop_front();
            }
            fwrite(rows.data(), 1, rows.size(), trace_file);
        }
    }

    void trace_close() {
        if (trace_writer.joinable()) {
            {
                std::lock_guard<std::mutex> lock(trace_mutex);
                trace_stop = true;
            }
            trace_cv.notify_all();
            trace_writer.join();
        }
        if (trace_file) {
            fclose(trace_file);
            trace_file = nullptr;
        }
    }

    bool enabled() const {
        return n_slots > 0 && !layers.empty();
    }

    ~llama_moe_cache() {
        trace_close();
        stop_worker();
        for (FILE * f : files) {
            if (f) {
                fclose(f);
            }
        }
    }

    void stop_worker() {
        if (!worker.joinable()) {
            return;
        }
        {
            std::lock_guard<std::mutex> lock(q_mutex);
            q_stop = true;
        }
        q_cv.notify_all();
        worker.join();
    }

    void enqueue(const llama_moe_upload & u) {
        {
            std::lock_guard<std::mutex> lock(q_mutex);
            queue.push_back(u);
        }
        q_cv.notify_one();
    }

    void wait_uploads() {
        std::unique_lock<std::mutex> lock(q_mutex);
        q_done_cv.wait(lock, [&] { return queue.empty() && q_busy == 0; });
    }

    // worker thread: copies one expert's GGUF bytes into a slot of each companion tensor
    void worker_main() {
        for (;;) {
            llama_moe_upload u;
            {
                std::unique_lock<std::mutex> lock(q_mutex);
                q_cv.wait(lock, [&] { return q_stop || !queue.empty(); });
                if (q_stop) {
                    return;
                }
                u = queue.front();
                queue.pop_front();
                q_busy++;
            }
            upload(u);
            {
                std::lock_guard<std::mutex> lock(q_mutex);
                q_busy--;
            }
            q_done_cv.notify_all();
        }
    }

    void upload(const llama_moe_upload & u) {
        const llama_moe_cache_layer & l = layers[u.layer];
        for (int p = 0; p < l.n_proj; ++p) {
            const size_t n = l.expert_nbytes[p];
            staging.resize(n);
            FILE * f = files[l.src[p].file];
            const size_t offs = l.src[p].offs + (size_t) u.expert * n;
            if (llama_moe_fseek(f, (long long) offs, SEEK_SET) != 0 || fread(staging.data(), 1, n, f) != n) {
                // note: the slot stays zero, so the output would be wrong; this is unrecoverable
                GGML_ABORT("moe-cache: cannot read %zu bytes at offset %zu of %s", n, offs, paths[l.src[p].file].c_str());
            }
            ggml_backend_tensor_set(l.slots[p], staging.data(), (size_t) u.slot * l.slots[p]->nb[2], n);
        }
    }
};

namespace {

void llama_moe_log_once(const char * key, const char * fmt, ...) {
    static std::mutex m;
    static std::map<std::string, bool> seen;
    {
        std::lock_guard<std::mutex> lock(m);
        if (seen[key]) {
            return;
        }
        seen[key] = true;
    }
    char buf[512];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    if (strncmp(buf, "WARNING", 7) == 0) {
        LLAMA_LOG_WARN("moe-cache: %s\n", buf); // the cache is not serving something it was asked to
    } else {
        LLAMA_LOG_INFO("moe-cache: %s\n", buf);
    }
}

// a MoE layer: a router and experts (separate or fused gate_up); the cache, the trace and route
// replay all take their layers from this test
bool llama_moe_is_moe_layer(const llama_layer & layer) {
    return layer.ffn_gate_inp && (layer.ffn_up_exps || layer.ffn_gate_up_exps);
}

// the per-expert biases of a cached layer (add_id with the original ids): up, gate or fused gate_up,
// which the device chain adds before the down projection, and down, which build_moe_ffn adds once after
// the two chains are summed (llama_moe_cache_bias); a device copy of each keeps that work on the device
static int llama_moe_bias_list(const llama_layer & layer, const ggml_tensor * out[LLAMA_MOE_N_BIAS]) {
    int n = 0;
    for (const ggml_tensor * b : { layer.ffn_up_exps_b, layer.ffn_gate_exps_b, layer.ffn_gate_up_exps_b, layer.ffn_down_exps_b }) {
        if (b != nullptr && n < LLAMA_MOE_N_BIAS) {
            out[n++] = b;
        }
    }
    return n;
}

// the CUDA backend, also built for AMD GPUs (HIP: buffer types named ROCm*)
static bool llama_moe_is_cuda(ggml_backend_buffer_type_t buft) {
    const char * name = ggml_backend_buft_name(buft);
    return strncmp(name, "CUDA", 4) == 0 || strncmp(name, "ROCm", 4) == 0;
}

bool llama_moe_buft_is_host(ggml_backend_buffer_type_t buft) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    return dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU || ggml_backend_buft_is_host(buft);
}

// consume the routing the last graph wrote into the observed tensors
void llama_moe_account(llama_moe_cache & mc) {
    bool any = false;
    for (auto & l : mc.layers) {
        int32_t * obs = (int32_t *) l.observed->data;
        const int64_t n = ggml_nelements(l.observed);
        l.served_now = obs[0] >= 0;
        if (!l.served_now) {
            continue;
        }
        any = true;
        l.misses_now.clear();
        l.hits_now.clear();
        l.last_step = mc.step;
        for (int64_t i = 0; i < n && obs[i] >= 0; ++i) {
            const int32_t e = obs[i];
            GGML_ASSERT(e < l.n_expert);
            l.used[e] = mc.step;
            l.hits_now.push_back(l.table[e] < l.n_phys);
            if (l.table[e] < l.n_phys) {
                l.hits++;
            } else {
                l.misses++;
                if (std::find(l.misses_now.begin(), l.misses_now.end(), e) == l.misses_now.end()) {
                    l.misses_now.push_back(e);
                }
            }
        }
        std::fill(obs, obs + n, -1);
    }
    if (any) {
        mc.n_steps++;
        mc.step++;
    }
}

// the least recently used resident slot among experts last used before `used_before`, or -1;
// ties go to the lowest expert id, so the choice depends on the routing only, not on slot placement
int32_t llama_moe_lru_victim(const llama_moe_cache_layer & l, uint64_t used_before) {
    int32_t victim = -1;
    for (int32_t q = 0; q < l.n_phys; ++q) {
        if (l.slot_state[q] != LLAMA_MOE_SLOT_RESIDENT || l.used[l.slot_expert[q]] >= used_before) {
            continue;
        }
        const int32_t x = l.slot_expert[q];
        const int32_t v = victim < 0 ? -1 : l.slot_expert[victim];
        if (victim < 0 || l.used[x] < l.used[v] || (l.used[x] == l.used[v] && x < v)) {
            victim = q;
        }
    }
    return victim;
}

void llama_moe_evict(llama_moe_cache_layer & l, int32_t q) {
    l.table[l.slot_expert[q]] = l.n_phys;
    l.slot_state[q]  = LLAMA_MOE_SLOT_FREE;
    l.slot_expert[q] = -1;
    l.n_resident--;
    l.dirty = true;
}

// make a finished upload resident; evicts the least recently used resident when the layer is full,
// never one selected in the last observed step
void llama_moe_admit(llama_moe_cache_layer & l, int32_t e, int32_t p) {
    if (l.n_resident == l.n_slots) {
        const int32_t victim = llama_moe_lru_victim(l, l.last_step);
        if (victim < 0) {
            // every resident expert was needed just now: drop the upload
            l.slot_state[p]  = LLAMA_MOE_SLOT_FREE;
            l.slot_expert[p] = -1;
            return;
        }
        llama_moe_evict(l, victim);
    }
    l.table[e]       = p;
    l.slot_state[p]  = LLAMA_MOE_SLOT_RESIDENT;
    l.n_resident++;
    l.dirty = true;
}

// wait for the uploads in flight and make them resident
void llama_moe_settle(llama_moe_cache & mc) {
    mc.wait_uploads();
    for (const auto & u : mc.in_flight) {
        auto & l = mc.layers[u.layer];
        mc.uploads++;
        mc.upload_bytes += l.expert_bytes();
        llama_moe_admit(l, u.expert, u.slot);
    }
    mc.in_flight.clear();
}

void llama_moe_publish(llama_moe_cache & mc) {
    for (auto & l : mc.layers) {
        if (!l.dirty) {
            continue;
        }
        memcpy(l.host_table->data, l.table.data(), l.table.size()*sizeof(int32_t));
        ggml_backend_tensor_set(l.dev_table, l.table.data(), 0, l.table.size()*sizeof(int32_t));
        l.dirty = false;
    }
}

void llama_moe_schedule(llama_moe_cache & mc) {
    for (size_t li = 0; li < mc.layers.size(); ++li) {
        auto & l = mc.layers[li];
        int32_t budget = mc.n_inserts > 0 ? mc.n_inserts : l.n_expert;
        if (l.n_slots == 0) {
            budget = 0; // resized to nothing: an upload could never become resident
        }
        int32_t p = 0;
        for (int32_t e : l.misses_now) {
            if (budget == 0) {
                break;
            }
            if (l.table[e] < l.n_phys) {
                continue; // became resident at this step (an earlier miss of the same expert)
            }
            // uploads go to free physical slots only: residents keep serving while they are written
            while (p < l.n_phys && l.slot_state[p] != LLAMA_MOE_SLOT_FREE) {
                p++;
            }
            if (p == l.n_phys) {
                break;
            }
            l.slot_state[p]  = LLAMA_MOE_SLOT_UPLOADING;
            l.slot_expert[p] = e;
            mc.in_flight.push_back({ (int32_t) li, e, p });
            budget--;
        }
        l.misses_now.clear();
    }
}

} // namespace

//
// load-time
//

// the cache --fit's probe loads of the main model count (process-wide: the probes load the model
// themselves; a draft model's probes, another file, count nothing)
static std::string g_llama_moe_fit_path;
static int32_t     g_llama_moe_fit_slots   = 0;
static int32_t     g_llama_moe_fit_inserts = 0;

static int32_t llama_moe_cache_init_impl(llama_model * model, int32_t n_slots, int32_t n_inserts,
                                         int32_t floor_mib, int32_t ceil_mib);

void llama_moe_cache_record_sources(llama_model & model, const llama_model_loader & ml, const std::vector<std::string> & paths) {
    if (paths.empty() || paths[0].empty()) {
        return; // loaded from a FILE * or from metadata: no source; init reports it
    }
    auto * mc = model.moe_cache ? model.moe_cache : new llama_moe_cache();
    model.moe_cache = mc;
    mc->paths = paths;
    for (const auto & [name, w] : ml.weights_map) {
        if (name.find("_exps.weight") != std::string::npos) {
            mc->sources[name] = { w.idx, w.offs, ggml_nbytes(w.tensor) };
        }
    }
    if (model.hparams.no_alloc && g_llama_moe_fit_slots > 0 && paths[0] == g_llama_moe_fit_path) {
        llama_moe_cache_init_impl(&model, g_llama_moe_fit_slots, g_llama_moe_fit_inserts, 0, 0);
    }
}

void llama_moe_cache_free(llama_moe_cache * mc) {
    delete mc;
}

static int32_t llama_moe_cache_init_impl(llama_model * model, int32_t n_slots, int32_t n_inserts,
                                         int32_t floor_mib, int32_t ceil_mib) {
    const bool is_auto = n_slots == LLAMA_MOE_CACHE_AUTO;
    if (model == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-cache: no model\n", __func__);
        return -1;
    }
    if ((n_slots < 0 && !is_auto) || n_inserts < 0 || floor_mib < 0 || ceil_mib < 0) {
        LLAMA_LOG_ERROR("%s: moe-cache: slots (%d), inserts (%d), floor (%d MiB) and ceil (%d MiB) must be >= 0\n",
                __func__, n_slots, n_inserts, floor_mib, ceil_mib);
        return -1;
    }
    if (n_slots == 0) {
        return 0;
    }
    const auto & hp = model->hparams;
    if (hp.n_expert == 0) {
        LLAMA_LOG_INFO("%s: moe-cache: model has no MoE layers; --moe-expert-cache is inert\n", __func__);
        return 0;
    }
    // a memory-estimation load (the --fit probe): size the slots and give their tensors a dummy
    // buffer, so that the model's memory breakdown counts them on the right device; nothing runs
    const bool estimate = hp.no_alloc;
    llama_moe_cache * mc = model->moe_cache;
    if (mc == nullptr || mc->paths.empty()) {
        LLAMA_LOG_ERROR("%s: moe-cache: requested %d slots but the model was not loaded from a GGUF file path, "
                "so expert bytes have no source; the cache is OFF\n", __func__, n_slots);
        return -1;
    }
    if (mc->enabled()) {
        LLAMA_LOG_ERROR("%s: moe-cache: already initialized with %d slots\n", __func__, mc->n_slots);
        return -1;
    }
    const int32_t n_expert = (int32_t) hp.n_expert;
    const int32_t n_used   = (int32_t) hp.n_expert_used();
    const int32_t n_req = n_slots;
    if (is_auto) {
        n_slots = n_expert; // the most any device can get; each device is sized below
    } else if (n_slots > n_expert) {
        LLAMA_LOG_INFO("%s: moe-cache: %d slots > %d experts per layer, clamped to %d\n", __func__, n_slots, n_expert, n_expert);
        n_slots = n_expert;
    }

    // which layers can be cached; every reason a MoE layer with host experts is not is one WARN line
    std::map<ggml_backend_buffer_type_t, std::vector<int>> by_buft;
    std::map<std::string, std::vector<int>> not_cached; // reason -> layers
    std::map<std::string, std::vector<int>> pinned;     // experts in another device's host buffer -> layers
    int n_moe = 0;
    for (int il = 0; il < (int) model->layers.size(); ++il) {
        const auto & layer = model->layers[il];
        if (!llama_moe_is_moe_layer(layer)) {
            continue;
        }
        n_moe++;
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        const int n_proj = llama_moe_proj_list(layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                                               layer.ffn_gate_up_exps, exps);
        if (n_proj == 0) {
            not_cached["the layer has no down experts"].push_back(il);
            continue;
        }
        ggml_backend_buffer_type_t ebuft = ggml_backend_buffer_get_type(exps[0]->buffer);
        if (!llama_moe_buft_is_host(ebuft)) {
            continue; // experts already on a device: nothing to cache
        }
        ggml_backend_buffer_type_t rbuft = ggml_backend_buffer_get_type(layer.ffn_gate_inp->buffer);
        if (llama_moe_buft_is_host(rbuft)) {
            // slots go where the router is; a router that fell back to a host (or pinned host) buffer,
            // for example a type the device does not support, or -ot on the router, leaves no device
            not_cached[format("the router ffn_gate_inp (%s) is in host buffer type %s, so there is no device to "
                    "hold slots; keep it on the device", ggml_type_name(layer.ffn_gate_inp->type),
                    ggml_backend_buft_name(rbuft))].push_back(il);
            continue;
        }
        if (llama_moe_is_cuda(rbuft)) {
            bool quantized = true;
            for (int p = 0; p < n_proj; ++p) {
                quantized = quantized && ggml_is_quantized(exps[p]->type);
            }
            if (!quantized) {
                not_cached[format("%s experts on %s would run the MMF kernels, which are not exact with duplicate expert "
                        "ids yet (docs/backends.md, CUDA)", ggml_type_name(exps[0]->type),
                        ggml_backend_buft_name(rbuft))].push_back(il);
                continue;
            }
        }
        bool ok = true;
        for (int p = 0; p < n_proj; ++p) {
            ok = ok && mc->sources.count(ggml_get_name(exps[p])) && exps[p]->ne[2] == n_expert;
        }
        if (!ok) {
            not_cached["expert tensors have no GGUF source"].push_back(il);
            continue;
        }
        by_buft[rbuft].push_back(il);
        ggml_backend_dev_t edev = ggml_backend_buft_get_device(ebuft);
        if (edev != nullptr && ggml_backend_dev_type(edev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            // host memory that belongs to another device: without mmap (--load-mode none), llama.cpp's
            // CPU buffer list puts CPU weights in the first GPU's pinned host buffer (CUDA_Host,
            // Vulkan_Host, ...); the cache serves them all the same (the host chain reads host memory,
            // uploads read the GGUF), but it is not the plain CPU buffer that --cpu-moe / -ot exps=CPU
            // suggest: say so
            pinned[format("%s, the pinned host memory of %s", ggml_backend_buft_name(ebuft),
                    ggml_backend_dev_name(edev))].push_back(il);
        }
    }
    if (!estimate) {
        auto list_of = [](const std::vector<int> & ils) {
            std::string list;
            for (int il : ils) {
                list += (list.empty() ? "" : ",") + std::to_string(il);
            }
            return list;
        };
        for (const auto & [why, ils] : not_cached) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING %zu layer(s) not cached (%s): %s\n", __func__, ils.size(),
                    list_of(ils).c_str(), why.c_str());
        }
        for (const auto & [where, ils] : pinned) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING the experts of %zu MoE layer(s) (%s) are in buffer type %s, "
                    "not a CPU buffer (llama.cpp puts CPU weights there when the model is not memory-mapped); the "
                    "cache serves them, but they hold page-locked RAM: --no-host keeps them in a CPU buffer\n",
                    __func__, ils.size(), list_of(ils).c_str(), where.c_str());
        }
    }
    if (n_moe == 0) {
        LLAMA_LOG_INFO("%s: moe-cache: model has no MoE layers; --moe-expert-cache is inert\n", __func__);
        return 0;
    }
    if (by_buft.empty()) {
        if (estimate) {
            return 0;
        }
        LLAMA_LOG_WARN("%s: moe-cache: WARNING requested %s slots but none of the %d MoE layers has host-resident experts "
                "with a device-resident router (offload layers with -ngl and keep experts on the host with --cpu-moe, "
                "--n-cpu-moe or -ot exps=CPU); the cache is OFF\n", __func__,
                is_auto ? "auto" : std::to_string(n_req).c_str(), n_moe);
        return -1;
    }

    // Vulkan: duplicate expert ids are exact at any batch with patch 0013, but on lavapipe with
    // GGML_VK_DISABLE_FUSION the first decode after a cached ubatch of 32 tokens crashes in the driver
    // (docs/backends.md; cause not found, ubatches of up to 31 tokens run), so the cache serves at most
    // 16 tokens there
    constexpr int32_t vk_max_batch = 16;
    for (const auto & [buft, ils] : by_buft) {
        if (mc->max_batch > vk_max_batch && strncmp(ggml_backend_buft_name(buft), "Vulkan", 6) == 0) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING %s: the cache serves ubatches of at most %d tokens on Vulkan "
                    "(asked: %d; larger cached ubatches are not verified there, docs/backends.md)\n", __func__,
                    ggml_backend_buft_name(buft), vk_max_batch, mc->max_batch);
            mc->max_batch = vk_max_batch;
        }
    }

    // CUDA/HIP: MUL_MAT_ID is exact with duplicate ids only on the mat-vec path (mmvq), which quantized
    // experts take up to 4..8 tokens depending on type and GPU (get_mmvq_mmid_max_batch); MMQ and MMF are
    // not (docs/backends.md; patches/candidates/cuda-mul-mat-id-duplicate-ids.patch awaits a GPU run)
    constexpr int32_t cuda_max_batch = 4;
    for (const auto & [buft, ils] : by_buft) {
        if (mc->max_batch > cuda_max_batch && llama_moe_is_cuda(buft)) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING %s: the cache serves ubatches of at most %d tokens on CUDA (asked: %d; "
                    "larger ones would run MUL_MAT_ID kernels that are not exact with duplicate expert ids yet, "
                    "docs/backends.md)\n", __func__, ggml_backend_buft_name(buft), cuda_max_batch, mc->max_batch);
            mc->max_batch = cuda_max_batch;
        }
    }

    // staging slots: the uploads one step can start; top-k unless the insert cap asks for more (a step
    // of max_batch tokens misses at most n_used * max_batch distinct experts), never more than the
    // experts that are not resident
    auto stage_for = [&](int32_t slots) {
        return std::min({ n_inserts > 0 ? n_inserts : n_used, n_used * mc->max_batch, n_expert - slots });
    };

    // slots per device: fixed, or (auto) the most that fit the device's free memory minus the floor,
    // capped by the ceiling; chosen once, here, and never resized during generation
    // (a --fit probe sizes fixed slots only: auto takes what is left after fitting, so it reserves nothing there)
    std::map<ggml_backend_buffer_type_t, int32_t> slots_of;
    for (auto it = by_buft.begin(); it != by_buft.end(); ) {
        const auto & [buft, ils] = *it;
        int32_t s = n_slots;
        if (estimate && is_auto) {
            it = by_buft.erase(it);
            continue;
        }
        double per_slot = 0.0; // MiB of one slot in every layer on this device
        double fixed    = 0.0; // MiB of the bias copies of every layer on this device
        for (int il : ils) {
            const auto & layer = model->layers[il];
            const ggml_tensor * bias[LLAMA_MOE_N_BIAS] = {};
            for (int b = 0, nb = llama_moe_bias_list(layer, bias); b < nb; ++b) {
                fixed += ggml_nbytes(bias[b]) / 1024.0 / 1024.0;
            }
            const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
            const int n_proj = llama_moe_proj_list(layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                                                   layer.ffn_gate_up_exps, exps);
            for (int p = 0; p < n_proj; ++p) {
                per_slot += exps[p]->nb[2] / 1024.0 / 1024.0;
            }
        }
        auto fits = [&](int32_t c, double budget) { return (c + stage_for(c) + 1) * per_slot + fixed <= budget; };
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        const double reserve_mib = mc->reserve.count(dev) ? mc->reserve.at(dev) / 1024.0 / 1024.0 : 0.0;
        double budget = free / 1024.0 / 1024.0 - reserve_mib - floor_mib;
        if (!is_auto && !estimate && !fits(s, budget)) {
            // a fixed size the device cannot hold is an error at load, not an allocation failure later
            int32_t most = 0;
            for (int32_t c = s - 1; c > 0; --c) {
                if (fits(c, budget)) {
                    most = c;
                    break;
                }
            }
            LLAMA_LOG_ERROR("%s: moe-cache: %d slots/layer need %.1f MiB on %s (%zu layers x (%d slots + %d staging + 1 zero) "
                    "x %.3f MiB%s), but it has %.0f MiB free%s and --moe-expert-cache-floor-mb keeps %d MiB free; %s\n",
                    __func__, s, (s + stage_for(s) + 1) * per_slot + fixed, ggml_backend_buft_name(buft), ils.size(), s,
                    stage_for(s), per_slot / ils.size(),
                    fixed > 0 ? format(" + %.2f MiB of expert biases", fixed).c_str() : "", free / 1024.0 / 1024.0,
                    reserve_mib > 0 ? format(" (%.0f MiB set aside for contexts)", reserve_mib).c_str() : "", floor_mib,
                    most > 0 ? format("at most %d slots/layer fit (or use auto)", most).c_str()
                             : "the device is too small for even one slot per layer");
            return LLAMA_MOE_CACHE_ERR_NO_ROOM;
        }
        if (is_auto) {
            if (ceil_mib > 0) {
                budget = std::min(budget, (double) ceil_mib);
            }
            s = 0;
            for (int32_t c = n_expert; c > 0; --c) {
                if (fits(c, budget)) {
                    s = c;
                    break;
                }
            }
            LLAMA_LOG("%s: moe-cache: auto on %s: %.0f MiB free - %.0f MiB reserved for contexts - %d MiB floor%s -> "
                    "%d slots/layer for %zu layers (%.2f MiB per slot of every layer)\n", __func__,
                    ggml_backend_buft_name(buft), free / 1024.0 / 1024.0, reserve_mib, floor_mib,
                    ceil_mib > 0 ? format(", ceil %d MiB", ceil_mib).c_str() : "", s, ils.size(), per_slot);
            if (s == 0) {
                LLAMA_LOG_WARN("%s: moe-cache: WARNING auto resolved to 0 slots on %s: %.1f MiB left after the floor "
                        "(and ceiling) cannot hold one slot per layer plus staging and the zero slot (%.1f MiB); "
                        "its %zu layers are not cached\n", __func__, ggml_backend_buft_name(buft), budget,
                        (2 + stage_for(1)) * per_slot, ils.size());
                it = by_buft.erase(it);
                continue;
            }
        }
        slots_of[buft] = s;
        ++it;
    }
    if (by_buft.empty()) {
        if (estimate) {
            return 0;
        }
        LLAMA_LOG_WARN("%s: moe-cache: WARNING auto sizing left no device with room for a slot; the cache is OFF\n", __func__);
        return -1;
    }
    if (estimate) {
        // the --fit probe: the slot tensors of each device, in a dummy buffer that the model's memory
        // breakdown sizes from its context (as for the probe's own weights)
        for (const auto & [buft, ils] : by_buft) {
            const int32_t dev_slots = slots_of.at(buft);
            ggml_init_params params = { ils.size() * (LLAMA_MOE_N_PROJ + LLAMA_MOE_N_BIAS + 1) * ggml_tensor_overhead(), nullptr, true };
            ggml_context_ptr ctx { ggml_init(params) };
            for (int il : ils) {
                const auto & layer = model->layers[il];
                const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
                const int n_proj = llama_moe_proj_list(layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                                                       layer.ffn_gate_up_exps, exps);
                for (int p = 0; p < n_proj; ++p) {
                    const ggml_tensor * t = exps[p];
                    ggml_new_tensor_3d(ctx.get(), t->type, t->ne[0], t->ne[1], dev_slots + stage_for(dev_slots) + 1);
                }
                const ggml_tensor * bias[LLAMA_MOE_N_BIAS] = {};
                for (int b = 0, nb = llama_moe_bias_list(layer, bias); b < nb; ++b) {
                    ggml_dup_tensor(ctx.get(), bias[b]);
                }
                ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, 1, n_expert);
            }
            ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, 0);
            if (buf == nullptr) {
                return 0;
            }
            LLAMA_LOG_INFO("%s: moe-cache: --fit counts %.2f MiB of expert slots in %s\n", __func__,
                    ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.get(), buft) / 1024.0 / 1024.0,
                    ggml_backend_buft_name(buft));
            model->add_owned_buffer(std::move(ctx), ggml_backend_buffer_ptr(buf));
        }
        return 0;
    }
    n_slots = 0;
    int32_t n_slots_min = n_expert;
    for (const auto & [buft, s] : slots_of) {
        n_slots     = std::max(n_slots, s);
        n_slots_min = std::min(n_slots_min, s);
    }

    mc->n_slots   = n_slots;
    mc->n_inserts = n_inserts;
    mc->step      = 1; // step 0 means "never used"
    mc->layer_of_il.assign(model->layers.size(), -1);

    // device companions, one context + buffer per router buffer type, owned by the model
    std::string budgets; // "<buft>:<MiB>,..." for the preamble
    size_t n_layers = 0;
    for (const auto & [buft, ils] : by_buft) {
        n_layers += ils.size();
    }
    mc->layers.reserve(n_layers);
    for (const auto & [buft, ils] : by_buft) {
        const int32_t dev_slots = slots_of.at(buft);
        const int32_t n_stage   = stage_for(dev_slots);
        ggml_init_params params = {
            /*.mem_size   =*/ ils.size() * (LLAMA_MOE_N_PROJ + LLAMA_MOE_N_BIAS + 1) * ggml_tensor_overhead(),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        ggml_context_ptr ctx { ggml_init(params) };
        for (int il : ils) {
            const auto & layer = model->layers[il];
            llama_moe_cache_layer l;
            l.il = il; l.n_expert = n_expert; l.n_used = n_used; l.n_slots = dev_slots; l.n_cap = dev_slots;
            l.n_stage = n_stage; l.n_phys = dev_slots + n_stage;
            const char * names[LLAMA_MOE_N_PROJ] = {};
            const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
            l.n_proj = llama_moe_proj_list(layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                                           layer.ffn_gate_up_exps, exps, names);
            for (int p = 0; p < l.n_proj; ++p) {
                const ggml_tensor * t = exps[p];
                l.exps[p] = t;
                l.src[p]  = mc->sources.at(ggml_get_name(t));
                l.expert_nbytes[p] = t->nb[2];
                GGML_ASSERT(l.src[p].nbytes == t->nb[2] * (size_t) n_expert && "expert layout differs from the GGUF");
                l.slots[p] = ggml_new_tensor_3d(ctx.get(), t->type, t->ne[0], t->ne[1], l.n_phys + 1);
                // the ".cache" suffix is a contract: backends that transform weights in place on first
                // use (SYCL's reorder, patch 0011) skip tensors named so, since their slices are rewritten
                ggml_format_name(l.slots[p], "blk.%d.ffn_%s_exps.cache", il, names[p]);
            }
            l.n_bias = llama_moe_bias_list(layer, l.bias_host);
            for (int b = 0; b < l.n_bias; ++b) {
                l.bias_dev[b] = ggml_dup_tensor(ctx.get(), l.bias_host[b]);
                ggml_format_name(l.bias_dev[b], "%s.cache_copy", ggml_get_name(l.bias_host[b])); // not ".cache": written once, SYCL may reorder it
            }
            l.dev_table = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, 1, n_expert);
            ggml_format_name(l.dev_table, "blk.%d.ffn_exps.cache_table", il);
            l.table.assign(n_expert, l.n_phys);
            l.used.assign(n_expert, 0);
            l.slot_expert.assign(l.n_phys, -1);
            l.slot_state.assign(l.n_phys, LLAMA_MOE_SLOT_FREE);
            mc->layer_of_il[il] = (int32_t) mc->layers.size();
            mc->layers.push_back(std::move(l));
        }
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        if (buf == nullptr) {
            LLAMA_LOG_ERROR("%s: moe-cache: cannot allocate %d slots per layer in %s; the cache is OFF\n",
                    __func__, dev_slots, ggml_backend_buft_name(buft));
            mc->layers.clear();
            mc->n_slots = 0;
            return -1;
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(buf, 0); // every slot, including the dummy slot, computes exact zeros
        std::vector<uint8_t> bias_bytes;   // the bias copies: the model's values, once
        for (size_t li = mc->layers.size() - ils.size(); li < mc->layers.size(); ++li) {
            const auto & l = mc->layers[li];
            for (int b = 0; b < l.n_bias; ++b) {
                bias_bytes.resize(ggml_nbytes(l.bias_host[b]));
                ggml_backend_tensor_get(l.bias_host[b], bias_bytes.data(), 0, bias_bytes.size());
                ggml_backend_tensor_set(l.bias_dev[b], bias_bytes.data(), 0, bias_bytes.size());
            }
        }
        mc->alloc_bytes += ggml_backend_buffer_get_size(buf);
        budgets += format("%s%s:%.2f", budgets.empty() ? "" : ",", ggml_backend_buft_name(buft),
                ggml_backend_buffer_get_size(buf)/1024.0/1024.0);
        mc->devices.push_back({ ggml_backend_buft_name(buft), (int64_t) dev_slots * (int64_t) ils.size(),
                                ggml_backend_buffer_get_size(buf) });
        LLAMA_LOG_INFO("%s: moe-cache: %8.2f MiB of expert slots for %zu layers in %s\n", __func__,
                ggml_backend_buffer_get_size(buf)/1024.0/1024.0, ils.size(), ggml_backend_buft_name(buft));
        model->add_owned_buffer(std::move(ctx), ggml_backend_buffer_ptr(buf));
    }

    // host companions: the table the CPU MUL_MAT_ID reads (src[3]) and the observed routing
    {
        ggml_init_params params = {
            /*.mem_size   =*/ mc->layers.size() * 2 * ggml_tensor_overhead(),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        mc->host_ctx.reset(ggml_init(params));
        for (auto & l : mc->layers) {
            l.host_table = ggml_new_tensor_1d(mc->host_ctx.get(), GGML_TYPE_I32, n_expert);
            ggml_format_name(l.host_table, "blk.%d.ffn_exps.cache_table_host", l.il);
            l.observed = ggml_new_tensor_1d(mc->host_ctx.get(), GGML_TYPE_I32, (int64_t) n_used * mc->max_batch);
            ggml_format_name(l.observed, "blk.%d.ffn_exps.cache_observed", l.il);
        }
        mc->host_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(mc->host_ctx.get(), ggml_backend_cpu_buffer_type()));
        GGML_ASSERT(mc->host_buf);
        mc->alloc_bytes += ggml_backend_buffer_get_size(mc->host_buf.get());
        for (auto & l : mc->layers) {
            std::fill((int32_t *) l.observed->data, (int32_t *) l.observed->data + ggml_nelements(l.observed), -1);
            l.dirty = true;
        }
        llama_moe_publish(*mc);
    }

    // sources and the upload worker
    for (const auto & p : mc->paths) {
        FILE * f = fopen(p.c_str(), "rb");
        if (f == nullptr) {
            LLAMA_LOG_ERROR("%s: moe-cache: cannot open %s to read expert bytes; the cache is OFF\n", __func__, p.c_str());
            mc->layers.clear();
            mc->n_slots = 0;
            return -1;
        }
        mc->files.push_back(f);
    }
    mc->worker = std::thread([mc] { mc->worker_main(); });

    const auto & l0 = mc->layers[0];
    LLAMA_LOG("%s: moe-cache: %zu of %d MoE layers cached, %d slots/layer (+%d staging, +1 zero) of %d experts, "
            "top-k %d, expert %.3f MiB, inserts/step %s\n", __func__, mc->layers.size(), n_moe, n_slots, l0.n_stage,
            n_expert, n_used, l0.expert_bytes()/1024.0/1024.0, n_inserts > 0 ? std::to_string(n_inserts).c_str() : "unlimited");

    // the metrics preamble: one line, key=value, parsed by pybmoe.engine.parse_cache_preamble
    // cache_cycle_mb: the worst-case bytes one token needs, every cached layer's experts x min(top-k, n_expert)
    double cycle_mib = 0.0;
    for (const auto & l : mc->layers) {
        cycle_mib += (double) l.expert_bytes() * std::min(l.n_used, l.n_expert) / 1024.0 / 1024.0;
    }
    LLAMA_LOG("moe-cache-preamble: layers=%zu n_expert=%d top_k=%d slots=%d staging=%d inserts=%d max_batch=%d "
            "slot_mib=%.4f budget_mib=%s cache_cycle_mb=%.2f layer_cycle_slots=%d\n", mc->layers.size(), n_expert, n_used,
            n_slots, l0.n_stage, n_inserts, mc->max_batch, l0.expert_bytes()/1024.0/1024.0, budgets.c_str(), cycle_mib, n_used);
    if (n_slots_min < n_used) {
        // the cliff guard: state the fact, once, at load
        LLAMA_LOG_WARN("%s: moe-cache: WARNING %d slots/layer is below the per-layer token cycle of %d slots at "
                "top-k %d: one token's experts cannot all stay resident until the next token\n",
                __func__, n_slots_min, n_used, n_used);
    }
    return (int32_t) mc->layers.size();
}

bool llama_model_moe_cache_get_stats(const llama_model * model, llama_moe_cache_stats * out) {
    const llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->enabled() || out == nullptr) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    *out = {};
    for (const auto & l : mc->layers) {
        out->hits   += l.hits;
        out->misses += l.misses;
        out->resident_bytes += (uint64_t) l.n_resident * l.expert_bytes();
    }
    out->uploads       = mc->uploads;
    out->upload_bytes  = mc->upload_bytes;
    out->alloc_bytes   = mc->alloc_bytes;
    out->n_steps       = mc->n_steps;
    out->n_layers      = (int32_t) mc->layers.size();
    out->n_slots       = 0; // now: a resize between generations changes it (the allocation stays)
    for (const auto & l : mc->layers) {
        out->n_slots = std::max(out->n_slots, l.n_slots);
    }
    out->n_inserts     = mc->n_inserts;
    out->n_expert      = mc->layers[0].n_expert;
    out->n_expert_used = mc->layers[0].n_used;
    return true;
}

bool llama_model_moe_cache_get_layer_stats(const llama_model * model, int32_t il, uint64_t * hits, uint64_t * misses) {
    const llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->enabled() || il < 0 || il >= (int32_t) mc->layer_of_il.size() || mc->layer_of_il[il] < 0) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    const auto & l = mc->layers[mc->layer_of_il[il]];
    if (hits)   { *hits   = l.hits; }
    if (misses) { *misses = l.misses; }
    return true;
}

//
// graph-time
//

const llama_moe_cache * llama_moe_cache_active(const llama_model & model) {
    const llama_moe_cache * mc = model.moe_cache;
    return mc && (mc->enabled() || mc->tracing() || mc->replaying()) ? mc : nullptr;
}

// the most nodes the device chain of one layer may have (llama_moe_cache_build_split); beyond it the
// layer builds the stock graph
constexpr uint32_t LLAMA_MOE_MAX_CLONE = 48;

uint32_t llama_moe_cache_n_graph_nodes(const llama_moe_cache * mc) {
    if (mc == nullptr) {
        return 0;
    }
    return LLAMA_MOE_MAX_CLONE * (uint32_t) (mc->enabled() ? mc->layers.size() : 0) + 4u * (uint32_t) mc->tlayers.size() +
            2u * (uint32_t) mc->rp_tensors.size();
}

// trace: copy the selected ids of every MoE layer into a host tensor (runs on the CPU)
static void llama_moe_trace_build(const llama_moe_cache * mc, const llama_moe_cache_ffn_desc & d) {
    if (!mc->tracing() || d.il < 0 || d.il >= (int) mc->tlayer_of_il.size() || mc->tlayer_of_il[d.il] < 0) {
        return;
    }
    const auto & t = mc->tlayers[mc->tlayer_of_il[d.il]];
    const int64_t n = d.selected->ne[0] * d.selected->ne[1];
    if (d.selected->ne[0] != t.n_used || n > ggml_nelements(t.obs)) {
        llama_moe_log_once("trace-cap", "WARNING the routing trace skips graphs of more than %lld tokens (the ubatch "
                "size it was opened with)", (long long) mc->trace_cap);
        return;
    }
    ggml_build_forward_expand(d.gf, ggml_cpy(d.ctx, d.selected, ggml_view_1d(d.ctx, t.obs, n, 0)));
}

const llama_moe_cache_layer * llama_moe_cache_graph_layer(const llama_moe_cache * mc, const llama_moe_cache_ffn_desc & d) {
    if (mc == nullptr) {
        return nullptr;
    }
    llama_moe_trace_build(mc, d);
    if (!mc->enabled() || d.il < 0 || d.il >= (int) mc->layer_of_il.size() || mc->layer_of_il[d.il] < 0) {
        return nullptr;
    }
    const llama_moe_cache_layer & l = mc->layers[mc->layer_of_il[d.il]];
    const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
    const int n_proj = llama_moe_proj_list(d.up_exps, d.gate_exps, d.down_exps, d.gate_up_exps, exps);
    bool same = n_proj == l.n_proj;
    for (int p = 0; same && p < n_proj; ++p) {
        same = exps[p] == l.exps[p];
    }
    if (!same) {
        llama_moe_log_once("key", "WARNING layer %d: build_moe_ffn called with other expert tensors than the cached ones "
                "(second call site); stock graph there", d.il);
        return nullptr;
    }
    if (d.has_lora) {
        llama_moe_log_once("lora", "WARNING LoRA adapters are loaded: the expert cache is bypassed (stock graph) while they are");
        return nullptr;
    }
    if (d.n_ubatch > mc->max_batch) {
        llama_moe_log_once("batch", "batches of more than %d token(s) use the stock graph (all experts on the host)", mc->max_batch);
        return nullptr;
    }
    return &l;
}

namespace {

bool llama_moe_is_view_op(ggml_op op) {
    return op == GGML_OP_VIEW || op == GGML_OP_RESHAPE || op == GGML_OP_PERMUTE || op == GGML_OP_TRANSPOSE;
}

// the cached projection a host node multiplies by, or -1
int llama_moe_proj_of(const llama_moe_cache_layer * l, const ggml_tensor * t) {
    for (int p = 0; t->op == GGML_OP_MUL_MAT_ID && p < l->n_proj; ++p) {
        if (t->src[0] == l->exps[p]) {
            return p;
        }
    }
    return -1;
}

// The nodes between the FFN input and `out` that depend on a cached MUL_MAT_ID: the host chain the
// device chain clones. Walks back from `out`, stopping at the FFN input, the routing and leaves.
struct llama_moe_chain {
    const llama_moe_cache_layer * l;
    const ggml_tensor * stop[3];
    std::map<const ggml_tensor *, bool> dep; // visited node -> depends on a cached projection
    std::string why;                          // set when the chain cannot be cloned

    bool scan(const ggml_tensor * t) {
        auto it = dep.find(t);
        if (it != dep.end()) {
            return true;
        }
        if (dep.size() > 4 * LLAMA_MOE_MAX_CLONE) {
            why = "the expert chain is larger than expected";
            return false;
        }
        bool d = false;
        if (t != stop[0] && t != stop[1] && t != stop[2]) {
            for (const ggml_tensor * s : t->src) {
                if (s != nullptr) {
                    if (!scan(s)) {
                        return false;
                    }
                    d = d || dep.at(s);
                }
            }
        }
        const int p = llama_moe_proj_of(l, t);
        if (p >= 0) {
            if (t->src[3] != nullptr) {
                why = "a cached MUL_MAT_ID already has a skip table";
                return false;
            }
            d = true;
        } else if (d && t->op == GGML_OP_MUL_MAT_ID) {
            why = "an uncached MUL_MAT_ID (LoRA?) downstream of a cached one";
            return false;
        } else if (d && t->view_src != nullptr && !llama_moe_is_view_op(t->op)) {
            why = std::string("an in-place ") + ggml_op_desc(t) + " in the expert chain";
            return false;
        }
        dep[t] = d;
        return true;
    }
};

} // namespace

ggml_tensor * llama_moe_cache_bias(const llama_moe_cache_layer * l, ggml_tensor * bias) {
    for (int b = 0; l != nullptr && b < l->n_bias; ++b) {
        if (l->bias_host[b] == bias) {
            return l->bias_dev[b];
        }
    }
    return bias;
}

ggml_tensor * llama_moe_cache_build_split(ggml_context * ctx, ggml_cgraph * gf, const llama_moe_cache_layer * l,
                                          ggml_tensor * inp, ggml_tensor * selected, ggml_tensor * out_h) {
    llama_moe_chain ch = { l, { inp, inp->src[0], selected }, {}, {} };
    int n_dep = 0;
    bool ok = ch.scan(out_h) && ch.dep.at(out_h);
    for (const auto & [t, d] : ch.dep) {
        n_dep += d;
        if (ok && d && llama_moe_proj_of(l, t) >= 0 && t->src[2] != selected) {
            ch.why = "a cached MUL_MAT_ID takes other ids than the routing";
            ok = false;
        }
    }
    if (ok && n_dep + 8 > (int) LLAMA_MOE_MAX_CLONE) {
        ch.why = "the expert chain is larger than expected";
        ok = false;
    }
    if (!ok) {
        llama_moe_log_once(("chain:" + ch.why).c_str(), "WARNING layer %d: the expert cache cannot split this MoE "
                "chain (%s); stock graph there", l->il, ch.why.empty() ? "it has no cached projection" : ch.why.c_str());
        return out_h;
    }

    const int64_t n_used   = selected->ne[0];
    const int64_t n_tokens = selected->ne[1];

    // record the routing for the cache policy (runs on the CPU: the destination is a host tensor)
    ggml_tensor * obs = ggml_view_1d(ctx, l->observed, n_used*n_tokens, 0);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, selected, obs));

    // get_rows gathers per token from a table per token: repeat the one table over the ubatch's tokens
    ggml_tensor * table = n_tokens == 1 ? l->dev_table : ggml_repeat_4d(ctx, l->dev_table, 1, l->n_expert, n_tokens, 1);
    ggml_tensor * slot_ids = ggml_get_rows(ctx, table, selected); // [1, n_used, n_tokens]
    slot_ids = ggml_reshape_2d(ctx, slot_ids, n_used, n_tokens);
    ggml_format_name(slot_ids, "ffn_moe_cache_slots-%d", l->il);

    // The device chain is the host chain with every cached MUL_MAT_ID(w, x, ids) replaced by
    // MUL_MAT_ID(slots of w, x', slot ids), where the host one skips resident experts (zero rows) and
    // misses read the all-zero dummy slot. Every other node is cloned with the same op and parameters
    // (views, activation, clamps, add_id biases and get_rows-gathered scales keep the ORIGINAL ids), so
    // each output row is computed in exactly one chain and is 0 in the other: a skipped or dummy row
    // that picks up a bias is zeroed again by the down projection. A bias or scale after the down
    // projection that `out_h` includes applies on both chains to complementary rows, i.e. once.
    std::map<const ggml_tensor *, ggml_tensor *> dev;
    std::function<ggml_tensor * (ggml_tensor *)> clone = [&](ggml_tensor * t) -> ggml_tensor * {
        if (!ch.dep.count(t) || !ch.dep.at(t)) {
            return t; // shared with the host chain
        }
        auto it = dev.find(t);
        if (it != dev.end()) {
            return it->second;
        }
        ggml_tensor * r = nullptr;
        const int p = llama_moe_proj_of(l, t);
        if (p >= 0) {
            ggml_tensor * x = clone(t->src[1]);
            ggml_mul_mat_id_set_skip(t, l->host_table, l->n_phys);
            r = ggml_mul_mat_id(ctx, l->slots[p], x, slot_ids);
            memcpy(r->op_params, t->op_params, sizeof(r->op_params)); // the host node's precision settings
            ((int32_t *) r->op_params)[2] = 0;
        } else if (llama_moe_is_view_op(t->op)) {
            // a view of a cloned result: same shape, strides and offset into the clone of its base
            ggml_tensor * base = clone(t->view_src);
            r = ggml_view_4d(ctx, base, t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3], t->view_offs);
        } else {
            r = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, t->ne);
            r->op = t->op;
            memcpy(r->op_params, t->op_params, sizeof(r->op_params));
            for (int i = 0; i < GGML_MAX_SRC; ++i) {
                // a bias from its copy next to the slots: the chain stays on the device
                r->src[i] = t->src[i] ? llama_moe_cache_bias(l, clone(t->src[i])) : nullptr;
            }
        }
        ggml_format_name(r, "%.48s-cache", t->name);
        dev[t] = r;
        return r;
    };
    ggml_tensor * out_c = clone(out_h);
    return ggml_add(ctx, out_h, out_c);
}

//
// step-time
//

// trace rows of the ubatch just computed; the hit column comes from the cache's accounting
static void llama_moe_trace_rows(llama_moe_cache & mc, const llama_ubatch & ub) {
    const bool decode = ub.n_tokens == 1;
    std::string rows;
    int64_t n_rows_max = 0;
    for (auto & t : mc.tlayers) {
        int32_t * obs = (int32_t *) t.obs->data;
        const int64_t n = ggml_nelements(t.obs);
        int64_t n_ids = 0;
        while (n_ids < n && obs[n_ids] >= 0) {
            n_ids++;
        }
        if (n_ids == 0) {
            continue;
        }
        const int64_t n_rows = n_ids / t.n_used;
        n_rows_max = std::max(n_rows_max, n_rows);
        const llama_moe_cache_layer * cl = nullptr;
        if (t.il < (int) mc.layer_of_il.size() && mc.layer_of_il[t.il] >= 0) {
            cl = &mc.layers[mc.layer_of_il[t.il]];
            cl = cl->served_now && (int64_t) cl->hits_now.size() == n_ids ? cl : nullptr;
        }
        // note: a layer that computes fewer rows than the ubatch has (the last layer computes only the
        // outputs) maps its rows onto the tokens flagged as outputs, in order
        int64_t tok = -1;
        for (int64_t r = 0; r < n_rows; ++r) {
            if (n_rows == (int64_t) ub.n_tokens) {
                tok = r;
            } else {
                do { tok++; } while (tok < (int64_t) ub.n_tokens && ub.output && !ub.output[tok]);
            }
            for (int32_t k = 0; k < t.n_used; ++k) {
                const int64_t i = r * t.n_used + k;
                char line[128];
                snprintf(line, sizeof(line), "engine,%s,%llu,%llu,%d,%d,%d,%d\n", decode ? "decode" : "prefill",
                        (unsigned long long) mc.trace_ubatch, (unsigned long long) (mc.trace_token + tok), t.il, k,
                        obs[i], cl ? (int) cl->hits_now[i] : -1);
                rows += line;
            }
        }
        std::fill(obs, obs + n, -1);
    }
    if (!rows.empty()) {
        mc.trace_push(std::move(rows));
    }
    mc.trace_ubatch++;
    mc.trace_token += ub.n_tokens;
}

// the replay buffers hold the next rp_cap tokens of the trace, from rp_cursor on (wrapping)
static void llama_moe_replay_fill(llama_moe_cache & mc) {
    const int64_t row = (int64_t) mc.rp_n_layer * mc.rp_n_used;
    for (int32_t il = 0; il < (int32_t) mc.rp_tensor_of_il.size(); ++il) {
        if (mc.rp_tensor_of_il[il] < 0) {
            continue;
        }
        int32_t * dst = (int32_t *) mc.rp_tensors[mc.rp_tensor_of_il[il]]->data;
        for (int64_t t = 0; t < mc.rp_cap; ++t) {
            const int64_t tok = (int64_t) ((mc.rp_cursor + t) % (uint64_t) mc.rp_n_tok);
            memcpy(dst + t * mc.rp_n_used, mc.rp_ids.data() + tok * row + (int64_t) il * mc.rp_n_used,
                    mc.rp_n_used * sizeof(int32_t));
        }
    }
}

static void llama_moe_replay_advance(llama_moe_cache & mc, int64_t n_tokens) {
    // warn when this ubatch used a token of a later pass than the one before it did
    const uint64_t n = (uint64_t) mc.rp_n_tok;
    const uint64_t pass_before = mc.rp_cursor == 0 ? 0 : (mc.rp_cursor - 1) / n;
    mc.rp_cursor += n_tokens;
    if (n_tokens > 0 && (mc.rp_cursor - 1) / n > pass_before) {
        LLAMA_LOG_WARN("%s: moe-route-replay: WARNING the trace %s ran out after %lld tokens; wrapping to its start "
                "(pass %llu)\n", __func__, mc.rp_path.c_str(), (long long) mc.rp_n_tok,
                (unsigned long long) ((mc.rp_cursor - 1) / n) + 1);
    }
    llama_moe_replay_fill(mc);
}

ggml_tensor * llama_moe_route_replay_ids(const llama_moe_cache * mc, ggml_context * ctx, ggml_tensor * selected,
                                         int il, int64_t n_ubatch) {
    if (mc == nullptr || !mc->replaying() || il < 0 || il >= (int) mc->rp_tensor_of_il.size() ||
        mc->rp_tensor_of_il[il] < 0) {
        return selected;
    }
    const int64_t n_rows = selected->ne[1];
    if (selected->ne[0] != mc->rp_n_used || n_ubatch > mc->rp_cap || n_rows > n_ubatch) {
        llama_moe_log_once("replay-cap", "WARNING route replay skips graphs of more than %lld tokens (the ubatch it "
                "was opened with) or of another top-k; those use the router's own routing", (long long) mc->rp_cap);
        return selected;
    }
    ggml_tensor * t = mc->rp_tensors[mc->rp_tensor_of_il[il]];
    // a layer that computes fewer rows than the ubatch (the last one computes only the outputs) takes
    // the ubatch's last tokens, as the trace writer records it for the usual single output
    ggml_tensor * ids = ggml_view_2d(ctx, t, mc->rp_n_used, n_rows, t->nb[1], (size_t) (n_ubatch - n_rows) * t->nb[1]);
    ggml_format_name(ids, "blk.%d.ffn_moe_topk_replay", il);
    return ids;
}

void llama_moe_cache_after_ubatch(const llama_model & model, ggml_backend_sched_t sched, const llama_ubatch * ubatch) {
    llama_moe_cache * mc = model.moe_cache;
    if (mc == nullptr) {
        return;
    }
    mc->n_busy--;
    if (ubatch == nullptr || !(mc->enabled() || mc->tracing() || mc->replaying())) {
        return; // the graph failed, or nothing to do
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    ggml_backend_sched_synchronize(sched); // no graph in flight from here on

    if (mc->replaying()) {
        llama_moe_replay_advance(*mc, ubatch->n_tokens);
    }

    if (mc->enabled()) {
        llama_moe_account(*mc);
    }
    if (mc->tracing()) {
        llama_moe_trace_rows(*mc, *ubatch);
    }
    if (!mc->enabled()) {
        return;
    }

    llama_moe_settle(*mc);    // uploads started after the previous ubatch become visible now

    llama_moe_publish(*mc);   // both copies change together
    llama_moe_schedule(*mc);  // into free slots, which no table entry points at
    for (const auto & u : mc->in_flight) {
        mc->enqueue(u);       // copied while the next graph runs
    }
}

void llama_moe_cache_on_context_free(const llama_model & model) {
    llama_moe_cache * mc = model.moe_cache;
    if (mc == nullptr || !mc->enabled()) {
        return;
    }
    llama_moe_cache_stats st;
    llama_model_moe_cache_get_stats(&model, &st);
    const uint64_t n = st.hits + st.misses;
    // demand (the BigMoeOnEdge seed's layer_demand_MiB / token_demand_MiB): expert bytes requested per
    // served step, by the widest layer and by all cached layers together
    double layer_demand = 0.0, token_demand = 0.0;
    {
        std::lock_guard<std::mutex> lock(mc->mutex);
        for (const auto & l : mc->layers) {
            const double d = mc->n_steps ? (double) (l.hits + l.misses) * l.expert_bytes() / mc->n_steps / 1024.0 / 1024.0 : 0.0;
            layer_demand  = std::max(layer_demand, d);
            token_demand += d;
        }
    }
    // note: level NONE, so the line shows at the default verbosity, like the tools' own output
    LLAMA_LOG("moe-cache: %.1f%% hit, resident %.1f MiB, uploads %llu (%.1f MiB), layer_demand %.2f MiB, "
            "token_demand %.2f MiB, steps %llu\n",
            n ? 100.0*st.hits/n : 0.0, st.resident_bytes/1024.0/1024.0,
            (unsigned long long) st.uploads, st.upload_bytes/1024.0/1024.0, layer_demand, token_demand,
            (unsigned long long) st.n_steps);
}

int32_t llama_model_moe_trace_open(llama_model * model, const char * path, int32_t n_ubatch) {
    llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    if (path == nullptr || path[0] == '\0') {
        return 0;
    }
    if (mc == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-trace: the model was not loaded from a GGUF path; no trace\n", __func__);
        return -1;
    }
    if (mc->tracing()) {
        LLAMA_LOG_ERROR("%s: moe-trace: already tracing\n", __func__);
        return -1;
    }
    if (n_ubatch <= 0) {
        LLAMA_LOG_ERROR("%s: moe-trace: n_ubatch must be > 0, got %d\n", __func__, n_ubatch);
        return -1;
    }
    const auto & hp = model->hparams;
    std::vector<int> ils;
    for (int il = 0; il < (int) model->layers.size(); ++il) {
        if (llama_moe_is_moe_layer(model->layers[il])) {
            ils.push_back(il);
        }
    }
    if (ils.empty()) {
        LLAMA_LOG_WARN("%s: moe-trace: WARNING the model has no MoE layers; %s stays empty\n", __func__, path);
    }
    FILE * f = fopen(path, "wb");
    if (f == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-trace: cannot write %s\n", __func__, path);
        return -1;
    }
    const int32_t n_used = (int32_t) hp.n_expert_used();
    fprintf(f, "# pybmoe-trace v1 n_layer=%d n_expert=%d n_expert_used=%d slots=%d inserts=%d max_batch=%d\n",
            (int) model->layers.size(), (int) hp.n_expert, n_used, mc->n_slots, mc->n_inserts, mc->max_batch);
    fprintf(f, "workload,phase,ubatch,token,layer,rank,expert,hit\n");

    ggml_init_params params = { ils.size() * ggml_tensor_overhead() + 1, nullptr, true };
    mc->trace_ctx.reset(ggml_init(params));
    mc->tlayer_of_il.assign(model->layers.size(), -1);
    for (int il : ils) {
        ggml_tensor * t = ggml_new_tensor_1d(mc->trace_ctx.get(), GGML_TYPE_I32, (int64_t) n_used * n_ubatch);
        ggml_format_name(t, "blk.%d.ffn_moe_trace", il);
        mc->tlayer_of_il[il] = (int32_t) mc->tlayers.size();
        mc->tlayers.push_back({ il, n_used, t });
    }
    if (!ils.empty()) {
        mc->trace_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(mc->trace_ctx.get(), ggml_backend_cpu_buffer_type()));
        GGML_ASSERT(mc->trace_buf);
        for (auto & t : mc->tlayers) {
            std::fill((int32_t *) t.obs->data, (int32_t *) t.obs->data + ggml_nelements(t.obs), -1);
        }
    }
    mc->trace_cap  = n_ubatch;
    mc->trace_file = f;
    mc->trace_writer = std::thread([mc] { mc->trace_writer_main(); });
    LLAMA_LOG_INFO("%s: moe-trace: writing the routing of %zu MoE layers to %s\n", __func__, ils.size(), path);
    return (int32_t) ils.size();
}

int32_t llama_model_moe_route_replay_open(llama_model * model, const char * path, int32_t n_ubatch) {
    llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    if (path == nullptr || path[0] == '\0') {
        return 0;
    }
    if (mc == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: the model was not loaded from a GGUF path\n", __func__);
        return -1;
    }
    if (mc->replaying()) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: already replaying %s\n", __func__, mc->rp_path.c_str());
        return -1;
    }
    if (n_ubatch <= 0) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: n_ubatch must be > 0, got %d\n", __func__, n_ubatch);
        return -1;
    }
    const auto & hp = model->hparams;
    const int32_t n_layer  = (int32_t) model->layers.size();
    const int32_t n_expert = (int32_t) hp.n_expert;
    const int32_t n_used   = (int32_t) hp.n_expert_used();
    std::vector<bool> is_moe(n_layer, false);
    int n_moe = 0;
    for (int il = 0; il < n_layer; ++il) {
        is_moe[il] = llama_moe_is_moe_layer(model->layers[il]);
        n_moe += is_moe[il];
    }
    if (n_moe == 0) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: the model has no MoE layers to replay %s into\n", __func__, path);
        return -1;
    }
    FILE * f = fopen(path, "rb");
    if (f == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: cannot read %s\n", __func__, path);
        return -1;
    }
    // rows: workload,phase,ubatch,token,layer,rank,expert,hit (what --moe-trace writes); a token is a
    // (workload, token) pair, in the order of first appearance
    std::map<std::pair<std::string, long long>, int64_t> tok_of;
    std::vector<int32_t> ids; // [n_tok][n_layer][n_used], -1 = not in the trace
    const int64_t row = (int64_t) n_layer * n_used;
    char line[512];
    long long lineno = 0;
    std::string err;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        if (line[0] == '#' || line[0] == '\n' || strncmp(line, "workload,", 9) == 0) {
            continue;
        }
        char workload[256], phase[32];
        long long ub, tok;
        int layer, rank, expert, hit;
        if (sscanf(line, "%255[^,],%31[^,],%lld,%lld,%d,%d,%d,%d", workload, phase, &ub, &tok, &layer, &rank, &expert, &hit) != 8) {
            err = format("line %lld is not a trace row (workload,phase,ubatch,token,layer,rank,expert,hit)", lineno);
            break;
        }
        if (layer < 0 || layer >= n_layer || !is_moe[layer]) {
            err = format("line %lld: layer %d is not a MoE layer of this model (%d layers)", lineno, layer, n_layer);
            break;
        }
        if (rank < 0 || rank >= n_used) {
            err = format("line %lld: rank %d, but the model's top-k is %d; the trace is of another shape", lineno, rank, n_used);
            break;
        }
        if (expert < 0 || expert >= n_expert) {
            err = format("line %lld: expert %d, but the model has %d experts per layer", lineno, expert, n_expert);
            break;
        }
        auto [it, fresh] = tok_of.try_emplace({ workload, tok }, (int64_t) tok_of.size());
        if (fresh) {
            ids.resize(ids.size() + row, -1);
        }
        ids[it->second * row + (int64_t) layer * n_used + rank] = expert;
    }
    fclose(f);
    if (err.empty() && tok_of.empty()) {
        err = "no trace rows";
    }
    if (!err.empty()) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: %s: %s\n", __func__, path, err.c_str());
        return -1;
    }
    for (int il = 0; il < n_layer && err.empty(); ++il) {
        bool any = false;
        for (int64_t t = 0; is_moe[il] && !any && t < (int64_t) tok_of.size(); ++t) {
            any = ids[t * row + (int64_t) il * n_used] >= 0;
        }
        if (is_moe[il] && !any) {
            err = format("MoE layer %d has no rows; the trace is of another shape (the model has %d MoE layers)", il, n_moe);
        }
    }
    if (!err.empty()) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: %s: %s\n", __func__, path, err.c_str());
        return -1;
    }
    // a (token, layer) the trace lacks (a layer that computed only the outputs) repeats the layer's
    // previous token, or experts 0..k-1 at the start: those rows are not computed when the batching matches
    const int64_t n_tok = (int64_t) tok_of.size();
    int64_t n_filled = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int il = 0; il < n_layer; ++il) {
            if (!is_moe[il]) {
                continue;
            }
            int32_t * dst = ids.data() + t * row + (int64_t) il * n_used;
            bool complete = true;
            for (int k = 0; k < n_used; ++k) {
                complete = complete && dst[k] >= 0;
            }
            if (!complete) {
                n_filled++;
                for (int k = 0; k < n_used; ++k) {
                    dst[k] = t > 0 ? dst[k - row] : k;
                }
            }
        }
    }

    ggml_init_params params = { (size_t) n_moe * ggml_tensor_overhead() + 1, nullptr, true };
    mc->rp_ctx.reset(ggml_init(params));
    mc->rp_tensor_of_il.assign(n_layer, -1);
    for (int il = 0; il < n_layer; ++il) {
        if (is_moe[il]) {
            ggml_tensor * t = ggml_new_tensor_2d(mc->rp_ctx.get(), GGML_TYPE_I32, n_used, n_ubatch);
            ggml_format_name(t, "blk.%d.ffn_moe_replay", il);
            mc->rp_tensor_of_il[il] = (int32_t) mc->rp_tensors.size();
            mc->rp_tensors.push_back(t);
        }
    }
    mc->rp_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(mc->rp_ctx.get(), ggml_backend_cpu_buffer_type()));
    GGML_ASSERT(mc->rp_buf);
    mc->rp_ids     = std::move(ids);
    mc->rp_n_layer = n_layer;
    mc->rp_n_used  = n_used;
    mc->rp_cap     = n_ubatch;
    mc->rp_path    = path;
    mc->rp_cursor  = 0;
    mc->rp_n_tok   = n_tok;
    llama_moe_replay_fill(*mc);
    LLAMA_LOG("%s: moe-route-replay: %d MoE layers take their experts from %s (%lld tokens, %lld layer rows "
            "filled from the previous token); the routing weights stay the router's\n", __func__, n_moe, path,
            (long long) n_tok, (long long) n_filled);
    return n_moe;
}

std::string llama_moe_cache_prometheus(const llama_model * model) {
    llama_moe_cache_stats st;
    if (!llama_model_moe_cache_get_stats(model, &st)) {
        return "";
    }
    std::string out;
    auto item = [&](const char * type, const char * name, const char * help, const std::string & samples) {
        out += format("# HELP llamacpp:%s %s\n# TYPE llamacpp:%s %s\n%s", name, help, name, type, samples.c_str());
    };
    auto one = [](const char * name, double v) {
        return format("llamacpp:%s %.17g\n", name, v);
    };
    item("counter", "moe_cache_hits_total",         "Expert lookups served by the expert cache",   one("moe_cache_hits_total", st.hits));
    item("counter", "moe_cache_misses_total",       "Expert lookups computed from host memory",    one("moe_cache_misses_total", st.misses));
    item("counter", "moe_cache_uploads_total",      "Experts uploaded into cache slots",           one("moe_cache_uploads_total", st.uploads));
    item("counter", "moe_cache_upload_bytes_total", "Bytes uploaded into cache slots",             one("moe_cache_upload_bytes_total", st.upload_bytes));
    item("gauge",   "moe_cache_resident_bytes",     "Bytes of experts resident in cache slots",    one("moe_cache_resident_bytes", st.resident_bytes));
    std::string slots, bytes;
    for (const auto & d : model->moe_cache->devices) {
        slots += format("llamacpp:moe_cache_slots{device=\"%s\"} %lld\n", d.name.c_str(), (long long) d.slots);
        bytes += format("llamacpp:moe_cache_allocated_bytes{device=\"%s\"} %zu\n", d.name.c_str(), d.bytes);
    }
    item("gauge", "moe_cache_slots",           "Expert cache slots per device (slots per layer x cached layers)", slots);
    item("gauge", "moe_cache_allocated_bytes", "Expert cache companion bytes allocated per device",              bytes);
    return out;
}

int32_t llama_model_moe_cache_init(llama_model * model, int32_t n_slots, int32_t n_inserts) {
    return llama_moe_cache_init_impl(model, n_slots, n_inserts, LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT, 0);
}

int32_t llama_model_moe_cache_set_max_batch(llama_model * model, int32_t n_tokens) {
    llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || mc->enabled() || mc->tracing() || n_tokens < 1 || n_tokens > LLAMA_MOE_CACHE_MAX_BATCH_LIMIT) {
        LLAMA_LOG_ERROR("%s: moe-cache: max batch %d refused: it must be 1 .. %d, set on a GGUF-loaded model before the "
                "cache or the trace is opened\n", __func__, n_tokens, LLAMA_MOE_CACHE_MAX_BATCH_LIMIT);
        return -1;
    }
    mc->max_batch = n_tokens;
    return n_tokens;
}

int32_t llama_model_moe_cache_init_budget(llama_model * model, int32_t n_slots, int32_t n_inserts,
                                          int32_t floor_mib, int32_t ceil_mib) {
    return llama_moe_cache_init_impl(model, n_slots, n_inserts, floor_mib, ceil_mib);
}

bool llama_model_moe_cache_reserve(llama_model * model, ggml_backend_dev_t dev, size_t nbytes) {
    if (model == nullptr || model->moe_cache == nullptr || model->moe_cache->enabled() || dev == nullptr) {
        return false;
    }
    model->moe_cache->reserve[dev] = nbytes;
    return true;
}

void llama_moe_cache_fit_request(const char * path_model, int32_t n_slots, int32_t n_inserts) {
    g_llama_moe_fit_path    = path_model ? path_model : "";
    g_llama_moe_fit_slots   = path_model ? std::max(n_slots, 0) : 0;
    g_llama_moe_fit_inserts = std::max(n_inserts, 0);
}

int32_t llama_model_moe_cache_init_auto(llama_model * model, int32_t n_inserts, int32_t floor_mib, int32_t ceil_mib) {
    return llama_moe_cache_init_impl(model, LLAMA_MOE_CACHE_AUTO, n_inserts, floor_mib, ceil_mib);
}

void llama_moe_cache_before_ubatch(const llama_model & model) {
    if (model.moe_cache) {
        model.moe_cache->n_busy++;
    }
}

int32_t llama_model_moe_cache_set_slots(llama_model * model, int32_t n_slots) {
    llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->enabled()) {
        LLAMA_LOG_ERROR("%s: moe-cache: the cache is off; nothing to resize\n", __func__);
        return -1;
    }
    if (mc->n_busy.load() > 0) {
        LLAMA_LOG_ERROR("%s: moe-cache: a graph is being computed; resize between generations\n", __func__);
        return -2;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    int32_t cap = 0;
    for (const auto & l : mc->layers) {
        cap = std::max(cap, l.n_cap);
    }
    if (n_slots < 0 || n_slots > cap) {
        LLAMA_LOG_ERROR("%s: moe-cache: %d slots is out of range; accepted: 0 .. %d (the slots allocated at load)\n",
                __func__, n_slots, cap);
        return -1;
    }
    llama_moe_settle(*mc); // no slot is being written while the tables change
    for (auto & l : mc->layers) {
        l.n_slots = std::min(n_slots, l.n_cap);
        // shrinking evicts at once, least recently used first
        while (l.n_resident > l.n_slots) {
            llama_moe_evict(l, llama_moe_lru_victim(l, UINT64_MAX));
        }
        l.misses_now.clear();
    }
    llama_moe_publish(*mc);
    LLAMA_LOG("%s: moe-cache: %d slots/layer now\n", __func__, n_slots);
    return n_slots;
}
