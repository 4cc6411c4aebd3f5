// pybmoe: graph building: which layers the VRAM tier serves, and the split of build_moe_ffn into a
// host chain and a device chain over the slots. See llama-moe-hooks.h.
//
// Holds: the graph-time decisions (logged once per model) and the clone of the expert chain.
// Must not hold: state changes (they happen after the graph, llama-moe-vram.cpp) or sizing.

#include "llama-moe-model.h"

#include "ggml.h"

#include <cstring>
#include <functional>
#include <map>

// the most nodes the device chain of one layer may have (llama_moe_cache_build_split); beyond it the
// layer builds the stock graph
constexpr uint32_t LLAMA_MOE_MAX_CLONE = 48;

uint32_t llama_moe_cache_n_graph_nodes(const llama_moe_tiers * mc) {
    if (mc == nullptr) {
        return 0;
    }
    return LLAMA_MOE_MAX_CLONE * (uint32_t) (mc->vram.enabled() ? mc->vram.layers.size() : 0) +
            mc->stream.n_graph_nodes() + mc->trace.n_graph_nodes() + mc->replay.n_graph_nodes();
}

ggml_tensor * llama_moe_route_replay_ids(const llama_moe_tiers * mc, ggml_context * ctx, ggml_tensor * selected,
                                         int il, int64_t n_ubatch) {
    if (mc == nullptr || !mc->replay.on()) {
        return selected;
    }
    return mc->replay.graph_ids(mc->log, ctx, selected, il, n_ubatch);
}

ggml_tensor * llama_moe_stream_ids(const llama_moe_tiers * mc, ggml_context * ctx, ggml_tensor * selected, int il) {
    if (mc == nullptr || !mc->stream.on()) {
        return selected;
    }
    // note: the op keeps a pointer to its layer's data; the owner outlives every graph
    return const_cast<llama_moe_stream &>(mc->stream).graph_ids(ctx, selected, il);
}

const llama_moe_vram_layer * llama_moe_cache_graph_layer(const llama_moe_tiers * mc, const llama_moe_cache_ffn_desc & d) {
    if (mc == nullptr) {
        return nullptr;
    }
    if (mc->trace.on()) {
        mc->trace.build(mc->log, d.ctx, d.gf, d.il, d.selected);
    }
    const llama_moe_vram_layer * l = mc->vram.enabled() ? mc->vram.layer(d.il) : nullptr;
    if (l == nullptr) {
        return nullptr;
    }
    const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
    const int n_proj = llama_moe_proj_list(d.up_exps, d.gate_exps, d.down_exps, d.gate_up_exps, exps);
    bool same = n_proj == l->n_proj;
    for (int p = 0; same && p < n_proj; ++p) {
        same = exps[p] == l->exps[p];
    }
    if (!same) {
        mc->log.once("key", "WARNING layer %d: build_moe_ffn called with other expert tensors than the cached ones "
                "(second call site); stock graph there", d.il);
        return nullptr;
    }
    if (d.has_lora) {
        mc->log.once("lora", "WARNING LoRA adapters are loaded: the expert cache is bypassed (stock graph) while they are");
        return nullptr;
    }
    if (d.n_ubatch > mc->max_batch) {
        mc->log.once("batch", "batches of more than %d token(s) use the stock graph (all experts on the host)", mc->max_batch);
        mc->vram.graph_count(d.ctx, d.gf, d.selected, mc->vram.layer_of_il[d.il]); // the prefill warm-up's counts
        return nullptr;
    }
    mc->vram.routed[mc->vram.layer_of_il[d.il]] = true;
    return l;
}

namespace {

bool llama_moe_is_view_op(ggml_op op) {
    return op == GGML_OP_VIEW || op == GGML_OP_RESHAPE || op == GGML_OP_PERMUTE || op == GGML_OP_TRANSPOSE;
}

// the cached projection a host node multiplies by, or -1
int llama_moe_proj_of(const llama_moe_vram_layer * l, const ggml_tensor * t) {
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
    const llama_moe_vram_layer * l;
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

ggml_tensor * llama_moe_cache_bias(const llama_moe_vram_layer * l, ggml_tensor * bias) {
    for (int b = 0; l != nullptr && b < l->n_bias; ++b) {
        if (l->bias_host[b] == bias) {
            return l->bias_dev[b];
        }
    }
    return bias;
}

ggml_tensor * llama_moe_cache_build_split(ggml_context * ctx, ggml_cgraph * gf, const llama_moe_vram_layer * l,
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
        l->log->once(("chain:" + ch.why).c_str(), "WARNING layer %d: the expert cache cannot split this MoE "
                "chain (%s); stock graph there", l->il, ch.why.empty() ? "it has no cached projection" : ch.why.c_str());
        return out_h;
    }
    // the host chain will skip the residents: so does the disk tier's read, when `selected` is its op
    llama_moe_stream_mark_vram_served(selected);

    const int64_t n_used   = selected->ne[0];
    const int64_t n_tokens = selected->ne[1];

    // record the routing for the cache policy (runs on the CPU: the destination is a host tensor)
    ggml_tensor * obs = ggml_view_1d(ctx, l->observed, n_used*n_tokens, 0);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, selected, obs));

    // expert id -> slot id through the one table: a batch's ids are gathered as one row of
    // n_used*n_tokens ids (CONT and GET_ROWS of I32 run on the device on CUDA and Vulkan; an I32
    // REPEAT of the table per token would not: CUDA's REPEAT takes F32/F16 only)
    ggml_tensor * ids = n_tokens == 1 ? selected : ggml_reshape_2d(ctx, ggml_cont(ctx, selected), n_used*n_tokens, 1);
    ggml_tensor * slot_ids = ggml_get_rows(ctx, l->dev_table, ids); // [1, n_used*n_tokens]
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
