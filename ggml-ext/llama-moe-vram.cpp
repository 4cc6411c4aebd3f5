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
#include <array>
#include <cstring>

int llama_moe_bias_list(const llama_layer & layer, const ggml_tensor * out[LLAMA_MOE_N_BIAS]) {
    int n = 0;
    for (const ggml_tensor * b : { layer.ffn_up_exps_b, layer.ffn_gate_exps_b, layer.ffn_gate_up_exps_b, layer.ffn_down_exps_b }) {
        if (b != nullptr && n < LLAMA_MOE_N_BIAS) {
            out[n++] = b;
        }
    }
    return n;
}

int32_t llama_moe_vram::layer_of_ir(int32_t ir) const {
    for (size_t li = 0; li < layers.size(); ++li) {
        if (layers[li].ir == ir) {
            return (int32_t) li;
        }
    }
    return -1;
}

const llama_moe_vram_layer * llama_moe_vram::layer(int il) const {
    if (il < 0 || il >= (int) layer_of_il.size() || layer_of_il[il] < 0) {
        return nullptr;
    }
    return &layers[layer_of_il[il]];
}

llama_moe_device_slots llama_moe_vram::device_slots(int32_t il) const {
    const llama_moe_vram_layer * l = enabled() ? layer(il) : nullptr;
    llama_moe_device_slots out;
    if (l != nullptr) {
        out.slot   = (const int32_t *) l->host_table->data;
        out.n_phys = l->n_phys;
    }
    return out;
}

void llama_moe_vram::disable() {
    uploader.stop();
    layers.clear();
    tables.clear();
    tickets.clear();
    devices.clear();
    host_buf.reset();
    host_ctx.reset();
    alloc_bytes = 0;
    res = {};
    n_slots = 0;
}

//
// the per-step protocol
//

void llama_moe_vram::check_routed(const char * arch) {
    routed_checked = true;
    for (size_t i = 0; i < layers.size(); ++i) {
        if (!routed[i]) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING layer %d of %s is cached but its decode graph does not route through "
                    "the cache (the architecture's graph does not compute this layer's experts with build_moe_ffn), "
                    "so its %d slots never serve\n", __func__, layers[i].il, arch, n_slots);
        }
    }
}

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

void llama_moe_vram::settle(bool all) {
    size_t n = 0;
    if (sync || all) {
        if (uploader.done() < (tickets.empty() ? 0 : tickets.back())) {
            const int64_t t0 = ggml_time_us();
            uploader.wait();
            upload_wait_us += (uint64_t) (ggml_time_us() - t0);
            n_waits++;
        }
        n = res.moving.size();
    } else {
        const uint64_t done = uploader.done();
        while (n < tickets.size() && tickets[n] <= done) {
            n++; // one worker copies in ticket order: the done moves are a prefix
        }
    }
    for (size_t i = 0; i < n; ++i) {
        uploads++;
        upload_bytes += layers[res.moving[i].layer].expert_bytes();
    }
    res.settle(n);
    tickets.erase(tickets.begin(), tickets.begin() + (ptrdiff_t) n);
}

bool llama_moe_vram::dirty() const {
    for (const auto & r : res.layers) {
        if (r.dirty) {
            return true;
        }
    }
    return false;
}

void llama_moe_vram::publish() {
    for (const auto & l : layers) {
        auto & r = res.layers[l.ir];
        if (!r.dirty) {
            continue;
        }
        memcpy(l.host_table->data, r.table.data(), r.table.size()*sizeof(int32_t));
        auto & tb = tables[l.tb];
        std::copy(r.table.begin(), r.table.end(), tb.host.begin() + (ptrdiff_t) l.tb_offs);
        tb.dirty = true;
        r.dirty = false;
    }
    for (auto & tb : tables) {
        if (tb.dirty) {
            ggml_backend_tensor_set(tb.t, tb.host.data(), 0, tb.host.size()*sizeof(int32_t));
            n_h2d_tables++;
            tb.dirty = false;
        }
    }
}

