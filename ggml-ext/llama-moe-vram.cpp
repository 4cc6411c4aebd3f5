// pybmoe: the VRAM tier's per-step protocol, stats and resize. See llama-moe-vram.h.
//
// Holds: what happens to the tier after each ubatch (account, settle, publish, schedule), its
// counters and the C API that reads or resizes it. Must not hold: sizing and allocation
// (llama-moe-vram-init.cpp), graph code (llama-moe-graph.cpp) or the policy (llama-moe-residency.cpp).

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstring>

int llama_moe_proj_list(const ggml_tensor * up, const ggml_tensor * gate, const ggml_tensor * down,
                        const ggml_tensor * gate_up, const ggml_tensor * out[LLAMA_MOE_N_PROJ],
                        const char * names[LLAMA_MOE_N_PROJ]) {
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

int llama_moe_layer_exps(const llama_layer & layer, const ggml_tensor * out[LLAMA_MOE_N_PROJ],
                         const char * names[LLAMA_MOE_N_PROJ]) {
    return llama_moe_proj_list(layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps, layer.ffn_gate_up_exps, out, names);
}

int llama_moe_bias_list(const llama_layer & layer, const ggml_tensor * out[LLAMA_MOE_N_BIAS]) {
    int n = 0;
    for (const ggml_tensor * b : { layer.ffn_up_exps_b, layer.ffn_gate_exps_b, layer.ffn_gate_up_exps_b, layer.ffn_down_exps_b }) {
        if (b != nullptr && n < LLAMA_MOE_N_BIAS) {
            out[n++] = b;
        }
    }
    return n;
}

const llama_moe_cache_layer * llama_moe_vram::layer(int il) const {
    if (il < 0 || il >= (int) layer_of_il.size() || layer_of_il[il] < 0) {
        return nullptr;
    }
    return &layers[layer_of_il[il]];
}

void llama_moe_vram::disable() {
    uploader.stop();
    layers.clear();
    res = {};
    n_slots = 0;
}

//
// the per-step protocol
//

void llama_moe_vram::account() {
    bool any = false;
    for (const auto & l : layers) {
        int32_t * obs = (int32_t *) l.observed->data;
        const int64_t n = ggml_nelements(l.observed);
        if (obs[0] < 0) {
            res.skip(l.ir);
            continue;
        }
        any = true;
        int64_t n_ids = 0;
        while (n_ids < n && obs[n_ids] >= 0) {
            n_ids++;
        }
        res.lookup(l.ir, obs, n_ids);
        std::fill(obs, obs + n, -1);
    }
    res.end_ubatch(any);
}

void llama_moe_vram::settle() {
    uploader.wait();
    for (const auto & m : res.moving) {
        uploads++;
        upload_bytes += layers[m.layer].expert_bytes();
    }
    res.settle();
}

void llama_moe_vram::publish() {
    for (const auto & l : layers) {
        auto & r = res.layers[l.ir];
        if (!r.dirty) {
            continue;
        }
        memcpy(l.host_table->data, r.table.data(), r.table.size()*sizeof(int32_t));
        ggml_backend_tensor_set(l.dev_table, r.table.data(), 0, r.table.size()*sizeof(int32_t));
        r.dirty = false;
    }
}

void llama_moe_vram::schedule() {
    const size_t first = res.moving.size();
    res.schedule();
    for (size_t i = first; i < res.moving.size(); ++i) {
        const llama_moe_move & m = res.moving[i];
        const llama_moe_cache_layer & l = layers[m.layer];
        for (int p = 0; p < l.n_proj; ++p) {
            const size_t n = l.expert_nbytes[p];
            uploader.enqueue({ l.src[p].file, l.src[p].offs + (size_t) m.expert * n, n, l.slots[p],
                               (size_t) m.slot * l.slots[p]->nb[2] });
        }
    }
}

//
// stats
//

void llama_moe_vram::get_stats(llama_moe_cache_stats & out) const {
    out = {};
    for (const auto & l : layers) {
        const auto & r = res.layers[l.ir];
        out.hits   += r.hits;
        out.misses += r.misses;
        out.resident_bytes += (uint64_t) r.n_resident * l.expert_bytes();
        out.n_slots = std::max(out.n_slots, r.n_slots); // now: a resize between generations changes it
    }
    out.uploads       = uploads;
    out.upload_bytes  = upload_bytes;
    out.alloc_bytes   = alloc_bytes;
    out.n_steps       = res.n_steps;
    out.n_layers      = (int32_t) layers.size();
    out.n_inserts     = res.n_inserts;
    out.n_expert      = layers[0].n_expert;
    out.n_expert_used = layers[0].n_used;
}

void llama_moe_vram::print_summary() const {
    llama_moe_cache_stats st;
    get_stats(st);
    const uint64_t n = st.hits + st.misses;
    // demand (the BigMoeOnEdge seed's layer_demand_MiB / token_demand_MiB): expert bytes requested per
    // served step, by the widest layer and by all cached layers together
    double layer_demand = 0.0, token_demand = 0.0;
    for (const auto & l : layers) {
        const auto & r = res.layers[l.ir];
        const double d = res.n_steps ? (double) (r.hits + r.misses) * l.expert_bytes() / res.n_steps / 1024.0 / 1024.0 : 0.0;
        layer_demand  = std::max(layer_demand, d);
        token_demand += d;
    }
    // note: level NONE, so the line shows at the default verbosity, like the tools' own output
    LLAMA_LOG("moe-cache: %.1f%% hit, resident %.1f MiB, uploads %llu (%.1f MiB), layer_demand %.2f MiB, "
            "token_demand %.2f MiB, steps %llu\n",
            n ? 100.0*st.hits/n : 0.0, st.resident_bytes/1024.0/1024.0,
            (unsigned long long) st.uploads, st.upload_bytes/1024.0/1024.0, layer_demand, token_demand,
            (unsigned long long) st.n_steps);
}

//
// C API
//

static const llama_moe_cache * llama_moe_vram_of(const llama_model * model) {
    const llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    return mc && mc->vram.enabled() ? mc : nullptr;
}

bool llama_model_moe_cache_get_stats(const llama_model * model, llama_moe_cache_stats * out) {
    const llama_moe_cache * mc = llama_moe_vram_of(model);
    if (mc == nullptr || out == nullptr) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    mc->vram.get_stats(*out);
    return true;
}

bool llama_model_moe_cache_get_layer_stats(const llama_model * model, int32_t il, uint64_t * hits, uint64_t * misses) {
    const llama_moe_cache * mc = llama_moe_vram_of(model);
    const llama_moe_cache_layer * l = mc ? mc->vram.layer(il) : nullptr;
    if (l == nullptr) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    const auto & r = mc->vram.res.layers[l->ir];
    if (hits)   { *hits   = r.hits; }
    if (misses) { *misses = r.misses; }
    return true;
}

int32_t llama_model_moe_cache_n_devices(const llama_model * model) {
    const llama_moe_cache * mc = llama_moe_vram_of(model);
    return mc ? (int32_t) mc->vram.devices.size() : 0;
}

bool llama_model_moe_cache_get_device_stats(const llama_model * model, int32_t i, llama_moe_cache_device_stats * out) {
    const llama_moe_cache * mc = llama_moe_vram_of(model);
    if (mc == nullptr || out == nullptr || i < 0 || i >= (int32_t) mc->vram.devices.size()) {
        return false;
    }
    const auto & d = mc->vram.devices[i];
    *out = {};
    snprintf(out->name, sizeof(out->name), "%s", d.name.c_str());
    out->n_slots     = d.slots;
    out->alloc_bytes = d.bytes;
    return true;
}

int32_t llama_model_moe_cache_set_slots(llama_model * model, int32_t n_slots) {
    llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->vram.enabled()) {
        LLAMA_LOG_ERROR("%s: moe-cache: the cache is off; nothing to resize\n", __func__);
        return -1;
    }
    if (mc->n_busy.load() > 0) {
        LLAMA_LOG_ERROR("%s: moe-cache: a graph is being computed; resize between generations\n", __func__);
        return -2;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    auto & vram = mc->vram;
    int32_t cap = 0;
    for (const auto & r : vram.res.layers) {
        cap = std::max(cap, r.n_cap);
    }
    if (n_slots < 0 || n_slots > cap) {
        LLAMA_LOG_ERROR("%s: moe-cache: %d slots is out of range; accepted: 0 .. %d (the slots allocated at load)\n",
                __func__, n_slots, cap);
        return -1;
    }
    vram.settle(); // no slot is being written while the tables change
    vram.res.resize(n_slots);
    vram.publish();
    LLAMA_LOG("%s: moe-cache: %d slots/layer now\n", __func__, n_slots);
    return n_slots;
}
