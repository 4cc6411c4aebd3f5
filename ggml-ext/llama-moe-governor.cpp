// pybmoe: the stream tier's governor. See llama-moe-governor.h.

#include "llama-moe-governor.h"

#include <algorithm>

int64_t llama_moe_governor_step(int64_t entry_cost, int64_t total_bytes) {
    return std::max<int64_t>(std::min<int64_t>(16ll << 20, total_bytes / 8), 4 * entry_cost);
}

int64_t llama_moe_governor_target(const llama_moe_governor_input & in) {
    const int64_t cost  = std::max<int64_t>(in.entry_cost, 1);
    const int64_t eb    = std::max<int64_t>(in.entry_bytes, 1);
    const int64_t slack = in.free - std::max<int64_t>(in.unfilled, 0) - in.reserve;
    int64_t want = in.budget;
    if (slack < 0) {
        const int64_t give = -slack + in.step / 2;
        want = in.budget - (give + cost - 1) / cost * eb;
    } else if (slack >= in.step && in.budget < in.cap) {
        want = in.budget + (slack - in.step / 2) / cost * eb;
    }
    return std::max(std::min(want, in.cap), in.least);
}
