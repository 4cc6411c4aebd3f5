#pragma once

// pybmoe: route replay (--moe-route-replay FILE): every MoE layer takes its selected experts from a
// routing trace instead of its router's top-k.
//
// Each sequence replays its own stream of the trace, so concurrent clients of a server have the
// routing of independent users (docs/multi-client.md): the trace is cut into n_seq_max equal
// streams (n_seq_max: the context's sequences, -np for llama-server), and the i-th sequence to
// run a ubatch (first seen first) takes the i-th stream's tokens in order, from its start, wrapping
// with one WARN when it has used them all. One sequence (llama-cli, llama-bench) replays the
// whole trace from its first token, as before.
//
// Holds: the trace's ids (parsed and checked at open), the host tensors that feed the next tokens'
// ids to the graph, and each sequence's place in its stream.
// Must not hold: any tier's state, or trace writing (llama-moe-trace.h).

#include "ggml-cpp.h"

#include <cstdint>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_model;
struct llama_moe_log;
struct llama_ubatch;

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
    std::vector<int32_t>  seq_ids;   // the sequences replayed so far, in the order first seen (stream i: seq_ids[i])
    std::vector<uint64_t> seq_count; // tokens each of them replayed so far
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

    // before a ubatch's graph runs: each of its tokens takes the next token of its sequence's stream
    // (the trace cut into n_seq_max streams); a sequence not seen before takes the next stream
    void fill(const llama_ubatch & ubatch, uint32_t n_seq_max);

    // after it ran: each sequence moves on by its tokens (one WARN the first time a sequence wraps)
    void advance(const llama_ubatch & ubatch);

    // the trace token the j-th token of the i-th sequence seen takes (i < n_seq_max)
    int64_t token_of(size_t i, uint64_t j, uint32_t n_seq_max) const;

    uint32_t n_graph_nodes() const {
        return 2u * (uint32_t) tensors.size();
    }

private:
    size_t stream_of(int32_t seq_id, uint32_t n_seq_max); // the stream a sequence replays (adds a new one)
    uint32_t n_streams = 1; // n_seq_max of the last fill
    bool     wrapped   = false;
};
