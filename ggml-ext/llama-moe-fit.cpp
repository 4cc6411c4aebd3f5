// pybmoe: the contexts and the stream tier's budget fitted together. See llama-moe-fit.h.
//
// Holds: the plan and its line. Must not hold: measuring or applying (common, llama-moe-stream.cpp).

#include "llama-moe-fit.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>

static int64_t llama_moe_fit_div_up(int64_t a, int64_t b) {
    return a >= 0 ? (a + b - 1) / b : -((-a) / b);
}

uint32_t llama_moe_fit_n_ctx(uint32_t n_ctx, uint32_t n_seq, bool unified) {
    const uint32_t pad = 256;
    n_ctx = (n_ctx + pad - 1) / pad * pad;
    if (unified || n_seq <= 1) {
        return n_ctx;
    }
    const uint32_t per_slot = (n_ctx / n_seq + pad - 1) / pad * pad;
    return per_slot * n_seq;
}

// whether contexts of `bytes` run beside the tier's minimum (the floor giving way down to what must stay
// free): the line between a context that runs, under the cycle, and one that is refused
static bool llama_moe_fit_fits(const llama_moe_fit_input & in, int64_t bytes) {
    const int64_t least_cost = in.least_bytes / std::max<int64_t>(in.entry_bytes, 1) * in.entry_cost;
    return bytes >= 0 && in.room_bytes + in.floor_slack_bytes - bytes >= least_cost;
}

int64_t llama_moe_fit_budget(const llama_moe_fit_input & in, int64_t ctx_bytes) {
    // the room holds whole entries of entry_cost each; the contexts take whole entries from it (as
    // llama_moe_stream::auto_room does once they exist)
    const int64_t room_entries = in.room_bytes > 0 ? in.room_bytes / in.entry_cost : 0;
    int64_t b = (room_entries - llama_moe_fit_div_up(ctx_bytes, in.entry_cost)) * in.entry_bytes;
    if (!in.is_auto) {
        b = std::min(b, in.fixed_bytes);
    }
    return std::min(b, in.cap_bytes);
}

static int64_t llama_moe_fit_target(const llama_moe_fit_input & in) {
    if (in.elastic) {
        return in.least_bytes; // the room a context leaves while it fills is lent back at run time
    }
    int64_t t = in.cycle_bytes + in.cycle_bytes * in.margin_pct / 100;
    t = std::min(t, in.cap_bytes); // every expert resident: no cycle to keep
    if (!in.is_auto) {
        t = std::min(t, in.fixed_bytes); // a small fixed budget is the user's choice, not the context's doing
    }
    return std::max(t, in.least_bytes);
}

// can the budget beside contexts of `bytes` keep the target
static bool llama_moe_fit_keeps(const llama_moe_fit_input & in, int64_t target, int64_t bytes) {
    return bytes >= 0 && llama_moe_fit_budget(in, bytes) >= target;
}

// the largest x on the grid lo + k * step in [lo, hi) whose contexts keep the target, where lo keeps it
// (lo_bytes) and hi does not (hi_bytes): guessed on the line through the two measured points, each
// guess measured, stepping down until one keeps it (lo at the worst). Returns (x, its bytes).
static std::pair<int64_t, int64_t> llama_moe_fit_search(const llama_moe_fit_input & in, int64_t target,
        int64_t lo, int64_t lo_bytes, int64_t hi, int64_t hi_bytes, int64_t step,
        const std::function<int64_t(int64_t)> & measure) {
    const int64_t room_entries = in.room_bytes > 0 ? in.room_bytes / in.entry_cost : 0;
    const int64_t allowed = (room_entries - llama_moe_fit_div_up(target, in.entry_bytes)) * in.entry_cost;
    const double  slope   = (double) (hi_bytes - lo_bytes) / (double) (hi - lo);
    int64_t x = slope > 0 ? lo + (int64_t) ((double) (allowed - lo_bytes) / slope) : lo;
    x = std::clamp<int64_t>(lo + (x - lo) / step * step, lo, std::max(lo, hi - step));
    for (int i = 0; i < 8 && x > lo; ++i) {
        const int64_t b = measure(x);
        if (llama_moe_fit_keeps(in, target, b)) {
            return { x, b };
        }
        x = std::max(lo, lo + (x - lo - std::max(step, (x - lo) / 4)) / step * step);
    }
    return { lo, lo_bytes };
}

