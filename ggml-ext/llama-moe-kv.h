#pragma once

// pybmoe: the contexts' host KV cache under the stream tier commits memory as it fills.
//
// Why: upstream clears a KV buffer at creation, which writes, and so charges to the process and its
// cgroup, every page of the context's whole capacity from its first token. Pages of a fresh anonymous
// mapping are zero already, and a page that is never written is never charged; a page only read maps
// the kernel's shared zero page. So a KV cache in such a mapping costs what its cells have touched.
//
// How: a host buffer type whose buffers are anonymous mappings of their own (zero by construction,
// whatever the heap held before) and whose clear to 0 gives the pages back (madvise MADV_DONTNEED: they
// read as zero again), so upstream's clear at creation writes nothing. Cells freed by a removed
// sequence give their whole pages back (llama_moe_kv_release_cells); the attention's reads of cells
// never written read zeros, as after upstream's clear, so the output is the same bit for bit.
//
// Holds: the buffer type, the registry of its live buffers (what they hold now, measured with
// /proc/self/pagemap) and the page arithmetic of a cell range. Must not hold: any budget rule (the stream tier's
// governor, llama-moe-stream.h) or the KV cache's cell bookkeeping (upstream's llama_kv_cells).

#include <cstddef>
#include <cstdint>

struct ggml_tensor;
struct llama_model;
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;

// the buffer type a context's KV cache of this model allocates in: the lazy host type in place of the
// plain CPU buffer type when the model's stream tier is on and elastic (PYBMOE_MOE_STREAM_ELASTIC=0 keeps
// upstream's), else `buft` itself (device buffers and a model without the tier keep upstream's behaviour)
ggml_backend_buffer_type_t llama_moe_kv_buft(const llama_model & model, ggml_backend_buffer_type_t buft);

// whether `buft` is the lazy host type
bool llama_moe_kv_is_lazy(ggml_backend_buffer_type_t buft);

// cells [c0, c1) of `t` are free: the whole pages inside their bytes go back to the system and read as zero.
// `t` is one stream's K or V view, [n_embd, n_cells]; transposed: a V whose bytes hold n_embd rows of n_cells
// values each (upstream's v_trans), where a range gives back only the pages inside each row's piece. A
// tensor outside a lazy buffer is left alone. Returns the bytes given back.
size_t llama_moe_kv_release_cells(ggml_tensor * t, bool transposed, uint32_t c0, uint32_t c1);

// what the live lazy buffers of every context hold now, bytes (the pages written: /proc/self/pagemap), and
// their size
struct llama_moe_kv_usage {
    uint64_t committed = 0;
    uint64_t capacity  = 0;
    uint64_t released  = 0; // bytes given back by freed cells since the process started
};
llama_moe_kv_usage llama_moe_kv_get_usage();
