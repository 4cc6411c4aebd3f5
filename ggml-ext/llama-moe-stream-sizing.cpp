// pybmoe: the stream tier's sizing at load (llama-moe-stream-sizing.h).

#include "llama-moe-stream-sizing.h"

#include <algorithm>

llama_moe_stream_sizing llama_moe_stream_size(const llama_moe_stream_sizing_input & in) {
    llama_moe_stream_sizing out;
    const int64_t mib = 1 << 20;

    // the prefetch window (llama-moe-stream.h), when the ubatch allows steps that want half of a layer or more
    // (a prefill): by default a quarter of a layer's experts with a fixed budget; with auto, an eighth of the
    // memory auto sizes from, from a quarter of a layer up to a whole one (docs/stream-tier.md, "Prefetch")
    const int64_t prefetch_min = (in.n_expert + 3) / 4;
    int64_t prefetch = in.prefetch_asked < 0 ? prefetch_min
                     : in.prefetch_asked == 1 ? in.n_expert
                     : std::min<int64_t>(in.prefetch_asked, in.n_expert);
    if (2 * in.min_entries < in.n_expert) {
        prefetch = 0;
    }

    // the floor: what auto leaves free for everything it does not count (code pages, the heap, other
    // processes), and what a fixed budget is clamped to leave. Default: 1/16 of the memory the process lives
    // in, from 64 MiB up to 1536 MiB: 81 MiB in a 1300 MiB container, 1536 MiB on a 24 GiB machine
    const int64_t floor = in.floor_bytes < 0
        ? std::clamp<int64_t>(in.limit_bytes / 16, LLAMA_MOE_STREAM_SIZING_FLOOR_MIN_MIB * mib,
                              LLAMA_MOE_STREAM_SIZING_FLOOR_MAX_MIB * mib)
        : in.floor_bytes;
    out.floor_bytes = floor;
    out.floor_asked = floor;

    if (!in.is_auto) {
        out.prefetch_entries = prefetch;
        out.budget_bytes     = in.budget_bytes;
        if (in.budget_bytes < in.least_entries * in.entry_bytes) {
            out.status = LLAMA_MOE_STREAM_UNDER_MINIMUM;
            return out;
        }
        if (in.budget_bytes > in.total_bytes) {
            out.budget_bytes     = in.total_bytes;
            out.clamped_to_total = true;
        }
        return out;
    }

    if (!in.prefetch_set && prefetch > 0) {
        const int64_t held = (in.avail_bytes - in.dense_bytes - floor) / in.entry_cost;
        prefetch = std::clamp<int64_t>(held / 8, prefetch_min, in.n_expert);
    }
    out.prefetch_entries = prefetch;
    const int64_t room = in.avail_bytes - in.dense_bytes - prefetch * in.entry_cost;
    const int64_t want = room - floor;
    out.room_bytes   = room;
    out.room_entries = want > 0 ? want / in.entry_cost : 0;
    // the caps: the ceiling (a budget, as a fixed one) and every streamed expert
    out.cap_entries = in.n_entries;
    if (in.ceil_bytes > 0) {
        out.cap_entries = std::min<int64_t>(out.cap_entries, in.ceil_bytes / in.entry_bytes);
    }
    out.entries = std::min(out.room_entries, out.cap_entries);
    if (out.entries < in.min_entries) {
        // a floor larger than the room must not turn auto into a refusal while a working budget exists:
        // the floor shrinks to what is left above the minimum, never below the least floor
        const int64_t left = room - in.min_entries * in.entry_cost;
        if (left >= LLAMA_MOE_STREAM_SIZING_FLOOR_MIN_MIB * mib &&
            (in.ceil_bytes == 0 || in.ceil_bytes >= in.min_entries * in.entry_bytes)) {
            out.floor_gave_way = true;
            out.floor_bytes    = left;
            out.entries        = in.min_entries;
            out.room_entries   = in.min_entries;
        }
    }
    out.in_waves     = out.entries < in.min_entries && out.entries >= in.least_entries;
    out.budget_bytes = out.entries * in.entry_bytes;
    if (out.entries < in.least_entries) {
        out.status = LLAMA_MOE_STREAM_UNDER_MINIMUM;
    }
    return out;
}
