#pragma once

// pybmoe: the routing trace (--moe-trace FILE): every MoE layer's selected experts, and the VRAM
// tier's hit per lookup, written as CSV by a writer thread.
//
// Holds: the host tensors the graph copies the routing into, the rows' formatting and the writer.
// Must not hold: any tier's state (the hit column comes in through a callback) or route replay
// (llama-moe-replay.h).

#include "ggml-cpp.h"

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct ggml_cgraph;
struct ggml_context;
struct ggml_tensor;
struct llama_model;
struct llama_ubatch;
struct llama_moe_log;
struct llama_moe_residency_layer;

struct llama_moe_trace {
    struct layer {
        int32_t il;
        int32_t n_used;
        ggml_tensor * obs; // I32 [n_used * cap], -1 = not written
    };
    std::vector<layer>   layers;
    std::vector<int32_t> layer_of_il;
    ggml_context_ptr        ctx;
    ggml_backend_buffer_ptr buf;
    int64_t  cap    = 0; // tokens per ubatch the buffers hold
    uint64_t ubatch = 0;
    uint64_t token  = 0;
    FILE *   file   = nullptr;

    ~llama_moe_trace() {
        close();
    }

    bool on() const {
        return file != nullptr;
    }

    // opens `path` and allocates the buffers for ubatches of up to n_ubatch tokens; `header` is the
    // text after "# pybmoe-trace v1 " on the first line. Returns the traced layers, or -1 (logged).
    int32_t open(const llama_model & model, const char * path, int32_t n_ubatch, const std::string & header);

    // adds the node that copies layer il's routing `selected` into its host tensor
    void build(const llama_moe_log & log, ggml_context * ctx0, ggml_cgraph * gf, int il, ggml_tensor * selected) const;

    // the rows of the ubatch just computed; served(il) is the VRAM tier's bookkeeping of layer il
    // when it served that layer (its hits_now give the hit column), else nullptr; streamed(il) the
    // stream tier's hits of layer il's last step (the ram_hit column, when the stream tier is on)
    void rows(const llama_ubatch & ub, const std::function<const llama_moe_residency_layer * (int il)> & served,
              const std::function<const std::vector<int8_t> * (int il)> & streamed);

    bool ram_hit = false; // the file has the ram_hit column

    uint32_t n_graph_nodes() const {
        return 4u * (uint32_t) layers.size();
    }

    void close();

private:
    void push(std::string && rows);
    void writer_main();

    std::thread             writer;
    std::mutex              q_mutex;
    std::condition_variable q_cv;
    std::deque<std::string> queue;
    bool                    stop = false;
};
