#pragma once

// pybmoe: the tiers' environment switches (PYBMOE_MOE_*), read and validated once, into plain values.
// The tiers receive these values and never read the environment themselves.
//
// Holds: each switch's name, accepted values and default. Must not hold: what a tier does with them.

#include <cstdint>
#include <string>
#include <vector>

enum llama_moe_frames_mode {
    LLAMA_MOE_FRAMES_ON    = 0, // page frames, moved (or memfd where the kernel cannot move them)
    LLAMA_MOE_FRAMES_OFF   = 1, // PYBMOE_MOE_STREAM_FRAMES=0: each miss faults in fresh pages
    LLAMA_MOE_FRAMES_MEMFD = 2, // PYBMOE_MOE_STREAM_FRAMES=memfd
};

// the stream tier's switches (docs/stream-tier.md names each one's measurements)
struct llama_moe_stream_switches {
    bool    scan_guard    = true;  // PYBMOE_MOE_STREAM_POLICY: global-lru-scan (default) or global-lru
    bool    waves         = true;  // PYBMOE_MOE_STREAM_WAVES=0 turns the expert waves off
    bool    prefetch_set  = false; // PYBMOE_MOE_STREAM_PREFETCH is set: 0 off, 1 a whole layer, N > 1 N experts
    int64_t prefetch      = -1;    // its value (-1 when unset: the default window)
    llama_moe_frames_mode frames = LLAMA_MOE_FRAMES_ON; // PYBMOE_MOE_STREAM_FRAMES
    int32_t overlap       = -1;    // PYBMOE_MOE_STREAM_OVERLAP: -1 auto (unset, "auto", or a bad value), 0 off, 1 on
    int32_t overlap_trial = 0;     // PYBMOE_MOE_STREAM_OVERLAP_TRIAL: decode tokens each way, 1 .. 1000; 0: the trial's default
    bool    no_odirect    = false; // PYBMOE_MOE_STREAM_NO_ODIRECT=1: open as a file system without O_DIRECT answers
    bool    elastic       = true;  // PYBMOE_MOE_STREAM_ELASTIC=0: the contexts' KV caches committed at creation and the
                                   // budget planned once at load (the static plan), no governor
};

// reads the stream tier's switches. false (with `err`) for a value that refuses the tier; a value replaced
// by its default appends one WARN text to `warns`
bool llama_moe_stream_switches_read(llama_moe_stream_switches & out, std::string & err, std::vector<std::string> & warns);
