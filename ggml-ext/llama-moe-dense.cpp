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
#include <sys/stat.h>
#include <unistd.h>
#endif

llama_moe_dense::~llama_moe_dense() {
#if !defined(_WIN32)
    for (auto & [p, n] : regions) {
        munmap(p, n);
    }
#endif
}

// --dense-weights auto: anon when the stream tier is on with a fixed budget and the GGUF is larger than the
// memory available at load (a limit then reclaims page cache, the dense pages with it), unless the budget and
// the dense weights do not fit together (anonymous pages cannot be reclaimed: mmap degrades where anon gets
// the process killed); else mmap. With --moe-stream-cache-mb auto, mmap: auto sizes the budget beside the
// dense weights and leaves its floor, so the mapped dense pages stay cached (a few major faults per run),
// and where memory runs short the kernel can drop a few of them instead of scanning for the little else it
// may reclaim. Measured at auto budgets (docs/benchmarks/dense-policy-2026-12-05/README.md; tg32, cold, interleaved,
// medians): mmap decoded 6-21 % faster than anon at A 3x, A 5x, B 3x (twice) and C 3x, at equal hits and
// bytes read, with less io wait; anon was faster at C 5x (granite), B 5x split. One INFO line gives the
// pick and the figures.
static int32_t llama_moe_dense_pick(const llama_moe_tiers * mc) {
    const double mib = 1024.0 * 1024.0;
    if (mc == nullptr || !mc->stream.on()) {
        LLAMA_LOG_INFO("llama_moe_dense_pick: dense weights: auto -> mmap (the stream tier is off)\n");
        return LLAMA_MOE_DENSE_MMAP;
    }
    const auto & st = mc->stream;
    int64_t file = 0;
#if !defined(_WIN32)
    for (const auto & p : mc->sources.paths) {
        struct stat sb = {};
        if (stat(p.c_str(), &sb) == 0) {
            file += (int64_t) sb.st_size;
        }
    }
#endif
    const int64_t need = st.need_bytes();
    int32_t pick = LLAMA_MOE_DENSE_MMAP;
    std::string why;
    if (st.avail_bytes <= 0) {
        why = "the memory available is not known";
    } else if (file <= st.avail_bytes) {
        why = format("the GGUF (%.0f MiB) fits in the %.0f MiB available: the page cache can keep the dense weights",
                file / mib, st.avail_bytes / mib);
    } else if (st.is_auto) {
        why = format("--moe-stream-cache-mb auto sized the budget beside the %.0f MiB of dense weights and left its floor: "
                "their mapped pages stay cached (the GGUF, %.0f MiB, is larger than the %.0f MiB available)",
                st.dense_bytes / mib, file / mib, st.avail_bytes / mib);
    } else if (need > st.avail_bytes) {
        why = format("the budget and the dense weights need %.0f MiB, more than the %.0f MiB available: "
                "anonymous memory cannot be reclaimed, mapped pages can", need / mib, st.avail_bytes / mib);
    } else {
        pick = LLAMA_MOE_DENSE_ANON;
        why = format("the GGUF (%.0f MiB) is larger than the %.0f MiB available: a memory limit would reclaim mapped dense "
                "pages and every token would read them again; the budget and the %.0f MiB of dense weights fit "
                "beside each other (%.0f MiB)", file / mib, st.avail_bytes / mib, st.dense_bytes / mib, need / mib);
    }
    LLAMA_LOG("llama_moe_dense_pick: dense weights: auto -> %s: %s\n", pick == LLAMA_MOE_DENSE_ANON ? "anon" : "mmap",
            why.c_str());
    return pick;
}

int32_t llama_model_moe_dense_weights(llama_model * model, int32_t mode) {
    if (mode < LLAMA_MOE_DENSE_MMAP || mode > LLAMA_MOE_DENSE_AUTO) {
        LLAMA_LOG_ERROR("%s: dense weights: mode %d; accepted: 0 (mmap), 1 (warm), 2 (anon), 3 (auto)\n", __func__, mode);
        return -1;
    }
    if (mode == LLAMA_MOE_DENSE_MMAP) {
        return 0;
    }
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mode == LLAMA_MOE_DENSE_AUTO) {
        mode = llama_moe_dense_pick(mc);
        if (mode == LLAMA_MOE_DENSE_MMAP) {
            return 0;
        }
    }
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
        // anon: copy each dense tensor into anonymous memory and read it from there. Mapped tensors are copied
        // from the map (their pages are there, or being prefetched: the file is read once), then dropped from
        // the map and from the page cache; tensors already in a CPU buffer are anonymous memory as they are.
        std::vector<std::pair<void *, size_t>> regions;
        std::vector<int> fds;
        for (const auto & p : mc->sources.paths) {
            fds.push_back(open(p.c_str(), O_RDONLY | O_CLOEXEC));
        }
        size_t moved = 0;
        size_t n_moved = 0;
        for (auto & it : items) {
            if (strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(it.t->buffer)), "CPU_Mapped") != 0) {
                continue;
            }
            const size_t nb = ggml_nbytes(it.t);
            const size_t n = (nb + page - 1) & ~(page - 1);
            void * r = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (r == MAP_FAILED) {
                LLAMA_LOG_ERROR("%s: dense weights: cannot allocate %.1f MiB for %s; the tensors moved so far stay in "
                        "anonymous memory, the rest mapped\n", __func__, n / mib, ggml_get_name(it.t));
                break;
            }
            memcpy(r, it.t->data, nb);
            regions.emplace_back(r, n);
            // the mapped pages are no longer read: drop them from this mapping, then from the page cache
            const uintptr_t a = (uintptr_t) it.t->data;
            const uintptr_t p0 = (a + page - 1) & ~(uintptr_t) (page - 1);
            const uintptr_t p1 = (a + nb) & ~(uintptr_t) (page - 1);
            it.t->data = r;
            if (p1 > p0) {
                madvise((void *) p0, p1 - p0, MADV_DONTNEED);
            }
            const int fd = fds[it.src.file];
            if (fd >= 0) {
                posix_fadvise(fd, (off_t) it.src.offs, (off_t) it.src.nbytes, POSIX_FADV_DONTNEED);
            }
            moved += nb;
            n_moved++;
        }
        for (int fd : fds) {
            if (fd >= 0) { close(fd); }
        }
        mc->dense.regions = std::move(regions);
        total = moved;
        items.resize(n_moved);
    }
    mc->dense.mode = mode;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    LLAMA_LOG("%s: dense %s: %.1f MiB in %.2f s (%zu tensors%s)\n", __func__,
            mode == LLAMA_MOE_DENSE_WARM ? "warm-up" : "weights into anonymous memory", total / mib, s, items.size(),
            mode == LLAMA_MOE_DENSE_ANON ? ", copied from the map, which then lets them go" : ", buffered");
    return (int32_t) (total / mib);
#endif
}
