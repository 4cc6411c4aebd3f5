// pybmoe: a model file that shrinks under a running process, named. See llama-moe-sigbus.h.
//
// Holds: the mapped ranges' table and the SIGBUS handler. Must not hold: anything the handler could
// not do safely (locks, allocation, stdio): the handler only reads the table, stat()s and write()s.

#include "llama-moe-sigbus.h"

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <atomic>
#include <cstring>
#include <mutex>

#if !defined(_WIN32)
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#endif

namespace {

// one mapped file of one model: [lo, hi) in this process, file offset 0 at lo
struct llama_moe_mapped_range {
    std::atomic<uintptr_t> lo { 0 };
    std::atomic<uintptr_t> hi { 0 };
    const void *           owner = nullptr; // the registering model's owner (read by unregister, never by the handler)
    char                   path[512] = {};
};

constexpr int LLAMA_MOE_SIGBUS_RANGES = 64; // mapped files of all live models; more are not named (one WARN)

llama_moe_mapped_range g_sigbus_ranges[LLAMA_MOE_SIGBUS_RANGES];
std::mutex             g_sigbus_mutex; // registration only; the handler reads the atomics
bool                   g_sigbus_installed = false;
std::atomic<bool>      g_sigbus_said { false }; // one line, however many compute threads fault at once
std::atomic<bool>      g_sigbus_done { false }; // the line is written: the faults may kill the process now

#if !defined(_WIN32)
struct sigaction g_sigbus_prev = {};

void llama_moe_sigbus_write(const char * s, size_t n) {
    while (n > 0) {
        const ssize_t w = write(STDERR_FILENO, s, n);
        if (w <= 0) {
            return;
        }
        s += w;
        n -= (size_t) w;
    }
}

void llama_moe_sigbus_handler(int sig, siginfo_t * info, void * uctx) {
    const uintptr_t a = (uintptr_t) (info ? info->si_addr : nullptr);
    for (const auto & r : g_sigbus_ranges) {
        const uintptr_t lo = r.lo.load(std::memory_order_acquire);
        const uintptr_t hi = r.hi.load(std::memory_order_acquire);
        if (lo == 0 || a < lo || a >= hi) {
            continue;
        }
        if (!g_sigbus_said.exchange(true)) {
            struct stat sb = {};
            const int64_t size = stat(r.path, &sb) == 0 ? (int64_t) sb.st_size : -1;
            char line[1024];
            const size_t n = llama_moe_sigbus_format(line, sizeof(line), r.path, (uint64_t) (a - lo), size);
            llama_moe_sigbus_write(line, n);
            // the default action kills the process (status 135) when the faulting read runs again
            signal(SIGBUS, SIG_DFL);
            g_sigbus_done.store(true);
            return;
        }
        // another thread writes the line: its fault kills the process once it is out (at most ~1 s here)
        for (int i = 0; i < 1000 && !g_sigbus_done.load(); ++i) {
            const struct timespec ms = { 0, 1000000 };
            nanosleep(&ms, nullptr);
        }
        return;
    }
    // not a model's page: whatever handled SIGBUS before
    if ((g_sigbus_prev.sa_flags & SA_SIGINFO) && g_sigbus_prev.sa_sigaction != nullptr) {
        g_sigbus_prev.sa_sigaction(sig, info, uctx);
        return;
    }
    if (!(g_sigbus_prev.sa_flags & SA_SIGINFO) && g_sigbus_prev.sa_handler != SIG_DFL && g_sigbus_prev.sa_handler != SIG_IGN &&
            g_sigbus_prev.sa_handler != nullptr) {
        g_sigbus_prev.sa_handler(sig);
        return;
    }
    signal(SIGBUS, SIG_DFL);
}
#endif

// appends s to buf at *at (bounded by n - 1)
void llama_moe_put(char * buf, size_t n, size_t * at, const char * s) {
    while (*s && *at + 1 < n) {
        buf[(*at)++] = *s++;
    }
}

void llama_moe_put_u64(char * buf, size_t n, size_t * at, uint64_t v) {
    char d[24];
    int k = 0;
    do {
        d[k++] = (char) ('0' + v % 10);
        v /= 10;
    } while (v > 0);
    while (k > 0 && *at + 1 < n) {
        buf[(*at)++] = d[--k];
    }
}

} // namespace

