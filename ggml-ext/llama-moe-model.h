#pragma once

// pybmoe: the model's one owner of everything pybmoe adds: where expert bytes come from, the VRAM
// tier, the stream tier, the routing trace and route replay, and the once-per-model log.
//
// Holds: the owner (llama_model::moe_cache points at it; the MTP draft context shares it with the
// main context) and what every concern needs to know of the model's layers.
// Must not hold: a concern's own logic (each has its file), or process-wide state: two models in
// one process have two owners and share nothing.

#include "llama-moe-dense.h"
#include "llama-moe-hooks.h"
#include "llama-moe-replay.h"
#include "llama-moe-source.h"
#include "llama-moe-stream.h"
#include "llama-moe-trace.h"
#include "llama-moe-vram.h"

#include "ggml-backend.h"

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <string>

struct llama_layer;

// a MoE layer: a router and experts (separate or fused gate_up); the cache, the trace and route
// replay all take their layers from this test
bool llama_moe_is_moe_layer(const llama_layer & layer);

// logs a line once per model and key: a WARN when the text starts with "WARNING" (the cache is not
// serving something it was asked to), else an INFO
struct llama_moe_log {
    void once(const char * key, const char * fmt, ...) const;

private:
    mutable std::mutex            mutex;
    mutable std::set<std::string> seen;
};

struct llama_moe_cache {
    llama_moe_sources sources; // recorded at load

    // device memory set aside ahead of the cache (the contexts' projected KV + compute), for auto
    std::map<ggml_backend_dev_t, size_t> reserve;

    int32_t max_batch = 1; // the largest ubatch the VRAM tier serves, and the trace's default

    llama_moe_vram   vram;
    llama_moe_stream stream;
    llama_moe_dense  dense;
    llama_moe_trace  trace;
    llama_moe_replay replay;
    llama_moe_log    log;

    std::atomic<int32_t> n_busy { 0 }; // graphs being computed (resizing is refused meanwhile)
    mutable std::mutex   mutex;        // the step against the stats getters and the resize

    // One graph at a time per model while a tier, the trace or route replay is on: held from
    // before a ubatch's graph is computed until its after-step is done. Two contexts of one model
    // decoding from two threads (the MTP draft context shares the model too) then take turns: one
    // context's step never rewrites the tables, frees slots or evicts RAM entries while the other's
    // graph reads them. One thread runs its contexts one after the other, so it never waits on itself.
    std::mutex graph_mutex;

    bool active() const {
        return vram.enabled() || stream.on() || trace.on() || replay.on();
    }

    // a setting that must change between generations while a graph is being computed: one ERROR line,
    // "<fn>: <tier>: a graph is being computed; <what> between generations", and true (the C setters
    // then return -2)
    bool busy(const char * fn, const char * tier, const char * what) const;
};