llama_moe_fit_plan llama_moe_fit_make_plan(const llama_moe_fit_input & in, const llama_moe_fit_measure_fn & measure) {
    llama_moe_fit_plan p;
    p.n_ctx        = in.n_ctx;
    p.n_seq        = std::max(1u, in.n_seq);
    p.target_bytes = llama_moe_fit_target(in);
    auto measured = [&](uint32_t n_ctx, uint32_t n_seq) {
        p.n_measured++;
        return measure(n_ctx, n_seq);
    };
    p.asked_bytes = measured(p.n_ctx, p.n_seq);
    if (p.asked_bytes < 0) {
        return p; // unmeasured: the contexts are set aside as they come (llama_moe_stream::on_context)
    }
    p.ctx_bytes    = p.asked_bytes;
    p.budget_bytes = llama_moe_fit_budget(in, p.ctx_bytes);
    auto settle = [&](uint32_t n_ctx, uint32_t n_seq, int64_t bytes, bool keeps) {
        p.n_ctx        = n_ctx;
        p.n_seq        = n_seq;
        p.ctx_bytes    = bytes;
        p.budget_bytes = llama_moe_fit_budget(in, bytes);
        const bool changed = n_ctx != in.n_ctx || n_seq != std::max(1u, in.n_seq);
        // under the minimum, the floor may give way down to what must stay free
        // (in bytes, not whole entries: the minimum's entries and the contexts beside what must stay free)
        const bool fits = llama_moe_fit_fits(in, bytes);
        if (!keeps && fits) {
            p.budget_bytes = std::max(p.budget_bytes, in.least_bytes);
        }
        p.status = keeps ? (changed ? LLAMA_MOE_PLAN_SHRUNK : LLAMA_MOE_PLAN_KEPT) :
                   fits ? LLAMA_MOE_PLAN_UNDER_CYCLE : LLAMA_MOE_PLAN_REFUSED;
    };
    // a default context grows past its least only while the budget keeps keep % of what the least leaves:
    // every MiB of context is a MiB the experts lose, and decode's hit rate grows with every MiB above the
    // cycle (docs/stream-tier.md, "Serving under a memory limit")
    int64_t target = p.target_bytes;
    if (!in.user_sized && !in.elastic) {
        const uint32_t seq_least = in.unified ? p.n_seq : 1;
        const int64_t  step      = 256 * (in.unified ? 1 : (int64_t) seq_least);
        const int64_t  n_least   = std::min<int64_t>(p.n_ctx, llama_moe_fit_div_up(in.n_ctx_min, step) * step);
        const int64_t  b_least   = n_least == p.n_ctx && seq_least == p.n_seq ? p.asked_bytes :
                                   measured((uint32_t) n_least, seq_least);
        if (b_least >= 0) {
            p.least_budget = llama_moe_fit_budget(in, b_least);
            // a fixed budget is the user's: a default context yields all of it before the budget is clamped
            const int64_t pct  = in.is_auto ? in.keep_pct : 100;
            const int64_t keep = p.least_budget / 100 * pct / in.entry_bytes * in.entry_bytes;
            target = std::max(target, std::min(keep, in.cap_bytes));
            p.target_bytes = target;
        }
    }
    if (llama_moe_fit_keeps(in, target, p.asked_bytes) || in.user_sized) {
        settle(p.n_ctx, p.n_seq, p.asked_bytes, llama_moe_fit_keeps(in, target, p.asked_bytes));
    } else {
        uint32_t n_seq = p.n_seq, n_ctx = p.n_ctx;
        int64_t  bytes = p.asked_bytes;
        bool     done  = false;
        // fewer slots first (not unified: each slot holds its own tokens), each keeping its length, while the
        // whole context keeps n_ctx_min tokens
        if (!in.unified && n_seq > 1) {
            const int64_t len   = n_ctx / n_seq;
            const int64_t s_min = std::max<int64_t>(1, llama_moe_fit_div_up(in.n_ctx_min, std::max<int64_t>(len, 1)));
            if (s_min < n_seq) {
                const int64_t lo_bytes = measured((uint32_t) (s_min * len), (uint32_t) s_min);
                if (llama_moe_fit_keeps(in, target, lo_bytes)) {
                    const auto [s, b] = llama_moe_fit_search(in, target, s_min, lo_bytes, n_seq, bytes, 1,
                            [&](int64_t x) { return measured((uint32_t) (x * len), (uint32_t) x); });
                    settle((uint32_t) (s * len), (uint32_t) s, b, true);
                    done = true;
                } else if (lo_bytes >= 0) {
                    n_seq = (uint32_t) s_min;
                    n_ctx = (uint32_t) (s_min * len);
                    bytes = lo_bytes;
                }
            }
        }
        // then shorter slots: the whole context from n_ctx down to n_ctx_min, on the grid llama_context pads to
        // (256 tokens, per slot when not unified)
        if (!done) {
            const int64_t step = 256 * (in.unified ? 1 : (int64_t) n_seq);
            const int64_t lo   = std::min<int64_t>(n_ctx, llama_moe_fit_div_up(in.n_ctx_min, step) * step);
            if (lo >= (int64_t) n_ctx) {
                settle(n_ctx, n_seq, bytes, false); // nothing left to shrink
            } else {
                const int64_t lo_bytes = measured((uint32_t) lo, n_seq);
                if (lo_bytes < 0) {
                    settle(n_ctx, n_seq, bytes, false);
                } else if (!llama_moe_fit_keeps(in, target, lo_bytes)) {
                    settle((uint32_t) lo, n_seq, lo_bytes, false); // the least context, under the target
                } else {
                    const auto [x, b] = llama_moe_fit_search(in, target, lo, lo_bytes, n_ctx, bytes, step,
                            [&](int64_t x) { return measured((uint32_t) x, n_seq); });
                    settle((uint32_t) x, n_seq, b, true);
                }
            }
        }
    }
    if (p.status == LLAMA_MOE_PLAN_REFUSED || p.status == LLAMA_MOE_PLAN_UNDER_CYCLE) {
        // what would fit: the largest context of p.n_seq slots that keeps the target, else the minimum
        const int64_t step = 256 * (in.unified ? 1 : (int64_t) p.n_seq);
        const int64_t lo_bytes = step < (int64_t) p.n_ctx ? measured((uint32_t) step, p.n_seq) : -1;
        for (const int64_t goal : { target, in.least_bytes }) {
            // under the target already running: only a context that keeps it is worth naming
            if (!llama_moe_fit_keeps(in, goal, lo_bytes) || (goal != target && p.status != LLAMA_MOE_PLAN_REFUSED)) {
                continue;
            }
            const auto x = llama_moe_fit_search(in, goal, step, lo_bytes, p.n_ctx, p.ctx_bytes, step,
                    [&](int64_t n) { return measured((uint32_t) n, p.n_seq); }).first;
            if (x >= 1024) { // a shorter context is not worth naming
                p.suggest_ctx   = (uint32_t) x;
                p.suggest_keeps = goal == target;
            }
            break;
        }
    }
    p.clamped = !in.is_auto && p.status != LLAMA_MOE_PLAN_REFUSED && p.budget_bytes < std::min(in.fixed_bytes, in.cap_bytes);
    if (in.elastic && p.status != LLAMA_MOE_PLAN_REFUSED) {
        const int64_t step = 256 * (in.unified ? 1 : (int64_t) p.n_seq);
        p.now_bytes  = step < (int64_t) p.n_ctx ? measured((uint32_t) step, p.n_seq) : p.ctx_bytes;
        p.budget_now = p.now_bytes >= 0 ? std::max(llama_moe_fit_budget(in, p.now_bytes), p.budget_bytes) : p.budget_bytes;
    }
    return p;
}

