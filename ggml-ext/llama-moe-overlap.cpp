// pybmoe: the auto rule's timed answer for reads behind compute. See llama-moe-overlap.h.

#include "llama-moe-overlap.h"

#include <algorithm>

static int64_t llama_moe_median(std::vector<int64_t> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
}

bool llama_moe_overlap_trial::token(int64_t now_us, bool decode) {
    if (done) {
        return on;
    }
    if (!decode) {
        t_start = -1; // a prefill ubatch, and the time up to the next ubatch, are not timed
        return false;
    }
    if (t_start >= 0) {
        (arm ? t_on : t_off).push_back(now_us - t_start);
    }
    if ((int32_t) t_on.size() >= n_each && (int32_t) t_off.size() >= n_each) {
        median_on_us  = llama_moe_median(t_on);
        median_off_us = llama_moe_median(t_off);
        on   = median_on_us < median_off_us;
        done = true;
        return on;
    }
    // alternate, so that both ways see the same disk and the same phase of the run; a way that has its
    // tokens already gives its turns to the other
    arm = (int32_t) t_on.size() >= n_each ? false : (int32_t) t_off.size() >= n_each ? true : !arm;
    t_start = now_us;
    return arm;
}