static void llama_moe_vram_count_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    GGML_UNUSED(dst); GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto * op = (llama_moe_vram::count_op *) userdata;
    auto & counts = op->vram->prefill_counts[op->li];
    for (int64_t r = 0; r < a->ne[1]; ++r) {
        for (int64_t k = 0; k < a->ne[0]; ++k) {
            const int32_t e = *(const int32_t *) ((const char *) a->data + r*a->nb[1] + k*a->nb[0]);
            if (e >= 0 && e < (int32_t) counts.size()) {
                counts[e]++;
            }
        }
    }
    op->vram->prefill_seen = true;
}

void llama_moe_vram::graph_count(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * selected, int32_t li) const {
    if (warmup <= 0 || li < 0 || li >= (int32_t) count_ops.size()) {
        return;
    }
    // note: the op writes only the model's counters (its output is a dummy); the CPU runs it
    ggml_tensor * out = ggml_map_custom1(ctx, selected, llama_moe_vram_count_op, 1, const_cast<count_op *>(&count_ops[li]));
    ggml_format_name(out, "blk.%d.ffn_moe_cache_count", layers[li].il);
    ggml_build_forward_expand(gf, out);
}

void llama_moe_vram::schedule() {
    const size_t first = res.moving.size();
    res.schedule();
    if (prefill_seen) {
        // the prefill warm-up: each layer's most used experts, most used first (ties: lower id)
        for (size_t li = 0; li < layers.size(); ++li) {
            auto & c = prefill_counts[li];
            std::vector<int32_t> order;
            for (int32_t e = 0; e < (int32_t) c.size(); ++e) {
                if (c[e] > 0) {
                    order.push_back(e);
                }
            }
            std::stable_sort(order.begin(), order.end(), [&c](int32_t a, int32_t b) { return c[a] > c[b]; });
            warmup_uploads += (uint64_t) res.warm(layers[li].ir, order, warmup);
            std::fill(c.begin(), c.end(), 0);
        }
        prefill_seen = false;
    }
    // the new moves, layer by layer (res.schedule appends them so); a layer's copies go projection by
    // projection, and each move is done once its layer's last copy is
    size_t i = first;
    while (i < res.moving.size()) {
        size_t j = i;
        while (j < res.moving.size() && res.moving[j].layer == res.moving[i].layer) {
            j++;
        }
        const llama_moe_vram_layer & l = layers[res.moving[i].layer];
        const bool streamed = ram != nullptr && ram->streams(l.il);
        // where each move's bytes come from: the stream tier's RAM copy, the host tensor, or the file
        std::vector<std::array<const void *, LLAMA_MOE_N_PROJ>> mem(j - i);
        std::vector<int32_t> pin(j - i, -1);
        for (size_t m = i; m < j; ++m) {
            const llama_moe_move & mv = res.moving[m];
            auto & src = mem[m - i];
            src.fill(nullptr);
            const void * copy[LLAMA_MOE_N_PROJ] = {};
            const int32_t entry = streamed ? ram->pin(l.il, mv.expert, copy) : -1;
            for (int p = 0; p < l.n_proj; ++p) {
                if (entry >= 0) {
                    src[p] = copy[p];
                } else if (!streamed && l.exps[p]->buffer && ggml_backend_buffer_is_host(l.exps[p]->buffer) && l.exps[p]->data) {
                    src[p] = (const uint8_t *) l.exps[p]->data + (size_t) mv.expert * l.expert_nbytes[p];
                }
            }
            pin[m - i] = entry;
        }
        uint64_t ticket = 0;
        for (int p = 0; p < l.n_proj; ++p) {
            const size_t n  = l.expert_nbytes[p];
            const size_t nb = l.slots[p]->nb[2];
            llama_moe_copy cur = {};
            bool open = false;
            std::vector<int32_t> cur_pins;
            auto flush = [&]() {
                if (!open) {
                    return;
                }
                // the pins go with the last projection's copies: the copies run in order
                cur.pins = p == l.n_proj - 1 ? cur_pins : std::vector<int32_t>();
                ticket = uploader.enqueue(cur);
                open = false;
                cur_pins.clear();
            };
            for (size_t m = i; m < j; ++m) {
                const llama_moe_move & mv = res.moving[m];
                const void * msrc = mem[m - i][p];
                const size_t offs = l.src[p].offs + (size_t) mv.expert * n;
                const size_t doff = (size_t) mv.slot * nb;
                const bool adjacent = open && nb == n && cur.dst_offs + cur.nbytes == doff &&
                    (msrc ? cur.mem && (const uint8_t *) cur.mem + cur.nbytes == msrc
                          : !cur.mem && cur.offs + cur.nbytes == offs);
                if (adjacent) {
                    cur.nbytes += n;
                } else {
                    flush();
                    cur = { l.src[p].file, offs, n, l.slots[p], doff, msrc, {} };
                    open = true;
                }
                if (pin[m - i] >= 0) {
                    cur_pins.push_back(pin[m - i]);
                }
            }
            flush();
        }
        for (size_t m = i; m < j; ++m) {
            tickets.push_back(ticket);
        }
        i = j;
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
    out.sync              = sync ? 1 : 0;
    out.upload_wait_us    = upload_wait_us;
    out.n_h2d             = uploader.n_h2d.load() + n_h2d_tables;
    out.n_waits           = n_waits;
    out.upload_file_bytes = uploader.file_bytes.load();
    out.upload_busy_us    = uploader.busy_us.load();
    out.n_publish         = n_h2d_tables;
    out.warmup_uploads    = warmup_uploads;
    out.warmup            = warmup;
    out.n_syncs           = n_syncs;
    out.n_step_moves      = res.n_step_moves;
    // demand (the BigMoeOnEdge seed's layer_demand_MiB / token_demand_MiB): expert bytes requested per
    // served step, by the widest layer and by all cached layers together
    for (const auto & l : layers) {
        const auto & r = res.layers[l.ir];
        const double d = res.n_steps ? (double) (r.hits + r.misses) * l.expert_bytes() / res.n_steps / 1024.0 / 1024.0 : 0.0;
        out.layer_demand_mib  = std::max(out.layer_demand_mib, d);
        out.token_demand_mib += d;
    }
    out.admit_window      = res.admit_window;
    out.n_bypassed        = res.n_bypassed;
}

void llama_moe_vram::get_device_stats(size_t i, llama_moe_cache_device_stats & out) const {
    const auto & d = devices.at(i);
    out = {};
    snprintf(out.name, sizeof(out.name), "%s", d.name.c_str());
    out.n_slots     = d.slots;
    out.alloc_bytes = d.bytes;
    out.n_banks     = d.n_banks;
    out.n_layers    = (int32_t) d.n_layers;
    for (size_t li = d.first; li < d.first + d.n_layers; ++li) {
        const auto & r = res.layers[layers[li].ir];
        out.n_resident  += r.n_resident;
        out.hits        += r.hits;
        out.misses      += r.misses;
        out.n_slots_now += r.bank < 0 ? r.n_slots : 0;
    }
    for (const auto & bk : res.banks) {
        const size_t li = (size_t) layer_of_ir(bk.layers[0]);
        out.n_slots_now += li >= d.first && li < d.first + d.n_layers ? bk.n_slots : 0;
    }
}

void llama_moe_vram::print_summary() const {
    llama_moe_cache_stats st;
    get_stats(st);
    const uint64_t n = st.hits + st.misses;
    // the pool: each device's slots, residents and hit rate
    std::string pools;
    for (size_t i = 0; i < devices.size(); ++i) {
        llama_moe_cache_device_stats d;
        get_device_stats(i, d);
        if (d.n_banks > 0) {
            const uint64_t nd = d.hits + d.misses;
            pools += format(", pool %s: %lld slots, %lld resident, %.1f%% hit", d.name, (long long) d.n_slots_now,
                    (long long) d.n_resident, nd ? 100.0*d.hits/nd : 0.0);
        }
    }
    // note: level NONE, so the line shows at the default verbosity, like the tools' own output
    // upload wait: time steps spent waiting for uploads; h2d: host-to-device calls; waits: blocking
    // waits; upload GB/s: the uploader's own rate while copying
    LLAMA_LOG("moe-cache: %.1f%% hit, resident %.1f MiB, uploads %llu (%.1f MiB), layer_demand %.2f MiB, "
            "token_demand %.2f MiB, steps %llu, upload wait %.1f ms, h2d %llu (%llu publishes), waits %llu, "
            "upload %.2f GB/s, file %.1f MiB, %s, warmup %llu%s%s\n",
            n ? 100.0*st.hits/n : 0.0, st.resident_bytes/1024.0/1024.0,
            (unsigned long long) st.uploads, st.upload_bytes/1024.0/1024.0, st.layer_demand_mib, st.token_demand_mib,
            (unsigned long long) st.n_steps, st.upload_wait_us/1000.0, (unsigned long long) st.n_h2d,
            (unsigned long long) st.n_publish, (unsigned long long) st.n_waits, st.upload_busy_us ? st.upload_bytes/1e3/st.upload_busy_us : 0.0,
            st.upload_file_bytes/1024.0/1024.0, sync ? "sync" : "async", (unsigned long long) st.warmup_uploads,
            st.admit_window > 0 ? format(", admit second-miss:%d (%llu misses not admitted)", st.admit_window,
                                         (unsigned long long) st.n_bypassed).c_str() : "", pools.c_str());
}

//
// C API
//

static const llama_moe_tiers * llama_moe_vram_of(const llama_model * model) {
    const llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    return mc && mc->vram.enabled() ? mc : nullptr;
}

bool llama_model_moe_cache_get_stats(const llama_model * model, llama_moe_cache_stats * out) {
    const llama_moe_tiers * mc = llama_moe_vram_of(model);
    if (mc == nullptr || out == nullptr) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    mc->vram.get_stats(*out);
    return true;
}

bool llama_model_moe_cache_get_layer_stats(const llama_model * model, int32_t il, uint64_t * hits, uint64_t * misses) {
    const llama_moe_tiers * mc = llama_moe_vram_of(model);
    const llama_moe_vram_layer * l = mc ? mc->vram.layer(il) : nullptr;
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
    const llama_moe_tiers * mc = llama_moe_vram_of(model);
    return mc ? (int32_t) mc->vram.devices.size() : 0;
}

bool llama_model_moe_cache_get_device_stats(const llama_model * model, int32_t i, llama_moe_cache_device_stats * out) {
    const llama_moe_tiers * mc = llama_moe_vram_of(model);
    if (mc == nullptr || out == nullptr || i < 0 || i >= (int32_t) mc->vram.devices.size()) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    mc->vram.get_device_stats((size_t) i, *out);
    return true;
}

int32_t llama_model_moe_cache_set_slots(llama_model * model, int32_t n_slots) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->vram.enabled()) {
        LLAMA_LOG_ERROR("%s: moe-cache: the cache is off; nothing to resize\n", __func__);
        return -1;
    }
    if (mc->busy(__func__, "moe-cache", "resize")) {
        return LLAMA_MOE_ERR_BUSY;
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
    vram.settle(/*all =*/ true); // no slot is being written while the tables change
    vram.res.resize(n_slots);
    vram.publish();
    if (vram.res.banks.empty()) {
        LLAMA_LOG("%s: moe-cache: %d slots/layer now\n", __func__, n_slots);
    } else {
        int64_t P = 0;
        for (const auto & bk : vram.res.banks) {
            P += bk.n_slots;
        }
        LLAMA_LOG("%s: moe-cache: %d slots/layer now: the pool holds %lld slots\n", __func__, n_slots, (long long) P);
    }
    return n_slots;
}

