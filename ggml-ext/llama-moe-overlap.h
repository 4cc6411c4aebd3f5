#pragma once

// pybmoe: the auto rule's timed answer for reads behind compute where the compute threads take every CPU.
//
// Why: with a CPU left to the read lanes, reads behind compute never lost (docs/stream-tier.md, "Reads
// behind compute"); with every core computing, the answer depends on the machine: 0.79-0.99x of the
// blocking step on one 2-core machine, 1.03-1.30x on another (docs/benchmarks/stream-chain-2026-12-05/README.md
// and stream-moved-2026-12-05/README.md). So there the tier times it: its first decode tokens alternate with and without, and
// the faster way stays.
//
// How: the stream step of the first streamed layer calls token() once per ubatch. A decode ubatch's
// time runs from its call to the next one; a ubatch that wants half of a layer or more (a prefill) is
// not timed, nor the one before it. After n_each timed tokens each way, the way with the lower median
// stays for the life of the tier. The output and the hits are the same either way (the policy does not
// change), so only the time differs.
//
// Holds: the trial's state and its decision. Must not hold: the step (llama-moe-stream.cpp) or the rule
// for when the trial applies (llama_moe_stream::update_overlap).

#include <cstdint>
#include <vector>

struct llama_moe_overlap_trial {
    int32_t n_each = 4; // timed decode tokens each way (PYBMOE_MOE_STREAM_OVERLAP_TRIAL)

    // a ubatch starts at now_us (the first streamed layer's step); decode: it wants less than half of
    // that layer. Returns whether its steps go behind compute
    bool token(int64_t now_us, bool decode);

    bool decided() const {
        return done;
    }
    bool answer() const {
        return on;
    }
    // the medians of the timed tokens, microseconds (after the decision)
    int64_t median_on_us  = 0;
    int64_t median_off_us = 0;

private:
    std::vector<int64_t> t_on, t_off;
    int64_t t_start = -1;    // when the ubatch being timed began (-1: none)
    bool    arm     = false; // its way
    bool    done    = false;
    bool    on      = false;
};
