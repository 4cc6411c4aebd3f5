// pybmoe: the stream tier beside the contexts: its budget as contexts come and go (auto's room, a fixed
// budget's clamp, resize), the cache cycle's WARN on every crossing, and the overlap rule's view of the
// contexts' compute threads. See llama-moe-stream.h.
//
// Holds: what changes when a context is created or freed, or the budget is set. Must not hold: the
// per-step graph op (llama-moe-stream.cpp) or load-time sizing (llama-moe-stream-init.cpp).

#include "llama-moe-governor.h"
#include "llama-moe-memory.h"
#include "llama-moe-model.h"

#include "llama-impl.h"

#include "ggml.h"

#include <algorithm>

//
// the budget beside the contexts
//

int64_t llama_moe_stream::resize(int64_t want, bool quiet) {
    settle_prefetch(-1);
    want = std::min<int64_t>(want, total_bytes);
    std::vector<int32_t> evicted;
    {
        std::unique_lock<std::mutex> lock_st(mutex);
        budget_bytes = want;
        lru.resize(lru_entries(want), evicted);
        wait_unpinned(lock_st, evicted); // an upload started after the last generation may still read one
    }
    release(evicted);
    for (auto & f : frames) {
        f.trim(); // the process's memory drops with the budget
    }
    if (!quiet) {
        LLAMA_LOG("%s: moe-stream: budget %lld MiB now (%lld experts resident, %zu evicted)\n", __func__,
                (long long) (want >> 20), (long long) lru.n_resident, evicted.size());
    }
    return want;
}

int64_t llama_moe_stream::auto_room() const {
    // the memory held auto_room_entries entries of entry_cost each; the contexts take whole entries from it
    const int64_t drop = (contexts_bytes() + entry_cost - 1) / entry_cost;
    return std::min(auto_room_entries - drop, auto_cap_entries) * (int64_t) entry_bytes;
}

int64_t llama_moe_stream::shared_room() const {
    if (is_auto) {
        return auto_room_entries * entry_cost;
    }
    return avail_bytes - dense_bytes - prefetch_entries * entry_cost - floor_bytes;
}

int64_t llama_moe_stream::fixed_room(int64_t ctx_bytes) const {
    const int64_t room = shared_room();
    if (avail_bytes <= 0) {
        return fixed_bytes; // the memory available is not known: the budget as asked
    }
    const int64_t entries = (room > 0 ? room / entry_cost : 0) - (ctx_bytes + entry_cost - 1) / entry_cost;
    return std::min({ fixed_bytes, total_bytes, entries * (int64_t) entry_bytes });
}

void llama_moe_stream::clamp_fixed(int64_t ctx_bytes) {
    const double mib = 1024.0 * 1024.0;
    const int64_t fit  = fixed_room(ctx_bytes);
    const int64_t want = std::max(fit, least_bytes());
    // the WARN compares with the budget last said (the quiet clamp at load, before any context, says nothing)
    const bool warn = want < fixed_said;
    if (want == budget_bytes && !warn) {
        return;
    }
    if (warn) {
        LLAMA_LOG_WARN("llama_moe_stream: moe-stream: WARNING --moe-stream-cache-mb %.0f MiB does not fit: %.0f MiB "
                "available at load (limit %.0f MiB) - %.0f MiB dense weights - %.0f MiB prefetch window - %.0f MiB floor - "
                "%.1f MiB of contexts' host memory leaves %.1f MiB; clamped to %.1f MiB%s (a budget over what fits would "
                "get the process killed as the experts are read)\n", std::max(fixed_asked, fixed_bytes) / mib, avail_bytes / mib, limit_bytes / mib,
                dense_bytes / mib, (double) (prefetch_entries * entry_cost) / mib, floor_bytes / mib, ctx_bytes / mib,
                std::max<int64_t>(fit, 0) / mib, want / mib,
                fit < least_bytes() ? format(", the mechanical minimum: the process may exceed its memory by %.0f MiB (give "
                        "it more memory, a smaller -c or -ub)", (least_bytes() - fit) / mib).c_str() : "");
    }
    const int64_t before = budget_bytes;
    if (want != budget_bytes) {
        resize(want);
    }
    fixed_said = budget_bytes;
    warn_cycle(before);
}

