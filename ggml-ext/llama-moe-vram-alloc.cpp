// pybmoe: the VRAM tier's companion tensors: per device, the slots (each layer its own, or the pool's
// banks), the id->slot table and the bias copies; on the host, the tables the CPU MUL_MAT_ID reads and the
// observed routing. See llama-moe-vram.h.
//
// Holds: allocation at load and its lines. Must not hold: which layers are cached and how many slots each
// device gets (llama-moe-vram-init.cpp, llama-moe-vram-sizing.cpp), or anything that runs per step.

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <map>

// the banks of a device's layers when they pool their slots: the layers whose experts have the same
// projections, types and shapes share one (in order of first appearance; each bank in forward order)
static std::vector<std::vector<int>> llama_moe_vram_banks(const llama_model & model, const std::vector<int> & ils) {
    std::vector<std::string> keys;
    std::vector<std::vector<int>> banks;
    for (int il : ils) {
        const char * names[LLAMA_MOE_N_PROJ] = {};
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        const int n_proj = llama_moe_layer_exps(model.layers[il], exps, names);
        std::string key;
        for (int p = 0; p < n_proj; ++p) {
            key += format("%s:%s:%lld:%lld;", names[p], ggml_type_name(exps[p]->type), (long long) exps[p]->ne[0],
                    (long long) exps[p]->ne[1]);
        }
        const size_t b = std::find(keys.begin(), keys.end(), key) - keys.begin();
        if (b == keys.size()) {
            keys.push_back(key);
            banks.emplace_back();
        }
        banks[b].push_back(il);
    }
    return banks;
}

// the pool's resident slots for a bank of n layers that takes the bytes of `slots` per layer with their
// staging and zero slots (n_phys_layer = slots + staging + 1 each): the most P whose P + S(P) + 1 fit
static int32_t llama_moe_vram_bank_slots(int32_t n, int32_t n_expert, int32_t n_used, int32_t n_phys_layer) {
    const int64_t room = (int64_t) n * n_phys_layer;
    for (int32_t P = n * n_expert; P > 0; --P) {
        if (P + llama_moe_pool_stage_slots(n, n_expert, n_used, P) + 1 <= room) {
            return P;
        }
    }
    return 0;
}

