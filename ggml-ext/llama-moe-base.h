#pragma once

// pybmoe: what the model's owner and every tier share, below all of them: the MoE layer test and the
// expert tensors of a layer, the once-per-model log, and the busy check of the setters that must
// wait between generations.
//
// Holds: helpers with no tier in them. Must not hold: the owner (llama-moe-model.h) or a tier's
// state: the owner and the tiers include this file, this file includes none of them, so no arrow
// between the owner and a tier points back.

#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

struct ggml_tensor;
struct llama_layer;

constexpr int LLAMA_MOE_N_PROJ = 3; // the most expert tensors a layer has: up, gate, down (or gate_up, down)
constexpr int LLAMA_MOE_N_BIAS = 4; // the most expert biases a layer has: up, gate, gate_up, down

// a MoE layer: a router and experts (separate or fused gate_up); the cache, the trace and route
// replay all take their layers from this test
bool llama_moe_is_moe_layer(const llama_layer & layer);

// the expert tensors a layer multiplies by, in graph order, and their slot-name stems: {up, gate, down},
// {up, down} without a gate, or {gate_up, down} when fused; returns how many (0: not an expert layer)
int llama_moe_proj_list(const ggml_tensor * up, const ggml_tensor * gate, const ggml_tensor * down,
                        const ggml_tensor * gate_up, const ggml_tensor * out[LLAMA_MOE_N_PROJ],
                        const char * names[LLAMA_MOE_N_PROJ] = nullptr);

// llama_moe_proj_list over a model layer's expert tensors (the layer walks of both tiers' init)
int llama_moe_layer_exps(const llama_layer & layer, const ggml_tensor * out[LLAMA_MOE_N_PROJ],
                         const char * names[LLAMA_MOE_N_PROJ] = nullptr);

// logs a line once per model and key: a WARN when the text starts with "WARNING" (the cache is not
// serving something it was asked to), else an INFO
struct llama_moe_log {
    void once(const char * key, const char * fmt, ...) const;

private:
    mutable std::mutex            mutex;
    mutable std::set<std::string> seen;
};

// what the owner and the tiers' C API share: the log and the count of graphs in flight
struct llama_moe_base {
    llama_moe_log log;

    std::atomic<int32_t> n_busy { 0 }; // graphs being computed (resizing is refused meanwhile)

    // a setting that must change between generations while a graph is being computed: one ERROR line,
    // "<fn>: <tier>: a graph is being computed; <what> between generations", and true (the C setters
    // then return LLAMA_MOE_ERR_BUSY)
    bool busy(const char * fn, const char * tier, const char * what) const;
};
