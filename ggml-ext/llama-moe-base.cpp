// pybmoe: the helpers the owner and every tier share. See llama-moe-base.h.
//
// Holds: the MoE layer test, the expert tensor lists, the once-per-model log and the busy check.
// Must not hold: anything of a tier or of the owner.

#include "llama-moe-base.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <cstdarg>
#include <cstring>

bool llama_moe_is_moe_layer(const llama_layer & layer) {
    return layer.ffn_gate_inp && (layer.ffn_up_exps || layer.ffn_gate_up_exps);
}

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

void llama_moe_log::once(const char * key, const char * fmt, ...) const {
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (!seen.insert(key).second) {
            return;
        }
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

bool llama_moe_base::busy(const char * fn, const char * tier, const char * what) const {
    if (n_busy.load() == 0) {
        return false;
    }
    LLAMA_LOG_ERROR("%s: %s: a graph is being computed; %s between generations\n", fn, tier, what);
    return true;
}