void llama_moe_stream::warn_cycle(int64_t before) const {
    if ((double) budget_bytes >= (double) cycle_bytes || (double) before < (double) cycle_bytes || budget_bytes >= total_bytes) {
        return;
    }
    // the cliff guard (the BigMoeOnEdge seed): state the fact each time the budget crosses under it
    LLAMA_LOG_WARN("llama_moe_stream: moe-stream: WARNING the budget of %.1f MiB is below the cache cycle of %.1f MiB (every "
            "streamed layer's top-%d experts): under LRU one token's experts cannot all stay resident until the next "
            "token, so the hit rate falls toward 0 and decode rereads what it evicted%s\n", budget_bytes / (1024.0 * 1024.0),
            cycle_bytes / (1024.0 * 1024.0), n_used,
            contexts.empty() ? "" : " (the contexts' host memory took the rest: a smaller -c or -np gives it back)");
}

void llama_moe_stream::update_overlap() {
    if (!overlap || !overlap_auto) {
        return;
    }
    int32_t most = 0;
    for (const auto & [c, t] : context_threads) {
        most = std::max(most, t);
    }
    const bool spare = !context_threads.empty() && most < n_cpus;
    if (!context_threads.empty() && (int) spare != overlap_said) {
        overlap_said = spare ? 1 : 0;
        if (spare) {
            LLAMA_LOG("llama_moe_stream: moe-stream: reads behind compute: on (auto): %d compute thread(s) of %d CPUs "
                    "leave the read lanes a core; a decode step's misses are read while the layer computes\n", most, n_cpus);
        } else if (overlap_trial.decided()) {
            LLAMA_LOG("llama_moe_stream: moe-stream: reads behind compute: %s (auto, timed): %d compute thread(s) take all "
                    "%d CPUs; the decode tokens timed before were faster %s them\n", overlap_trial.answer() ? "on" : "off",
                    most, n_cpus, overlap_trial.answer() ? "with" : "without");
        } else {
            LLAMA_LOG("llama_moe_stream: moe-stream: reads behind compute: timed (auto): %d compute thread(s) take all %d "
                    "CPUs, where it may win or lose: the first decode tokens alternate with and without it (%d each way), "
                    "and the faster way stays (PYBMOE_MOE_STREAM_OVERLAP=1 or 0 decides)\n", most, n_cpus, overlap_trial.n_each);
        }
    }
    overlap_spare = spare;
}

void llama_moe_stream::time_overlap(int64_t now_us, bool decode) {
    if (!overlap || !overlap_auto || overlap_spare) {
        return;
    }
    const bool was_decided = overlap_trial.decided();
    overlap_arm.store(overlap_trial.token(now_us, decode), std::memory_order_relaxed);
    if (!was_decided && overlap_trial.decided()) {
        LLAMA_LOG("llama_moe_stream: moe-stream: reads behind compute: %s (auto, timed): decode tokens took %.1f ms with "
                "them, %.1f ms without (medians of %d tokens each)\n", overlap_trial.answer() ? "on" : "off",
                overlap_trial.median_on_us / 1e3, overlap_trial.median_off_us / 1e3, overlap_trial.n_each);
    }
}

