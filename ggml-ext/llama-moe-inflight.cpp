// pybmoe: the stream tier's reads in flight and the CPU kernel's wait for them. See llama-moe-inflight.h.

#include "llama-moe-inflight.h"
#include "llama-moe-source.h"
#include "llama-moe-waves.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <chrono>
#include <thread>
#include <unordered_map>

namespace {

struct llama_moe_inflight_ref {
    llama_moe_inflight * tier;
    int32_t li;
    int32_t p;
    int32_t n_expert;
};

// every streamed expert tensor of the process -> its tier, layer and projection (several models may
// stream at once); g_busy counts the flags set in all of them, so that the hook costs one atomic load
// while nothing is in flight (every other MUL_MAT_ID of the process, prefill or decode)
std::mutex g_mutex;
std::unordered_map<const ggml_tensor *, llama_moe_inflight_ref> g_tensors;
std::atomic<int64_t> g_busy { 0 };

int64_t llama_moe_now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
            std::chrono::steady_clock::now().time_since_epoch()).count();
}

void llama_moe_mul_mat_id_wait(const ggml_tensor * as, int64_t e, int ith, int nth) {
    if (g_busy.load(std::memory_order_acquire) == 0) {
        return;
    }
    llama_moe_inflight_ref ref;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_tensors.find(as);
        if (it == g_tensors.end()) {
            return;
        }
        ref = it->second;
    }
    llama_moe_waves * waves = ref.tier->waves;
    if (waves != nullptr && waves->active(ref.li)) {
        waves->pass(ref.p, e, ith, nth); // drops what every thread is past, reads ahead
    }
    if (e < ref.n_expert) {
        ref.tier->wait((int64_t) ref.li * ref.n_expert + e, ref.p);
    }
}

} // namespace

void llama_moe_inflight::init(int64_t n_entries, int32_t n_proj_) {
    n_proj  = n_proj_;
    n_flags = n_entries * n_proj;
    flags.reset(new std::atomic<uint8_t>[(size_t) n_flags]);
    for (int64_t i = 0; i < n_flags; ++i) {
        flags[i].store(0, std::memory_order_relaxed);
    }
}

void llama_moe_inflight::mark(int64_t entry, int32_t p) {
    flags[(size_t) entry * n_proj + p].store(1, std::memory_order_release);
    g_busy.fetch_add(1, std::memory_order_acq_rel);
}

void llama_moe_inflight::done(int64_t first, int64_t count, int32_t p, bool ok, const std::string & err) {
    if (!ok) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failed.load()) {
            error = err;
            failed.store(true, std::memory_order_release);
        }
    }
    for (int64_t e = first; e < first + count; ++e) {
        flags[(size_t) e * n_proj + p].store(0, std::memory_order_release);
    }
    g_busy.fetch_sub(count, std::memory_order_acq_rel);
}

void llama_moe_inflight::hold() {
    g_busy.fetch_add(1, std::memory_order_acq_rel);
}

void llama_moe_inflight::unhold() {
    g_busy.fetch_sub(1, std::memory_order_acq_rel);
}

void llama_moe_inflight::wait(int64_t entry, int32_t p) {
    const std::atomic<uint8_t> & f = flags[(size_t) entry * n_proj + p];
    if (f.load(std::memory_order_acquire) == 0) {
        return;
    }
    // polled, yielding the core between polls: a read takes 0.1 .. 10 ms, and on a machine of few cores the
    // lanes need the CPU the compute threads would spin on (a sleep on a condition variable instead cost
    // each miss a wake-up of every compute thread: decode 10-25 % slower than the blocking step)
    const int64_t t0 = llama_moe_now_us();
    if (n_waiting.fetch_add(1, std::memory_order_acq_rel) == 0) {
        wait_t0.store(t0, std::memory_order_relaxed);
    }
    while (f.load(std::memory_order_acquire) != 0 && !failed.load(std::memory_order_acquire)) {
        std::this_thread::yield();
    }
    if (n_waiting.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        wait_us += (uint64_t) (llama_moe_now_us() - wait_t0.load(std::memory_order_relaxed));
    }
    if (failed.load(std::memory_order_acquire)) {
        // note: the expert's bytes are not there, so the layer's output would be wrong: stop here
        std::string err;
        {
            std::lock_guard<std::mutex> lock(mutex);
            err = error;
        }
        llama_moe_read_failed(err);
    }
}

void llama_moe_inflight::register_tensor(const ggml_tensor * t, int32_t li, int32_t p, int32_t n_expert) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_tensors[t] = { this, li, p, n_expert };
}

void llama_moe_inflight::forget() {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (auto it = g_tensors.begin(); it != g_tensors.end(); ) {
        it = it->second.tier == this ? g_tensors.erase(it) : std::next(it);
    }
}

bool llama_moe_inflight::install() {
    static const bool ok = [] {
        ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
        auto * set = reg ? (void (*)(ggml_cpu_mul_mat_id_wait_t)) ggml_backend_reg_get_proc_address(reg,
                "ggml_cpu_set_mul_mat_id_wait") : nullptr;
        if (set == nullptr) {
            return false;
        }
        set(llama_moe_mul_mat_id_wait);
        return true;
    }();
    return ok;
}
