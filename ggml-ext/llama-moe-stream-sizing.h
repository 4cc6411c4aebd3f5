#pragma once

// pybmoe: the stream tier's sizing at load, as a pure function: from the memory the process has, the
// dense weights, the experts' shape and the flags, the budget (auto or fixed), the floor and the
// prefetch window. No llama, no ggml, no I/O: tests/engine/stream_sizing.cpp drives it alone.
//
// Holds: the arithmetic of --moe-stream-cache-mb N|auto, --moe-stream-floor-mb, --moe-stream-ceil-mb and
// PYBMOE_MOE_STREAM_PREFETCH at load. Must not hold: the log lines (llama-moe-stream-init.cpp), the
// contexts' share (llama-moe-stream-budget.cpp, llama-moe-fit.h), the residency (llama-moe-residency.h).

#include <cstdint>

// the floor auto leaves free: 1/16 of the memory limit, from 64 MiB up to the BigMoeOnEdge seed's 1536 MiB
// (llama-moe.h's LLAMA_MOE_STREAM_FLOOR_MIN_MIB and LLAMA_MOE_STREAM_FLOOR_MIB_DEFAULT; asserted equal there)
#define LLAMA_MOE_STREAM_SIZING_FLOOR_MIN_MIB 64
#define LLAMA_MOE_STREAM_SIZING_FLOOR_MAX_MIB 1536

struct llama_moe_stream_sizing_input {
    bool    is_auto        = true;
    int64_t budget_bytes   = 0;  // a fixed budget as asked (is_auto false)
    int64_t floor_bytes    = -1; // what auto leaves free; -1: auto (the define above)
    int64_t ceil_bytes     = 0;  // auto's ceiling; 0: none
    int64_t avail_bytes    = 0;  // the memory available at load (llama_moe_mem_avail::avail)
    int64_t limit_bytes    = 0;  // the memory the process lives in (the cgroup's limit, else MemTotal)
    int64_t dense_bytes    = 0;  // the dense weights in host memory
    int64_t entry_bytes    = 0;  // the largest layer's (layer, expert) entry, all its projections
    int64_t entry_cost     = 0;  // an entry's bytes plus the partial pages it can commit
    int64_t n_entries      = 0;  // every streamed (layer, expert) entry
    int64_t total_bytes    = 0;  // every streamed expert's bytes
    int32_t n_expert       = 0;
    int64_t min_entries    = 0;  // the largest set one layer step can need at the configured ubatch
    int64_t least_entries  = 0;  // the least budget the tier takes, entries (llama_moe_stream::least_bytes)
    bool    prefetch_set   = false; // PYBMOE_MOE_STREAM_PREFETCH is set (auto does not size the window then)
    int64_t prefetch_asked = -1;    // its value: < 0 the default, 0 off, 1 a whole layer, N > 1 N experts
};

enum llama_moe_stream_sizing_status {
    LLAMA_MOE_STREAM_SIZED         = 0,
    LLAMA_MOE_STREAM_UNDER_MINIMUM = 1, // auto's room, or the fixed budget, is under least_entries
};

struct llama_moe_stream_sizing {
    llama_moe_stream_sizing_status status = LLAMA_MOE_STREAM_SIZED;
    int64_t budget_bytes     = 0;
    int64_t floor_bytes      = 0;  // the floor in force (auto's may have given way: floor_gave_way)
    int64_t floor_asked      = 0;  // the floor before it gave way
    int64_t prefetch_entries = 0;
    // auto only
    int64_t room_entries     = 0;  // what the memory held, before the caps
    int64_t cap_entries      = 0;  // the ceiling, or every streamed expert
    int64_t entries          = 0;  // the budget, entries
    int64_t room_bytes       = 0;  // available - dense - prefetch window (may be negative)
    bool    floor_gave_way   = false; // the floor left less than the minimum; auto took the minimum
    bool    in_waves         = false; // the budget is under min_entries (steps that need more run in waves)
    // fixed only
    bool    clamped_to_total = false; // more than every streamed expert: clamped to that
};

// the budget, floor and prefetch window at load (the rules: llama-moe-stream-init.cpp's comments and
// docs/stream-tier.md, "Sizing")
llama_moe_stream_sizing llama_moe_stream_size(const llama_moe_stream_sizing_input & in);