size_t llama_moe_sigbus_format(char * buf, size_t n, const char * path, uint64_t offs, int64_t size) {
    if (n == 0) {
        return 0;
    }
    size_t at = 0;
    llama_moe_put(buf, n, &at, "llama_moe_sigbus: error: the model file ");
    llama_moe_put(buf, n, &at, path);
    llama_moe_put(buf, n, &at, " changed while it was mapped: reading its byte at offset ");
    llama_moe_put_u64(buf, n, &at, offs);
    if (size >= 0) {
        llama_moe_put(buf, n, &at, " faulted (SIGBUS), the file is ");
        llama_moe_put_u64(buf, n, &at, (uint64_t) size);
        llama_moe_put(buf, n, &at, " bytes long now");
    } else {
        llama_moe_put(buf, n, &at, " faulted (SIGBUS), the file is gone");
    }
    llama_moe_put(buf, n, &at, "; the process stops (replace a model file only while no process maps it)\n");
    buf[at] = '\0';
    return at;
}

void llama_moe_sigbus_register(const llama_model & model) {
#if !defined(_WIN32)
    const llama_moe_tiers * mc = model.moe_cache;
    if (mc == nullptr || mc->sources.empty()) {
        return;
    }
    // each file's mapping base: a weight read through the map sits at base + its file offset
    std::vector<uintptr_t> base(mc->sources.paths.size(), 0);
    for (const auto & [name, t] : model.tensors_by_name) {
        if (t->buffer == nullptr || t->data == nullptr ||
                strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)), "CPU_Mapped") != 0) {
            continue;
        }
        const auto it = mc->sources.tensors.find(name);
        if (it != mc->sources.tensors.end() && it->second.file < base.size() && base[it->second.file] == 0) {
            base[it->second.file] = (uintptr_t) t->data - it->second.offs;
        }
    }
    std::lock_guard<std::mutex> lock(g_sigbus_mutex);
    for (size_t f = 0; f < base.size(); ++f) {
        struct stat sb = {};
        if (base[f] == 0 || stat(mc->sources.paths[f].c_str(), &sb) != 0) {
            continue;
        }
        llama_moe_mapped_range * slot = nullptr;
        for (auto & r : g_sigbus_ranges) {
            if (r.lo.load() == 0) {
                slot = &r;
                break;
            }
        }
        if (slot == nullptr) {
            LLAMA_LOG_WARN("%s: more than %d mapped model files in this process: a fault in %s is not named\n", __func__,
                    LLAMA_MOE_SIGBUS_RANGES, mc->sources.paths[f].c_str());
            continue;
        }
        snprintf(slot->path, sizeof(slot->path), "%s", mc->sources.paths[f].c_str());
        slot->owner = mc;
        slot->hi.store(base[f] + (uintptr_t) sb.st_size, std::memory_order_release);
        slot->lo.store(base[f], std::memory_order_release);
    }
    if (!g_sigbus_installed) {
        struct sigaction sa = {};
        sa.sa_sigaction = llama_moe_sigbus_handler;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        g_sigbus_installed = sigaction(SIGBUS, &sa, &g_sigbus_prev) == 0;
    }
#else
    (void) model;
#endif
}

void llama_moe_sigbus_unregister(const void * owner) {
    std::lock_guard<std::mutex> lock(g_sigbus_mutex);
    for (auto & r : g_sigbus_ranges) {
        if (r.owner == owner && r.lo.load() != 0) {
            r.lo.store(0, std::memory_order_release);
            r.hi.store(0, std::memory_order_release);
            r.owner = nullptr;
        }
    }
}