int32_t llama_model_moe_cache_set_warmup(llama_model * model, int32_t n_per_layer) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->vram.enabled() || n_per_layer < 0) {
        LLAMA_LOG_ERROR("%s: moe-cache: warm-up %d refused: the cache is off, or the value is negative\n", __func__, n_per_layer);
        return -1;
    }
    if (mc->busy(__func__, "moe-cache", "change the warm-up")) {
        return LLAMA_MOE_ERR_BUSY;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    auto & vram = mc->vram;
    vram.warmup = n_per_layer;
    if (vram.count_ops.empty()) {
        for (size_t li = 0; li < vram.layers.size(); ++li) {
            vram.count_ops.push_back({ &vram, (int32_t) li });
            vram.prefill_counts.emplace_back(vram.layers[li].n_expert, 0u);
        }
    }
    return n_per_layer;
}

int32_t llama_model_moe_cache_set_upload_budget_mib(llama_model * model, int32_t budget_mib) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->vram.enabled()) {
        LLAMA_LOG_ERROR("%s: moe-cache: the cache is off\n", __func__);
        return -1;
    }
    size_t expert = 0;
    for (const auto & l : mc->vram.layers) {
        expert = std::max(expert, l.expert_bytes());
    }
    const int64_t n = budget_mib > 0 ? ((int64_t) budget_mib << 20) / (int64_t) expert : 0;
    if (budget_mib < 0 || (budget_mib > 0 && n < 1)) {
        LLAMA_LOG_ERROR("%s: moe-cache: upload budget %d MiB refused: it must be 0 (unlimited) or at least one expert "
                "(%.2f MiB)\n", __func__, budget_mib, expert/1024.0/1024.0);
        return -1;
    }
    if (mc->busy(__func__, "moe-cache", "change the upload budget")) {
        return LLAMA_MOE_ERR_BUSY;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    mc->vram.res.n_step_moves = (int32_t) std::min<int64_t>(n, INT32_MAX);
    LLAMA_LOG_INFO("%s: moe-cache: upload budget %d MiB per step: %lld experts of %.2f MiB\n", __func__, budget_mib,
            (long long) n, expert/1024.0/1024.0);
    return (int32_t) n;
}

