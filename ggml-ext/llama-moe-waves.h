#pragma once

// pybmoe: the stream tier's expert waves: a layer step that needs more experts than the budget holds
// (a prefill at a budget under one layer's set) reads the misses the LRU could not admit while the
// layer computes, a few experts at a time, in the order the MUL_MAT_IDs use them, and gives each
// expert's pages back as soon as every compute thread is past it.
//
// Why: the budget had to hold the largest set one layer step can need (min(n_expert, top-k x ubatch)
// experts: a whole layer at -ub 512), or the load was refused. A model whose layer is larger than the
// memory could not be run at the default ubatch at all.
//
// How: the LRU admits what it can (llama_moe_lru::step, its `passed` entries are the rest); the step
// marks every passed expert in flight in every projection (llama-moe-inflight.h) and hands them here,
// sorted by id. Each projection's MUL_MAT_ID walks the experts in id order and calls the hook (patch
// 0033) before each expert's rows, with its thread index, and once more when the thread is done; so
// when every thread has called it for a later expert, the earlier ones are done. Per projection this
// keeps `window` experts read ahead of the slowest thread: each call that moves the slowest thread on
// drops the experts behind it (their pages back to the kernel or their frames to the pool) and
// appends the next reads to the lanes' batch. The bytes each expert's rows read, and the order they are
// summed in, are those of a run with every expert resident: the output is bit-identical.
//
// Holds: the passed experts of the layer in flight, each projection's thread positions and the
// window. Must not hold: how an expert is read or dropped (the stream tier's callbacks) or the policy.

#include "llama-moe-base.h"

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

struct llama_moe_waves {
    int32_t window = 0; // experts per projection read ahead of the slowest compute thread

    // reads projection p of layer li's experts (sorted ids, already marked in flight); appended to the
    // lanes' batch, they clear their flags once read
    std::function<void(int32_t li, int32_t p, const std::vector<int32_t> & experts)> read;
    // gives projection p of layer li's experts' pages back
    std::function<void(int32_t li, int32_t p, const std::vector<int32_t> & experts)> drop;

    // layer li's step passed `experts` (sorted ids, each marked in flight in its n_proj projections):
    // reads the first window of each projection. Called by the step, with no MUL_MAT_ID running
    void begin(int32_t li, int32_t n_proj, const std::vector<int32_t> & experts);

    bool active(int32_t li) const {
        return li_now.load(std::memory_order_acquire) == li;
    }

    // the layer whose step runs in waves now, -1: none
    int32_t layer() const {
        return li_now.load(std::memory_order_acquire);
    }

    // the hook: thread ith of nth of projection p's MUL_MAT_ID is at expert e (n_expert or more: done
    // with every expert). Drops what every thread is past and reads ahead; the caller then waits for e
    void pass(int32_t p, int64_t e, int ith, int nth);

    // the layer's MUL_MAT_IDs are over (or never ran): drops every expert still held; `unread` gets the
    // experts of each projection whose reads were never started (their in-flight flags are still set).
    // Called with no MUL_MAT_ID running and no read in flight
    void finish(std::vector<int32_t> unread[LLAMA_MOE_N_PROJ]);

    uint64_t n_steps = 0; // layer steps that ran in waves

private:
    struct proj {
        std::vector<int64_t> at;   // [nth] the position (into `experts`) each thread is at
        size_t n_done = 0;         // positions dropped
        size_t n_sent = 0;         // positions whose reads were started
    };

    std::mutex           mutex;
    std::atomic<int32_t> li_now { -1 };
    int32_t              n_proj = 0;
    std::vector<int32_t> experts;
    proj                 projs[LLAMA_MOE_N_PROJ];
};