#if defined(__GNUC__)
static std::string llama_moe_fit_fmt(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
#endif
static std::string llama_moe_fit_fmt(const char * fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

// "4096 tokens" (one slot), "32768 tokens, 4 slots sharing them" (unified), "4 slots x 4096 tokens"
static std::string llama_moe_fit_ctx(uint32_t n_ctx, uint32_t n_seq, bool unified) {
    if (n_seq <= 1) {
        return llama_moe_fit_fmt(unified ? "%u tokens" : "1 slot x %u tokens", n_ctx);
    }
    return unified ? llama_moe_fit_fmt("%u tokens, %u slots sharing them", n_ctx, n_seq)
                   : llama_moe_fit_fmt("%u slots x %u tokens", n_seq, n_ctx / n_seq);
}

std::string llama_moe_fit_describe(const llama_moe_fit_input & in, const llama_moe_fit_plan & p) {
    const double mib = 1024.0 * 1024.0;
    if (p.status == LLAMA_MOE_PLAN_UNMEASURED) {
        return "fit: the contexts' host memory could not be measured ahead; each context is set aside as it is created";
    }
    const std::string asked = llama_moe_fit_fmt("%s (%s)", in.user_sized ? "the context as asked" : "the default context",
            llama_moe_fit_ctx(in.n_ctx, in.n_seq, in.unified).c_str());
    const std::string got   = llama_moe_fit_ctx(p.n_ctx, p.n_seq, in.unified);
    // -np only where the slots hold their own tokens: with a shared cache the slots cost nothing, and an
    // explicit -np turns the server's sharing off (a line names only flags that run as planned)
    const std::string flags = llama_moe_fit_fmt("-c %u%s", in.n_ctx, !in.unified ? llama_moe_fit_fmt(" -np %u", in.n_seq).c_str() : "");
    const int64_t cycle_target = std::max(in.cycle_bytes + in.cycle_bytes * in.margin_pct / 100, in.least_bytes);
    const std::string target = p.least_budget > 0 && p.target_bytes > cycle_target ?
            llama_moe_fit_fmt("%.1f MiB, %d %% of the %.1f MiB the least context leaves (above the cache cycle of "
                    "%.1f MiB + %d %%)", p.target_bytes / mib, in.is_auto ? in.keep_pct : 100, p.least_budget / mib, in.cycle_bytes / mib,
                    in.margin_pct) :
            p.target_bytes > in.cycle_bytes + in.cycle_bytes * in.margin_pct / 100 ?
            llama_moe_fit_fmt("the tier's minimum of %.1f MiB (above the cache cycle of %.1f MiB + %d %%)",
                    p.target_bytes / mib, in.cycle_bytes / mib, in.margin_pct) :
            llama_moe_fit_fmt("the cache cycle of %.1f MiB + %d %% = %.1f MiB", in.cycle_bytes / mib, in.margin_pct,
                    p.target_bytes / mib);
    const int64_t asked_budget = llama_moe_fit_budget(in, p.asked_bytes);
    std::string s = llama_moe_fit_fmt("fit: %.0f MiB for the contexts and the experts; %s takes %.1f MiB of host memory",
            std::max<int64_t>(in.room_bytes, 0) / mib, asked.c_str(), p.asked_bytes / mib);
    if (in.elastic && p.status != LLAMA_MOE_PLAN_REFUSED) {
        const std::string full = llama_moe_fit_fmt("budget %.1f MiB now (the contexts empty: %.1f MiB of them), %.1f MiB "
                "when every context is full (the tier's minimum: %.1f MiB%s)", p.budget_now / mib,
                std::max<int64_t>(p.now_bytes, 0) / mib, p.budget_bytes / mib, in.least_bytes / mib,
                p.budget_bytes < in.cycle_bytes ? llama_moe_fit_fmt("; under the cache cycle of %.1f MiB once they fill",
                        in.cycle_bytes / mib).c_str() : "");
        if (p.n_ctx != in.n_ctx || p.n_seq != in.n_seq) {
            s += llama_moe_fit_fmt("; full, it would leave the experts %.1f MiB, under the tier's minimum -> shrunk to %s "
                    "(%.1f MiB full): %s", asked_budget / mib, got.c_str(), p.ctx_bytes / mib, full.c_str());
        } else {
            s += llama_moe_fit_fmt(" when full -> %s: kept", full.c_str());
        }
        return s;
    }
    switch (p.status) {
        case LLAMA_MOE_PLAN_KEPT:
            s += llama_moe_fit_fmt(" -> budget %.1f MiB, at or above %s: kept", p.budget_bytes / mib, target.c_str());
            break;
        case LLAMA_MOE_PLAN_SHRUNK:
            s += llama_moe_fit_fmt(" and would leave the experts %.1f MiB, under %s -> shrunk to %s (%.1f MiB): budget "
                    "%.1f MiB", asked_budget / mib, target.c_str(), got.c_str(), p.ctx_bytes / mib, p.budget_bytes / mib);
            // a line names only flags that run: the full context as asked would be refused under the minimum
            s += llama_moe_fit_fits(in, p.asked_bytes) ?
                    llama_moe_fit_fmt("; %s restores the full context (and leaves the experts %.1f MiB)", flags.c_str(),
                            std::max<int64_t>(asked_budget, 0) / mib) :
                    llama_moe_fit_fmt("; the full context does not fit beside the tier's minimum here (%s would be refused)",
                            flags.c_str());
            break;
        case LLAMA_MOE_PLAN_UNDER_CYCLE:
            if (p.n_ctx != in.n_ctx || p.n_seq != in.n_seq) {
                s += llama_moe_fit_fmt(" and would leave the experts %.1f MiB -> shrunk to the least context, %s (%.1f MiB): "
                        "budget %.1f MiB, still under %s (give the process more memory)", asked_budget / mib, got.c_str(),
                        p.ctx_bytes / mib, p.budget_bytes / mib, target.c_str());
            } else {
                s += llama_moe_fit_fmt(" -> budget %.1f MiB, under %s: runs as asked (%s gives the experts their room)",
                        p.budget_bytes / mib, target.c_str(),
                        in.user_sized ? "a smaller -c or -np" : "more memory");
            }
            break;
        case LLAMA_MOE_PLAN_REFUSED:
            if (p.n_ctx != in.n_ctx || p.n_seq != in.n_seq) {
                s += llama_moe_fit_fmt("; even the least context, %s, takes %.1f MiB", got.c_str(), p.ctx_bytes / mib);
            }
            s += llama_moe_fit_fmt(" and leaves the experts %.1f MiB, under the tier's minimum of %.1f MiB",
                    p.budget_bytes / mib, in.least_bytes / mib);
            break;
        case LLAMA_MOE_PLAN_UNMEASURED:
            break;
    }
    if (p.suggest_ctx > 0) {
        s += llama_moe_fit_fmt("; -c %u%s %s", p.suggest_ctx, !in.unified ? llama_moe_fit_fmt(" -np %u", p.n_seq).c_str() : "",
                p.suggest_keeps ? "keeps the cycle" : "fits, under the cycle");
    }
    if (p.clamped) {
        s += llama_moe_fit_fmt("; the fixed budget of %.0f MiB does not fit beside the contexts: clamped to %.1f MiB",
                std::max(in.fixed_asked, in.fixed_bytes) / mib, p.budget_bytes / mib);
    }
    return s;
}
