#pragma once

// pybmoe: route replay (--moe-route-replay FILE): every MoE layer takes its selected experts from a
// routing trace instead of its router's top-k.
//
// Holds: the trace's ids (parsed and checked at open), the host tensors that feed the next tokens'
// ids to the graph, and the cursor.
// Must not hold: any tier's state, or trace writing (llama-moe-trace.h).

#include "ggml-cpp.h"

#include <cstdint>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_model;
struct llama_moe_log;

struct llama_moe_replay {
    std::vector<int32_t>       ids;          // [n_tok][n_layer][n_used], filled for every MoE layer
    std::vector<int32_t>       tensor_of_il; // model layer -> index into tensors, -1 when not replayed
    std::vector<ggml_tensor *> tensors;      // I32 [n_used, cap] per replayed layer: the next cap tokens
    ggml_context_ptr           ctx;
    ggml_backend_buffer_ptr    buf;
    int64_t  n_tok   = 0;
    int64_t  cap     = 0;
    int32_t  n_layer = 0;
    int32_t  n_used  = 0;
    uint64_t cursor  = 0; // tokens replayed so far (the next token is cursor % n_tok)
    std::string path;

    bool on() const {
        return n_tok > 0;
    }

    // reads and checks the trace at `path` for ubatches of up to n_ubatch tokens; returns the
    // replayed layers, or -1 (logged)
    int32_t open(const llama_model & model, const char * path, int32_t n_ubatch);

    // the ids layer il uses instead of `selected`, or `selected` when it is not replayed
    ggml_tensor * graph_ids(const llama_moe_log & log, ggml_context * ctx0, ggml_tensor * selected, int il,
                            int64_t n_ubatch) const;

    // after a ubatch of n_tokens tokens: move on (wrapping with a WARN) and refill the buffers
    void advance(int64_t n_tokens);

    uint32_t n_graph_nodes() const {
        return 2u * (uint32_t) tensors.size();
    }

private:
    void fill();
};
