// The timed auto rule of reads behind compute (ggml-ext/llama-moe-overlap.h), fed made-up token times:
// built and run by tests/engine/test_stream_identity.py. Prints one line per case and "ok" at the end;
// exits 1 at the first case that does not hold.

#include "llama-moe-overlap.h"

#include <cstdio>
#include <vector>

static int fail(const char * what) {
    printf("FAIL %s\n", what);
    return 1;
}

// feeds decode ubatches that take `on_us` with the overlap and `off_us` without, n of them; returns the
// ways the trial gave, in order
static std::vector<int> run(llama_moe_overlap_trial & t, int64_t & now, int64_t on_us, int64_t off_us, int n) {
    std::vector<int> ways;
    for (int i = 0; i < n; ++i) {
        const bool w = t.token(now, true);
        ways.push_back(w ? 1 : 0);
        now += w ? on_us : off_us;
    }
    return ways;
}

int main() {
    {   // faster with: decided after 3 tokens each way (the first ubatch is not timed), then on for good
        llama_moe_overlap_trial t;
        t.n_each = 3;
        int64_t now = 1000;
        std::vector<int> ways = run(t, now, 70000, 80000, 12);
        int on = 0, off = 0;
        for (int i = 0; i < 7; ++i) {
            (ways[i] ? on : off)++;
        }
        if (!(on >= 3 && off >= 3)) return fail("both ways timed 3 times in the first 7 ubatches");
        if (!t.decided() || !t.answer()) return fail("decided: on");
        for (int i = 7; i < 12; ++i) {
            if (ways[i] != 1) return fail("on after the decision");
        }
        if (t.median_on_us != 70000 || t.median_off_us != 80000) return fail("medians 70000 / 80000");
        printf("faster with: on, medians %lld / %lld us\n", (long long) t.median_on_us, (long long) t.median_off_us);
    }
    {   // faster without: off for good
        llama_moe_overlap_trial t;
        t.n_each = 4;
        int64_t now = 0;
        std::vector<int> ways = run(t, now, 90000, 60000, 20);
        if (!t.decided() || t.answer()) return fail("decided: off");
        if (ways.back() != 0) return fail("off after the decision");
        printf("faster without: off, medians %lld / %lld us\n", (long long) t.median_on_us, (long long) t.median_off_us);
    }
    {   // a prefill ubatch between two decode ubatches: neither the time up to it nor the one after it counts
        llama_moe_overlap_trial t;
        t.n_each = 1;
        int64_t now = 0;
        t.token(now, true);            // ubatch 1 (timed until the next call)
        now += 5000000;                // a long prefill follows at once: ubatch 1's time would be 5 s
        if (t.token(now, false)) return fail("a prefill ubatch does not go behind compute in the trial");
        now += 100;
        if (t.decided()) return fail("nothing timed across a prefill");
        const bool w1 = t.token(now, true); // timing starts again here
        now += w1 ? 10 : 20;
        const bool w2 = t.token(now, true);
        now += w2 ? 10 : 20;
        t.token(now, true);
        if (!t.decided()) return fail("decided after one timed token each way");
        if (!t.answer() || t.median_on_us != 10 || t.median_off_us != 20) return fail("the prefill's 5 s counted nowhere");
        printf("prefill between: not timed, on, medians %lld / %lld us\n", (long long) t.median_on_us, (long long) t.median_off_us);
    }
    printf("ok\n");
    return 0;
}
