#pragma once

// pybmoe: the contexts and the stream tier's budget fitted together, before any context is created
// (llama_model_moe_stream_fit), as upstream's --fit fits device memory: a context the user did not
// size shrinks so that the expert budget keeps the cache cycle with a margin (fewer slots first, then
// shorter ones, never under n_ctx_min tokens in all); one the user did size runs as asked, or is
// refused when it cannot fit beside the dense weights and the tier's minimum; a fixed budget that
// does not fit beside the contexts is clamped to the largest that does.
//
// Holds: the plan (a pure function of sizes and a measuring callback) and its line. Must not hold:
// how a context's host memory is measured (common probes it with no_alloc loads, as --fit does) or
// how the budget is applied (llama-moe-stream.h).

#include <cstdint>
#include <functional>
#include <string>

// what the plan knows, bytes
struct llama_moe_fit_input {
    // the stream tier after init
    bool    is_auto      = true;
    int64_t fixed_bytes  = 0; // a fixed budget (is_auto false), at most every streamed expert
    int64_t fixed_asked  = 0; // the fixed budget as the user gave it, for the line
    // what the budget and the contexts share: the memory available at init minus the dense weights in
    // host memory, the prefetch window and the floor (what auto leaves free; a fixed budget leaves it too)
    int64_t room_bytes   = 0;
    // how much of the floor may give way rather than refuse a context (the floor less the least that
    // stays free, 64 MiB): the budget then keeps the minimum, under the cycle
    int64_t floor_slack_bytes = 0;
    int64_t entry_bytes  = 1; // one (layer, expert) entry
    int64_t entry_cost   = 1; // an entry's bytes plus the partial pages it may commit
    int64_t cap_bytes    = 0; // the most the budget takes (every streamed expert, auto's ceiling)
    int64_t cycle_bytes  = 0; // the cache cycle: every streamed layer's top-k experts
    int64_t least_bytes  = 0; // the mechanical minimum
    int32_t margin_pct   = 10; // a default context keeps the budget at cycle x (1 + margin)
    int32_t keep_pct     = 100; // and at keep % of the budget its least context would leave (auto; a fixed
                               // budget keeps all of it)

    // the context: n_seq slots; unified (one pool of n_ctx tokens that every slot draws from), or not
    // (n_ctx / n_seq tokens per slot: a slot costs its tokens)
    uint32_t n_ctx       = 0;  // the tokens of the whole context as asked (resolved: never 0)
    uint32_t n_seq       = 1;  // slots (sequences)
    bool     unified     = true;
    uint32_t n_ctx_min   = 4096; // a shrink stops here, tokens in all
    bool     user_sized  = false; // -c was given (or --fit off): never shrunk

    // elastic (the stream tier's default): a context's KV cache commits memory as it fills and the budget
    // yields to it at run time, so a context is shrunk only so far that its FULL size fits beside the dense
    // weights and the tier's minimum (the target is the minimum); the room it leaves while it is empty is
    // lent to the experts
    bool     elastic     = false;
};

// the contexts' host memory (KV cache, compute, output of every context the run creates) at a context
// of n_ctx tokens in all over n_seq slots, bytes; < 0 when it could not be measured
using llama_moe_fit_measure_fn = std::function<int64_t(uint32_t n_ctx, uint32_t n_seq)>;

enum llama_moe_plan_status {
    LLAMA_MOE_PLAN_KEPT,        // the context as asked, the budget at or above the target
    LLAMA_MOE_PLAN_SHRUNK,      // a default context was shrunk to keep the target
    LLAMA_MOE_PLAN_UNDER_CYCLE, // runs with the budget under the target (a user-sized context, or the least one)
    LLAMA_MOE_PLAN_REFUSED,     // the context cannot fit beside the dense weights and the tier's minimum
    LLAMA_MOE_PLAN_UNMEASURED,  // a context could not be measured: nothing changed
};

struct llama_moe_fit_plan {
    llama_moe_plan_status status = LLAMA_MOE_PLAN_UNMEASURED;
    uint32_t n_ctx        = 0; // the context to create, tokens in all
    uint32_t n_seq        = 1; // its slots
    int64_t  ctx_bytes    = 0; // its host memory
    int64_t  asked_bytes  = 0; // the asked context's host memory
    int64_t  budget_bytes = 0; // the budget beside it (whole entries; a fixed one clamped)
    int64_t  target_bytes = 0; // a default context's: the larger of cycle x (1 + margin) and keep % of the
                               // least context's budget; at most the cap, at least the minimum
    int64_t  least_budget = 0; // the budget beside the least context (0: not measured)
    bool     clamped      = false; // a fixed budget was clamped
    uint32_t suggest_ctx  = 0;     // refused or under the target: the largest context (tokens in all, n_seq slots)
                                   // that keeps the target, else the minimum (0: none)
    bool     suggest_keeps = false; // suggest_ctx keeps the target (not only the minimum)
    int      n_measured   = 0; // contexts measured
    // elastic: the contexts' host memory with their KV caches empty (measured at the least context of
    // n_seq slots), and the budget beside it: the budget now, before any context fills
    int64_t  now_bytes    = -1;
    int64_t  budget_now   = 0;
};

// the context llama_context creates for -c n_ctx over n_seq slots, tokens in all: upstream pads n_ctx to
// 256 tokens and, not unified, each slot's share to 256 tokens again (-c 14080 -np 4: 4 x 3584 = 14336).
// The plan is made for that context, so it measures what will be created.
uint32_t llama_moe_fit_n_ctx(uint32_t n_ctx, uint32_t n_seq, bool unified);

// the budget beside contexts of ctx_bytes: auto takes the room left in whole entries, a fixed budget
// the smaller of itself and that room; both at most the cap (may be < 0: nothing fits)
int64_t llama_moe_fit_budget(const llama_moe_fit_input & in, int64_t ctx_bytes);

// the plan: measures the asked context; a default one that leaves the budget under the target first
// loses slots (not unified: each costs its tokens), then its slots' tokens, sized between two measured
// points (the memory is close to affine in either) and each guess measured, stepping down until it fits
llama_moe_fit_plan llama_moe_fit_make_plan(const llama_moe_fit_input & in, const llama_moe_fit_measure_fn & measure);

// the plan's one line (without the function name), for the log
std::string llama_moe_fit_describe(const llama_moe_fit_input & in, const llama_moe_fit_plan & plan);
