// pybmoe: the contexts' host KV cache that commits memory as it fills. See llama-moe-kv.h.
//
// Holds: the lazy host buffer type, its buffers' registry, and the page arithmetic of freed cells.

#include "llama-moe-kv.h"

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

namespace {

struct kv_lazy_buffer {
    uint8_t * base = nullptr;
    size_t    size = 0; // the mapping's bytes (whole pages)
};

std::mutex                   g_mutex;    // the registry
std::set<kv_lazy_buffer *>   g_buffers;  // live lazy buffers
uint64_t                     g_released = 0;

size_t page_size() {
    static const size_t ps = (size_t) sysconf(_SC_PAGESIZE);
    return ps;
}

// gives back the whole pages inside [addr, addr + len); returns their bytes
size_t release_interior(uint8_t * addr, size_t len) {
    const size_t ps = page_size();
    const uintptr_t a = ((uintptr_t) addr + ps - 1) & ~(uintptr_t) (ps - 1);
    const uintptr_t b = ((uintptr_t) addr + len) & ~(uintptr_t) (ps - 1);
    if (b <= a) {
        return 0;
    }
    if (madvise((void *) a, b - a, MADV_DONTNEED) != 0) {
        return 0; // the pages stay as they are: still correct, only not given back
    }
    return b - a;
}

void buffer_free(ggml_backend_buffer_t buffer) {
    auto * b = (kv_lazy_buffer *) buffer->context;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_buffers.erase(b);
    }
    munmap(b->base, b->size);
    delete b;
}

void * buffer_get_base(ggml_backend_buffer_t buffer) {
    return ((kv_lazy_buffer *) buffer->context)->base;
}

void buffer_memset_tensor(ggml_backend_buffer_t, ggml_tensor * tensor, uint8_t value, size_t offset, size_t size) {
    memset((uint8_t *) tensor->data + offset, value, size);
}

void buffer_set_tensor(ggml_backend_buffer_t, ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    memcpy((uint8_t *) tensor->data + offset, data, size);
}

void buffer_get_tensor(ggml_backend_buffer_t, const ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    memcpy(data, (const uint8_t *) tensor->data + offset, size);
}

bool buffer_cpy_tensor(ggml_backend_buffer_t, const ggml_tensor * src, ggml_tensor * dst) {
    if (ggml_backend_buffer_is_host(src->buffer)) {
        memcpy(dst->data, src->data, ggml_nbytes(src));
        return true;
    }
    return false;
}

void buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    auto * b = (kv_lazy_buffer *) buffer->context;
    if (value != 0 || madvise(b->base, b->size, MADV_DONTNEED) != 0) {
        memset(b->base, value, buffer->size); // note: a clear to 0 gives the pages back instead of writing them
    }
}

const ggml_backend_buffer_i k_buffer_iface = {
    /* .free_buffer   = */ buffer_free,
    /* .get_base      = */ buffer_get_base,
    /* .init_tensor   = */ nullptr,
    /* .memset_tensor = */ buffer_memset_tensor,
    /* .set_tensor    = */ buffer_set_tensor,
    /* .get_tensor    = */ buffer_get_tensor,
    /* .set_tensor_2d = */ nullptr,
    /* .get_tensor_2d = */ nullptr,
    /* .cpy_tensor    = */ buffer_cpy_tensor,
    /* .clear         = */ buffer_clear,
    /* .reset         = */ nullptr,
};

const char * buft_get_name(ggml_backend_buffer_type_t) {
    return "CPU_KV_LAZY";
}

ggml_backend_buffer_t buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    const size_t ps = page_size();
    const size_t bytes = (size + ps - 1) / ps * ps;
    // MAP_NORESERVE: the capacity is not committed up front (the pages are charged as cells are written)
    void * p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        LLAMA_LOG_ERROR("%s: moe-kv: mmap of %zu bytes failed: %s\n", __func__, bytes, strerror(errno));
        return nullptr;
    }
    auto * b = new kv_lazy_buffer { (uint8_t *) p, bytes };
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_buffers.insert(b);
    }
    return ggml_backend_buffer_init(buft, k_buffer_iface, b, size);
}

size_t buft_get_alignment(ggml_backend_buffer_type_t) {
    return 64; // as the CPU buffer type (TENSOR_ALIGNMENT)
}

