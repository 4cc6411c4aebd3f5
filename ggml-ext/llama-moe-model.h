#pragma once

// pybmoe: the model's one owner of everything pybmoe adds: where expert bytes come from, the VRAM
// tier, the stream tier, the routing trace and route replay, and the once-per-model log.
//
// Holds: the owner (llama_model::moe_cache points at it; the MTP draft context shares it with the
// main context) and what every concern needs to know of the model's layers.
// Must not hold: a concern's own logic (each has its file), or process-wide state: two models in
// one process have two owners and share nothing.

#include "llama-moe-base.h"
#include "llama-moe-dense.h"
#include "llama-moe-governor-poll.h"
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

// the owner: the log and the busy count come from llama_moe_base, which the tiers share without
// reaching back into this file
struct llama_moe_tiers : llama_moe_base {
    llama_moe_sources sources; // recorded at load

    // device memory set aside ahead of the cache (the contexts' projected KV + compute), for auto
    std::map<ggml_backend_dev_t, size_t> reserve;

    int32_t max_batch = 1; // the largest ubatch the VRAM tier serves, and the trace's default

    llama_moe_vram   vram;
    llama_moe_stream stream;
    llama_moe_dense  dense;
    llama_moe_trace  trace;
    llama_moe_replay replay;

    mutable std::mutex   mutex;        // the step against the stats getters and the resize

    // One graph at a time per model while a tier, the trace or route replay is on: held from
    // before a ubatch's graph is computed until its after-step is done. Two contexts of one model
    // decoding from two threads (the MTP draft context shares the model too) then take turns: one
    // context's step never rewrites the tables, frees slots or evicts RAM entries while the other's
    // graph reads them. One thread runs its contexts one after the other, so it never waits on itself.
    std::mutex graph_mutex;

    // the stream tier's governor between ubatches (llama-moe-governor-poll.h); the last member, so it
    // stops before anything it reads is destroyed
    llama_moe_governor_poll gov_poll;

    bool active() const {
        return vram.enabled() || stream.on() || trace.on() || replay.on();
    }

    // the tiers meet here only (llama-moe-links.h): the stream tier sees the VRAM tier's residents, the
    // VRAM tier's uploads read the stream tier's RAM copies
    llama_moe_tiers() {
        stream.devices = &vram;
        vram.ram       = &stream;
    }
    llama_moe_tiers(const llama_moe_tiers &) = delete;
    llama_moe_tiers & operator=(const llama_moe_tiers &) = delete;
};

// how often an idle model's governor has its turn, milliseconds (llama-moe-governor-poll.h)
#define LLAMA_MOE_GOVERNOR_IDLE_MS 100

// starts the governor's turns while no graph runs, where the stream tier is on and elastic (at the first
// context: the plan at load is made by then); later calls do nothing
void llama_moe_governor_idle_start(llama_moe_tiers * mc);
