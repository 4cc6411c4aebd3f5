#pragma once

// pybmoe: the stream tier's governor: the budget follows the memory at run time.
//
// The rule (docs/stream-tier.md, "Serving under a memory limit"): before each ubatch, and every 100 ms
// while no graph runs (an idle server: llama-moe-governor-poll.h), the memory free now is read (the
// cgroup's limit less what it cannot reclaim, and MemAvailable). What the tier may still commit under
// its budget (entries not resident yet, the prefetch window) is spoken for already; what must stay free
// is the floor plus the largest ubatch's new KV cells. The slack is what is left:
//
//     slack = free - (budget's full cost - what the tier holds now) - (floor + KV cells of one ubatch)
//
// slack < 0: the budget yields ceil(-slack) plus half a step, in whole entries, before the ubatch runs
// (evict, then run), so no context that grows and no process beside it meets the limit while the tier
// holds memory it could give. slack >= step: it grows by slack less half a step, up to `cap` (what auto
// gives beside the contexts' compute and output buffers; a fixed budget: what was asked). Between
// the two nothing moves, so the budget changes at most once per half step of memory, never per token.
// It never goes under the mechanical minimum.
//
// Holds: that arithmetic, as a pure function. Must not hold: reading the memory (llama-moe-memory.h)
// or applying the budget (llama-moe-stream.h).

#include <cstdint>

struct llama_moe_governor_input {
    int64_t budget      = 0; // the budget now, bytes
    int64_t free        = 0; // memory free now, bytes (measured)
    int64_t unfilled    = 0; // what the tier may still commit under its budget, bytes
    int64_t reserve     = 0; // what must stay free: the floor and the largest ubatch's new KV cells, bytes
    int64_t least       = 0; // the mechanical minimum, bytes
    int64_t cap         = 0; // the most the budget takes now, bytes
    int64_t step        = 0; // the hysteresis, bytes
    int64_t entry_bytes = 1; // one (layer, expert) entry
    int64_t entry_cost  = 1; // an entry's bytes plus the partial pages it may commit
};

// the budget the rule gives, bytes (whole entries; the budget itself when nothing moves)
int64_t llama_moe_governor_target(const llama_moe_governor_input & in);

// the step, bytes: 16 MiB, or an eighth of every streamed expert when that is less, and at least 4 entries
int64_t llama_moe_governor_step(int64_t entry_cost, int64_t total_bytes);
