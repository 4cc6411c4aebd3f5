#pragma once

// pybmoe: the stream tier's reads still in flight while a layer computes, and the CPU kernel's wait
// for them (patch 0033: ggml-cpu's MUL_MAT_ID calls a hook before each expert's rows).
//
// Why: a layer step's misses are read in one blocking step before the layer computes. With
// PYBMOE_MOE_STREAM_OVERLAP=1 a decode step starts their reads and returns; MUL_MAT_ID walks the
// experts in id order and, before an expert's rows, waits for that expert's bytes in that projection
// only. So the hits, and the misses already read, compute while the rest are read (docs/stream-tier.md,
// "Reads behind compute": it pays only where the compute threads leave the read lanes a core).
//
// How: one flag per (entry, projection), set by the step for each range it submits and cleared by
// the read lane when the range is in place; a process-wide map from each streamed expert tensor to
// its tier and (layer, projection), which the hook looks up only while some flag is set anywhere.
//
// Holds: the flags, the wait, the tensor map and the hook. Must not hold: which entries to read (the
// stream step, llama-moe-stream.cpp), the reads themselves (llama-moe-source.h) or the policy.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct ggml_tensor;
struct llama_moe_waves;

struct llama_moe_inflight {
    // n_entries (layer, expert) entries of n_proj projections each
    void init(int64_t n_entries, int32_t n_proj);

    // projection p of entry is being read (the step, before it submits the range)
    void mark(int64_t entry, int32_t p);

    // projection p of entries [first, first + count) is in place (the lane, after the read); ok false:
    // the read failed with `err`, and every wait from now on aborts with it
    void done(int64_t first, int64_t count, int32_t p, bool ok, const std::string & err);

    // blocks until projection p of entry is in place (returns at once when it is not being read); adds
    // the time at least one thread waited to wait_us. Aborts when a read failed
    void wait(int64_t entry, int32_t p);

    bool busy(int64_t entry, int32_t p) const {
        return n_flags > 0 && flags[(size_t) entry * n_proj + p].load(std::memory_order_acquire) != 0;
    }

    std::atomic<uint64_t> wait_us { 0 }; // the time at least one compute thread waited for a read

    // the tier's expert waves (llama-moe-waves.h): while a layer's step runs in waves, the hook passes
    // each thread's position there before it waits; hold() keeps the hook awake meanwhile, unhold() ends it
    llama_moe_waves * waves = nullptr;
    void hold();
    void unhold();

    // the CPU MUL_MAT_ID's hook: routes (as, e) to the tier that streams `as`. register_tensor maps one
    // expert tensor to this tier's layer li, projection p; forget drops every tensor of this tier
    void register_tensor(const ggml_tensor * t, int32_t li, int32_t p, int32_t n_expert);
    void forget();

    // installs the hook in the CPU backend (once per process); false when the backend has no such hook
    static bool install();

private:
    std::unique_ptr<std::atomic<uint8_t>[]> flags; // [n_entries * n_proj]
    int64_t n_flags = 0;
    int32_t n_proj  = 0;

    std::atomic<int32_t> n_waiting { 0 };
    std::atomic<int64_t> wait_t0   { 0 };      // when the first of the threads waiting now began (us)
    std::atomic<bool>    failed    { false };
    std::mutex           mutex;                // the error
    std::string          error;
};
