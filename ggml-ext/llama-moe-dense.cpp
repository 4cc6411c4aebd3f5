// pybmoe: --dense-weights mmap|warm|anon. See llama-moe-dense.h.
//
// Holds: the dense weights' warm-up and their move to anonymous memory. Must not hold: the experts.

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#if !defined(_WIN32)
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

llama_moe_dense::~llama_moe_dense() {
#if !defined(_WIN32)
    for (auto & [p, n] : regions) {
        munmap(p, n);
    }
#endif
}

int32_t llama_model_moe_dense_weights(llama_model * model, int32_t mode) {
    if (mode < LLAMA_MOE_DENSE_MMAP || mode > LLAMA_MOE_DENSE_ANON) {
        LLAMA_LOG_ERROR("%s: dense weights: mode %d; accepted: 0 (mmap), 1 (warm), 2 (anon)\n", __func__, mode);
        return -1;
    }
    if (mode == LLAMA_MOE_DENSE_MMAP) {
        return 0;
    }
    llama_moe_cache * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || mc->sources.empty()) {
        LLAMA_LOG_ERROR("%s: dense weights: the model was not loaded from a GGUF file path\n", __func__);
        return -1;
    }
    if (mc->dense.mode != LLAMA_MOE_DENSE_MMAP) {
        LLAMA_LOG_ERROR("%s: dense weights: a policy was already applied\n", __func__);
        return -1;
    }
#if defined(_WIN32)
    LLAMA_LOG_ERROR("%s: dense weights: warm and anon need pread (not in this build)\n", __func__);
    return -1;
#else
    // the dense weights: host tensors in the GGUF layout that are not experts
    struct item { ggml_tensor * t; llama_moe_source src; };
    std::vector<item> items;
    size_t total = 0;
    for (const auto & [name, t] : model->tensors_by_name) {
        const auto it = mc->sources.tensors.find(name);
        if (it == mc->sources.tensors.end() || t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer) ||
            it->second.nbytes != ggml_nbytes(t) || !ggml_is_contiguous(t)) {
            continue;
        }
        const char * bname = ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer));
        if (strcmp(bname, "CPU") != 0 && strcmp(bname, "CPU_Mapped") != 0) {
            continue; // repacked or another device's: not the GGUF's bytes
        }
        if (name.find("_exps.weight") != std::string::npos) {
            continue; // experts: the stream tier's, or left mapped
        }
        items.push_back({ t, it->second });
        total += ggml_nbytes(t);
    }
    std::sort(items.begin(), items.end(), [](const item & a, const item & b) {
        return a.src.file != b.src.file ? a.src.file < b.src.file : a.src.offs < b.src.offs;
    });
    const double mib = 1024.0 * 1024.0;
    const auto t0 = std::chrono::steady_clock::now();
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    if (mode == LLAMA_MOE_DENSE_WARM) {
        // one sequential buffered sweep, in file order
        std::vector<uint8_t> buf(16u << 20);
        std::vector<int> fds;
        for (const auto & p : mc->sources.paths) {
            fds.push_back(open(p.c_str(), O_RDONLY | O_CLOEXEC));
        }
        for (const auto & it : items) {
            const int fd = fds[it.src.file];
            for (size_t done = 0; fd >= 0 && done < it.src.nbytes; ) {
                const ssize_t n = pread(fd, buf.data(), std::min(buf.size(), it.src.nbytes - done), (off_t) (it.src.offs + done));
                if (n <= 0) {
                    break;
                }
                done += (size_t) n;
            }
        }
        for (int fd : fds) {
            if (fd >= 0) { close(fd); }
        }
    } else {
        // anon: read each dense tensor into anonymous memory and read it from there
        llama_moe_reader reader;
        std::string err;
        if (!reader.open(mc->sources.paths, 4, /*want_direct =*/ true, err)) {
            LLAMA_LOG_ERROR("%s: dense weights: cannot open %s\n", __func__, err.c_str());
            return -1;
        }
        std::vector<llama_moe_read> jobs;
        std::vector<std::pair<void *, size_t>> regions;
        for (const auto & it : items) {
            const size_t n = (ggml_nbytes(it.t) + page - 1) & ~(page - 1);
            void * r = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (r == MAP_FAILED) {
                for (auto & [p, sz] : regions) { munmap(p, sz); }
                LLAMA_LOG_ERROR("%s: dense weights: cannot allocate %.1f MiB for %s\n", __func__, n / mib, ggml_get_name(it.t));
                return -1;
            }
            regions.emplace_back(r, n);
            jobs.push_back({ it.src.file, it.src.offs, it.src.nbytes, r });
        }
        if (!reader.read(jobs, err)) {
            for (auto & [p, sz] : regions) { munmap(p, sz); }
            LLAMA_LOG_ERROR("%s: dense weights: %s\n", __func__, err.c_str());
            return -1;
        }
        for (size_t i = 0; i < items.size(); ++i) {
            // the mapped pages are no longer read: drop them from this mapping (the kernel may reclaim them)
            const uintptr_t a = (uintptr_t) items[i].t->data;
            const uintptr_t p0 = (a + page - 1) & ~(uintptr_t) (page - 1);
            const uintptr_t p1 = (a + ggml_nbytes(items[i].t)) & ~(uintptr_t) (page - 1);
            items[i].t->data = regions[i].first;
            if (p1 > p0) {
                madvise((void *) p0, p1 - p0, MADV_DONTNEED);
            }
        }
        mc->dense.regions = std::move(regions);
        if (!reader.fallback_reason.empty()) {
            LLAMA_LOG_WARN("%s: dense weights: WARNING %s: read buffered instead\n", __func__, reader.fallback_reason.c_str());
        }
    }
    mc->dense.mode = mode;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    LLAMA_LOG("%s: dense %s: %.1f MiB in %.2f s (%zu tensors%s)\n", __func__,
            mode == LLAMA_MOE_DENSE_WARM ? "warm-up" : "weights into anonymous memory", total / mib, s, items.size(),
            mode == LLAMA_MOE_DENSE_ANON ? ", O_DIRECT where the file system allows it" : ", buffered");
    return (int32_t) (total / mib);
#endif
}