bool buft_is_host(ggml_backend_buffer_type_t) {
    return true;
}

} // namespace

static ggml_backend_buffer_type_t llama_moe_kv_lazy_buft() {
    static ggml_backend_buffer_type buft = {
        /* .iface = */ {
            /* .get_name         = */ buft_get_name,
            /* .alloc_buffer     = */ buft_alloc_buffer,
            /* .alloc_buffer_n   = */ nullptr,
            /* .get_alignment    = */ buft_get_alignment,
            /* .get_max_size     = */ nullptr,
            /* .get_alloc_size   = */ nullptr,
            /* .get_alloc_size_n = */ nullptr,
            /* .is_host          = */ buft_is_host,
        },
        /* .device  = */ ggml_backend_buft_get_device(ggml_backend_cpu_buffer_type()),
        /* .context = */ nullptr,
    };
    return &buft;
}

bool llama_moe_kv_is_lazy(ggml_backend_buffer_type_t buft) {
    return buft != nullptr && buft->iface.get_name == buft_get_name;
}

ggml_backend_buffer_type_t llama_moe_kv_buft(const llama_model & model, ggml_backend_buffer_type_t buft) {
    const llama_moe_tiers * mc = model.moe_cache;
    if (mc == nullptr || !mc->stream.on() || !mc->stream.elastic || buft != ggml_backend_cpu_buffer_type()) {
        return buft;
    }
    return llama_moe_kv_lazy_buft();
}

size_t llama_moe_kv_release_cells(ggml_tensor * t, bool transposed, uint32_t c0, uint32_t c1) {
    if (t == nullptr || t->buffer == nullptr || !llama_moe_kv_is_lazy(t->buffer->buft) || c1 <= c0) {
        return 0;
    }
    GGML_ASSERT((int64_t) c1 <= t->ne[1]);
    size_t n = 0;
    uint8_t * data = (uint8_t *) t->data;
    if (!transposed) {
        // a cell is one row of ne[0] values, the cells' rows consecutive
        n += release_interior(data + c0 * t->nb[1], (size_t) (c1 - c0) * t->nb[1]);
    } else {
        // ne[0] rows of ne[1] cells each: the range is one piece per row, and only a piece of a page or more
        // gives anything back
        const size_t row   = ggml_row_size(t->type, t->ne[1]);
        const size_t piece = ggml_row_size(t->type, c1 - c0);
        if (piece >= page_size()) {
            for (int64_t r = 0; r < t->ne[0]; ++r) {
                n += release_interior(data + r * row + ggml_row_size(t->type, c0), piece);
            }
        }
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_released += n;
    return n;
}

// the pages of [base, base + size) this process has written (present and mapped by it alone, as
// /proc/self/pagemap says: a page only read maps the shared zero page, which is not charged and not
// exclusive); false when pagemap cannot be read
static bool count_written(int fd, const uint8_t * base, size_t size, uint64_t & pages) {
    const size_t ps = page_size();
    std::vector<uint64_t> e(1 << 14);
    const uint64_t first = (uintptr_t) base / ps;
    const uint64_t n     = size / ps;
    for (uint64_t i = 0; i < n; i += e.size()) {
        const size_t k = (size_t) std::min<uint64_t>(e.size(), n - i);
        if (pread(fd, e.data(), k * sizeof(uint64_t), (off_t) ((first + i) * sizeof(uint64_t))) != (ssize_t) (k * sizeof(uint64_t))) {
            return false;
        }
        for (size_t j = 0; j < k; ++j) {
            pages += (e[j] >> 63 & 1) && (e[j] >> 56 & 1); // present, exclusively mapped
        }
    }
    return true;
}

llama_moe_kv_usage llama_moe_kv_get_usage() {
    llama_moe_kv_usage u;
    const int fd = open("/proc/self/pagemap", O_RDONLY);
    std::lock_guard<std::mutex> lock(g_mutex);
    u.released = g_released;
    for (const kv_lazy_buffer * b : g_buffers) {
        u.capacity += b->size;
        uint64_t pages = 0;
        u.committed += fd >= 0 && count_written(fd, b->base, b->size, pages) ? pages * page_size() : b->size;
    }
    if (fd >= 0) {
        close(fd);
    }
    return u;
}