int32_t llama_model_moe_cache_set_admit_window(llama_model * model, int32_t window) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->vram.enabled() || window < 0 || window > LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX) {
        LLAMA_LOG_ERROR("%s: moe-cache: admission window %d refused: it must be 0 (always) .. %d steps, on a cache "
                "that is on\n", __func__, window, LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX);
        return -1;
    }
    if (mc->busy(__func__, "moe-cache", "change the admission")) {
        return LLAMA_MOE_ERR_BUSY;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    mc->vram.res.admit_window = window;
    if (mc->trace.on()) {
        LLAMA_LOG_WARN("%s: moe-cache: WARNING the admission changed after the trace was opened: its header does not "
                "say admit=%d\n", __func__, window);
    }
    LLAMA_LOG_INFO("%s: moe-cache: admission %s\n", __func__, window > 0 ?
            format("second-miss: a miss is uploaded when the expert also missed at one of its layer's last %d steps", window).c_str() :
            "always: every miss is uploaded");
    return window;
}

int32_t llama_model_moe_cache_set_sync(llama_model * model, bool sync) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->vram.enabled()) {
        LLAMA_LOG_ERROR("%s: moe-cache: the cache is off\n", __func__);
        return -1;
    }
    if (mc->busy(__func__, "moe-cache", "change the mode")) {
        return LLAMA_MOE_ERR_BUSY;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    mc->vram.sync = sync;
    return 0;
}
