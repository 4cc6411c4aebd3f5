// pybmoe: the stream tier's expert waves. See llama-moe-waves.h.

#include "llama-moe-waves.h"

#include <algorithm>

void llama_moe_waves::begin(int32_t li, int32_t n_proj_, const std::vector<int32_t> & experts_) {
    std::vector<int32_t> first;
    {
        std::lock_guard<std::mutex> lock(mutex);
        n_proj  = n_proj_;
        experts = experts_;
        for (int32_t p = 0; p < n_proj; ++p) {
            projs[p] = proj();
            projs[p].n_sent = std::min<size_t>(experts.size(), (size_t) std::max<int32_t>(window, 1));
        }
        first.assign(experts.begin(), experts.begin() + projs[0].n_sent);
        n_steps++;
    }
    for (int32_t p = 0; p < n_proj; ++p) {
        read(li, p, first);
    }
    li_now.store(li, std::memory_order_release);
}

void llama_moe_waves::pass(int32_t p, int64_t e, int ith, int nth) {
    const int32_t li = li_now.load(std::memory_order_acquire);
    std::vector<int32_t> gone, next;
    {
        std::lock_guard<std::mutex> lock(mutex);
        proj & pr = projs[p];
        if ((int) pr.at.size() != nth) {
            pr.at.assign((size_t) nth, 0); // the projection's MUL_MAT_ID starts: no thread is past anything
        }
        // the thread is done with every expert before e: its position is the first passed expert at or after e
        const int64_t at = std::lower_bound(experts.begin(), experts.end(), e) - experts.begin();
        pr.at[ith] = std::max(pr.at[ith], at);
        const size_t low = (size_t) *std::min_element(pr.at.begin(), pr.at.end());
        if (low > pr.n_done) {
            gone.assign(experts.begin() + pr.n_done, experts.begin() + low);
            pr.n_done = low;
        }
        const size_t want = std::min(experts.size(), low + (size_t) std::max<int32_t>(window, 1));
        if (want > pr.n_sent) {
            next.assign(experts.begin() + pr.n_sent, experts.begin() + want);
            pr.n_sent = want;
        }
    }
    // the reads first: a thread may be waiting for the next one
    if (!next.empty()) {
        read(li, p, next);
    }
    if (!gone.empty()) {
        drop(li, p, gone);
    }
}

void llama_moe_waves::finish(std::vector<int32_t> unread[LLAMA_MOE_N_PROJ]) {
    const int32_t li = li_now.load(std::memory_order_acquire);
    if (li < 0) {
        return;
    }
    std::vector<int32_t> gone[LLAMA_MOE_N_PROJ];
    {
        std::lock_guard<std::mutex> lock(mutex);
        for (int32_t p = 0; p < n_proj; ++p) {
            proj & pr = projs[p];
            gone[p].assign(experts.begin() + pr.n_done, experts.begin() + pr.n_sent);
            unread[p].assign(experts.begin() + pr.n_sent, experts.end());
            pr = proj();
        }
        experts.clear();
    }
    li_now.store(-1, std::memory_order_release);
    for (int32_t p = 0; p < n_proj; ++p) {
        if (!gone[p].empty()) {
            drop(li, p, gone[p]);
        }
    }
}