// the device companions of the layers `ils` in buft, one context + buffer (into `held`); the layers
// are appended to vram.layers. pool: the layers of one expert shape share one bank of slots, with the
// bytes `dev_slots` per layer would take. Returns false (logged) when the buffer cannot be allocated.
static bool llama_moe_vram_alloc(llama_model & model, llama_moe_tiers & mc, ggml_backend_buffer_type_t buft,
                                 const std::vector<int> & ils, int32_t dev_slots, int32_t n_stage, bool pool,
                                 std::string & budgets, llama_moe_held_buffers & held) {
    auto & vram = mc.vram;
    const int32_t n_expert = (int32_t) model.hparams.n_expert;
    const int32_t n_used   = (int32_t) model.hparams.n_expert_used();
    const auto groups = pool ? llama_moe_vram_banks(model, ils) : std::vector<std::vector<int>>();
    ggml_init_params params = {
        /*.mem_size   =*/ (ils.size() * (LLAMA_MOE_N_PROJ + LLAMA_MOE_N_BIAS + 1) + groups.size() * LLAMA_MOE_N_PROJ + 1) * ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr ctx { ggml_init(params) };
    // the pool: each bank's slot tensors, shared by its layers
    struct bank_alloc {
        int32_t n_slots = 0, n_stage = 0;
        ggml_tensor * slots[LLAMA_MOE_N_PROJ] = {};
        std::vector<int32_t> irs;
    };
    std::vector<bank_alloc> banks(groups.size());
    std::map<int, size_t> bank_of; // model layer -> bank
    for (size_t b = 0; b < groups.size(); ++b) {
        const int32_t n = (int32_t) groups[b].size();
        auto & ba = banks[b];
        ba.n_slots = llama_moe_vram_bank_slots(n, n_expert, n_used, dev_slots + n_stage + 1);
        ba.n_stage = llama_moe_pool_stage_slots(n, n_expert, n_used, ba.n_slots);
        const char * names[LLAMA_MOE_N_PROJ] = {};
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        const int n_proj = llama_moe_layer_exps(model.layers[groups[b][0]], exps, names);
        for (int p = 0; p < n_proj; ++p) {
            ba.slots[p] = ggml_new_tensor_3d(ctx.get(), exps[p]->type, exps[p]->ne[0], exps[p]->ne[1], ba.n_slots + ba.n_stage + 1);
            ggml_format_name(ba.slots[p], "bank%zu.ffn_%s_exps.cache", vram.res.banks.size() + b, names[p]);
        }
        for (int il : groups[b]) {
            bank_of[il] = b;
        }
    }
    // one id->slot table for all the device's layers: one copy publishes a step's changes
    llama_moe_vram::device_table tb;
    tb.t = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, (int64_t) n_expert * (int64_t) ils.size());
    ggml_format_name(tb.t, "ffn_exps.cache_tables");
    tb.host.assign((size_t) ggml_nelements(tb.t), 0);
    const int32_t itb = (int32_t) vram.tables.size();
    const size_t first = vram.layers.size();
    for (const int & il : ils) { // by reference: its index in ils places its table
        const auto & layer = model.layers[il];
        bank_alloc * ba = pool ? &banks[bank_of.at(il)] : nullptr;
        llama_moe_vram_layer l;
        l.il = il; l.n_expert = n_expert; l.n_used = n_used; l.log = &mc.log;
        l.n_phys = ba ? ba->n_slots + ba->n_stage : dev_slots + n_stage;
        l.ir = ba ? vram.res.add_layer(n_expert, 0, 0) : vram.res.add_layer(n_expert, dev_slots, n_stage);
        if (ba) {
            ba->irs.push_back(l.ir);
        }
        const char * names[LLAMA_MOE_N_PROJ] = {};
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        l.n_proj = llama_moe_layer_exps(layer, exps, names);
        for (int p = 0; p < l.n_proj; ++p) {
            const ggml_tensor * t = exps[p];
            l.exps[p] = t;
            l.src[p]  = mc.sources.tensors.at(ggml_get_name(t));
            l.expert_nbytes[p] = t->nb[2];
            GGML_ASSERT(l.src[p].nbytes == t->nb[2] * (size_t) n_expert && "expert layout differs from the GGUF");
            if (ba) {
                l.slots[p] = ba->slots[p];
                continue;
            }
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
        l.tb      = itb;
        l.tb_offs = (size_t) n_expert * (size_t) (&il - ils.data());
        l.dev_table = ggml_view_2d(ctx.get(), tb.t, 1, n_expert, sizeof(int32_t), l.tb_offs * sizeof(int32_t));
        ggml_format_name(l.dev_table, "blk.%d.ffn_exps.cache_table", il);
        vram.layer_of_il[il] = (int32_t) vram.layers.size();
        vram.layers.push_back(std::move(l));
    }
    int64_t n_pool = 0, n_pool_stage = 0;
    for (const auto & ba : banks) {
        vram.res.add_bank(ba.irs, ba.n_slots, ba.n_stage, n_used);
        n_pool       += ba.n_slots;
        n_pool_stage += ba.n_stage;
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
    if (buf == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-cache: cannot allocate %d slots per layer in %s; the cache is OFF\n",
                __func__, dev_slots, ggml_backend_buft_name(buft));
        return false;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(buf, 0); // every slot, including the dummy slot, computes exact zeros
    vram.tables.push_back(std::move(tb));
    std::vector<uint8_t> bias_bytes;   // the bias copies: the model's values, once
    for (size_t li = first; li < vram.layers.size(); ++li) {
        const auto & l = vram.layers[li];
        for (int b = 0; b < l.n_bias; ++b) {
            bias_bytes.resize(ggml_nbytes(l.bias_host[b]));
            ggml_backend_tensor_get(l.bias_host[b], bias_bytes.data(), 0, bias_bytes.size());
            ggml_backend_tensor_set(l.bias_dev[b], bias_bytes.data(), 0, bias_bytes.size());
        }
    }
    const size_t size = ggml_backend_buffer_get_size(buf);
    vram.alloc_bytes += size;
    budgets += format("%s%s:%.2f", budgets.empty() ? "" : ",", ggml_backend_buft_name(buft), size/1024.0/1024.0);
    vram.devices.push_back({ ggml_backend_buft_name(buft), pool ? n_pool : (int64_t) dev_slots * (int64_t) ils.size(), size,
                             first, ils.size(), pool ? (int32_t) banks.size() : 0 });
    // what the bytes are: resident slots, staging slots (uploads land there), the zero slot(s), and the rest
    // (the id->slot table and the bias copies, plus alignment)
    const double mib = 1024.0 * 1024.0;
    double slots_b = 0.0, stage_b = 0.0, zero_b = 0.0;
    if (pool) {
        for (const auto & ba : banks) { // a bank's layers share one expert size
            const double e = (double) vram.layers[vram.layer_of_ir(ba.irs[0])].expert_bytes();
            slots_b += e * ba.n_slots;
            stage_b += e * ba.n_stage;
            zero_b  += e;
        }
    } else {
        for (size_t li = first; li < vram.layers.size(); ++li) {
            const double e = (double) vram.layers[li].expert_bytes();
            slots_b += e * dev_slots;
            stage_b += e * n_stage;
            zero_b  += e;
        }
    }
    if (pool) {
        // note: level NONE, one line per device: which pool each device holds shows at the default verbosity
        LLAMA_LOG("%s: moe-cache: %8.2f MiB of expert slots for %zu layers in %s: one pool of %lld slots over "
                "(layer, expert) in %zu bank(s) (%.2f MiB resident, %.2f per layer), %.2f MiB staging (%lld), %.2f MiB "
                "zero slot, %.2f MiB tables and bias copies\n", __func__, size/mib, ils.size(), ggml_backend_buft_name(buft),
                (long long) n_pool, banks.size(), slots_b/mib, (double) n_pool / ils.size(), stage_b/mib,
                (long long) n_pool_stage, zero_b/mib, std::max(0.0, size - slots_b - stage_b - zero_b)/mib);
    } else {
        LLAMA_LOG_INFO("%s: moe-cache: %8.2f MiB of expert slots for %zu layers in %s: %.2f MiB resident slots (%d/layer), "
                "%.2f MiB staging (%d/layer), %.2f MiB zero slot, %.2f MiB tables and bias copies\n", __func__,
                size/mib, ils.size(), ggml_backend_buft_name(buft), slots_b/mib, dev_slots, stage_b/mib, n_stage, zero_b/mib,
                std::max(0.0, size - slots_b - stage_b - zero_b)/mib);
    }
    held.emplace_back(std::move(ctx), ggml_backend_buffer_ptr(buf));
    return true;
}

// host companions: the table the CPU MUL_MAT_ID reads (src[3]) and the observed routing
static void llama_moe_vram_alloc_host(llama_moe_tiers & mc) {
    auto & vram = mc.vram;
    ggml_init_params params = {
        /*.mem_size   =*/ vram.layers.size() * 2 * ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    vram.host_ctx.reset(ggml_init(params));
    for (auto & l : vram.layers) {
        l.host_table = ggml_new_tensor_1d(vram.host_ctx.get(), GGML_TYPE_I32, l.n_expert);
        ggml_format_name(l.host_table, "blk.%d.ffn_exps.cache_table_host", l.il);
        l.observed = ggml_new_tensor_1d(vram.host_ctx.get(), GGML_TYPE_I32, (int64_t) l.n_used * mc.max_batch);
        ggml_format_name(l.observed, "blk.%d.ffn_exps.cache_observed", l.il);
    }
    vram.host_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(vram.host_ctx.get(), ggml_backend_cpu_buffer_type()));
    GGML_ASSERT(vram.host_buf);
    vram.alloc_bytes += ggml_backend_buffer_get_size(vram.host_buf.get());
    for (auto & l : vram.layers) {
        std::fill((int32_t *) l.observed->data, (int32_t *) l.observed->data + ggml_nelements(l.observed), -1);
    }
    vram.publish(); // every layer is dirty since add_layer
}

bool llama_moe_vram_alloc_devices(llama_model & model, llama_moe_tiers & mc, const llama_moe_vram_by_buft & by_buft,
                                  const std::map<ggml_backend_buffer_type_t, int32_t> & slots_of,
                                  const std::function<int32_t(int32_t)> & stage_for, bool pool, int32_t n_inserts,
                                  std::string & budgets, llama_moe_held_buffers & held, int32_t & n_slots_min) {
    auto & vram = mc.vram;
    int32_t n_slots = 0;
    for (const auto & [buft, s] : slots_of) {
        n_slots     = std::max(n_slots, s);
        n_slots_min = std::min(n_slots_min, s);
    }
    vram.n_slots       = n_slots;
    vram.res.n_inserts = n_inserts;
    vram.layer_of_il.assign(model.layers.size(), -1);
    size_t n_layers = 0;
    for (const auto & [buft, ils] : by_buft) {
        n_layers += ils.size();
    }
    vram.layers.reserve(n_layers);
    for (const auto & [buft, ils] : by_buft) {
        const int32_t dev_slots = slots_of.at(buft);
        if (!llama_moe_vram_alloc(model, mc, buft, ils, dev_slots, stage_for(dev_slots), pool, budgets, held)) {
            vram.disable(); // before `held` frees the tensors its layers point at
            return false;
        }
    }
    if (pool) {
        // the pool's slots per layer: its share, for the lines, the stats and the trace
        n_slots     = 0;
        n_slots_min = (int32_t) model.hparams.n_expert;
        for (const auto & r : vram.res.layers) {
            n_slots     = std::max(n_slots, r.n_slots);
            n_slots_min = std::min(n_slots_min, r.n_slots);
        }
        vram.n_slots = std::max(n_slots, 1); // enabled() while a bank under one slot per layer holds any
    }
    llama_moe_vram_alloc_host(mc);
    return true;
}