void llama_moe_stream::on_context(const void * ctx, int64_t host_bytes, int64_t kv, int64_t compute, int64_t output,
                                  int64_t kv_ubatch, int32_t n_threads) {
    const double mib = 1024.0 * 1024.0;
    // elastic: the KV cache commits as it fills, and the governor sees it in the memory it reads
    contexts[ctx] = elastic ? host_bytes - kv : host_bytes;
    context_kv_ubatch[ctx] = elastic ? kv_ubatch : 0;
    context_threads[ctx] = std::max<int32_t>(1, n_threads);
    update_overlap();
    if (!is_auto) {
        clamp_fixed(elastic ? contexts_bytes() : planned_contexts_bytes());
        gov_said = budget_bytes;
        return;
    }
    const int64_t room = auto_room();
    const int64_t want = std::max<int64_t>(room, least_bytes());
    if (elastic) {
        LLAMA_LOG("%s: moe-stream: auto: a context takes %.1f MiB of host memory now (compute %.1f, output %.1f; its "
                "KV cache of %.1f MiB commits as it fills, the budget yielding to it) -> budget %.2f MiB (%lld experts)\n",
                __func__, (compute + output) / mib, compute / mib, output / mib, kv / mib, want / mib,
                (long long) (want / (int64_t) entry_bytes));
    } else {
        LLAMA_LOG("%s: moe-stream: auto: a context takes %.1f MiB of host memory (KV cache %.1f, compute %.1f, output %.1f; "
                "%zu context(s), %.1f MiB in all) -> budget %.2f MiB (%lld experts)\n", __func__, host_bytes / mib, kv / mib,
                compute / mib, output / mib, contexts.size(), contexts_bytes() / mib, want / mib,
                (long long) (want / (int64_t) entry_bytes));
    }
    if (room < least_bytes()) {
        LLAMA_LOG_WARN("%s: moe-stream: WARNING auto: %.0f MiB before contexts - %.1f MiB of contexts leaves %.0f MiB, under "
                "the mechanical minimum of %.1f MiB; the tier keeps the minimum and the process may exceed its memory by "
                "%.0f MiB (give it more memory, a smaller -c or -ub)\n", __func__,
                (double) auto_room_entries * entry_bytes / mib, contexts_bytes() / mib,
                std::max<int64_t>(room, 0) / mib, least_bytes() / mib, (least_bytes() - room) / mib);
    } else if (want < min_bytes && budget_bytes >= min_bytes) {
        LLAMA_LOG("%s: moe-stream: auto: the budget is under one layer step's largest set (%.1f MiB at ubatch %d): "
                "a step that needs more reads the rest in expert waves while the layer computes\n", __func__,
                min_bytes / mib, n_ubatch);
    }
    if (want != budget_bytes) {
        const int64_t before = budget_bytes;
        resize(want);
        warn_cycle(before);
    }
    gov_said = budget_bytes;
}

void llama_moe_stream::govern() {
    if (!elastic || !on()) {
        return;
    }
    const int64_t now = ggml_time_us();
    if (now - gov_last_us < 2000) {
        return;
    }
    gov_last_us = now;
    const int64_t free = (int64_t) llama_moe_read_mem_avail().free_now();
    if (free <= 0) {
        return; // not known: the plan at load stands
    }
    llama_moe_governor_input in;
    in.budget      = budget_bytes;
    in.free        = free;
    in.unfilled    = std::max<int64_t>(0, lru.capacity + lru.lend - charged_entries()) * entry_cost;
    in.reserve     = floor_bytes;
    for (const auto & [c, b] : context_kv_ubatch) {
        in.reserve += b;
    }
    in.least       = least_bytes();
    in.cap         = cap_bytes();
    in.step        = gov_step;
    in.entry_bytes = (int64_t) entry_bytes;
    in.entry_cost  = entry_cost;
    gov_free = free;
    const int64_t want = llama_moe_governor_target(in);
    if (want == budget_bytes) {
        return;
    }
    const int64_t before = budget_bytes;
    resize(want, /*quiet =*/ true);
    (want < before ? gov_yields : gov_grows)++;
    warn_cycle(before);
    if (std::abs(budget_bytes - gov_said) >= gov_step) {
        const double mib = 1024.0 * 1024.0;
        LLAMA_LOG("llama_moe_stream: moe-stream: budget %s to %.1f MiB (%lld experts, from %.1f MiB at the last line): "
                "%.0f MiB free now, %.0f MiB of it still to be filled by the tier, %.0f MiB kept free (floor and one ubatch's "
                "KV cells), at most %.1f MiB beside the contexts now, steps of %.2f MiB\n", budget_bytes < gov_said ? "yields" :
                "grows", budget_bytes / mib, (long long) (budget_bytes / (int64_t) entry_bytes), gov_said / mib, free / mib,
                in.unfilled / mib, in.reserve / mib, in.cap / mib, gov_step / mib);
        gov_said = budget_bytes;
    }
}

void llama_moe_stream::on_context_free(const void * ctx) {
    context_threads.erase(ctx);
    context_kv_ubatch.erase(ctx);
    update_overlap();
    if (contexts.erase(ctx) == 0) {
        return;
    }
    fit_ctx_bytes = 0; // the plan was for the contexts at load; from here the live ones count
    if (!is_auto) {
        clamp_fixed(contexts_bytes());
        return;
    }
    const int64_t room = auto_room();
    const int64_t want = std::max<int64_t>(room, least_bytes());
    if (want != budget_bytes) {
        resize(want);
    }
}
