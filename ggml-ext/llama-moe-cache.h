#pragma once

// pybmoe: a device-resident LRU cache of MoE experts whose weights live in host memory.
//
// For every host-resident MoE layer (experts on the CPU, router on a device) the model owns
// companion tensors in the router's buffer type:
//   up/gate/down slots  [ne0, ne1, n_phys + 1]    n_phys = slots + staging; the last is all zeros
//   dev_table           I32 [1, n_expert]         expert id -> slot (n_phys when not resident)
// and, in a host buffer, the same table (src[3] of the host MUL_MAT_ID) plus the routing that the
// last graph observed. A layer is computed twice, exactly split: the host chain skips resident
// experts (their rows are zero), the device chain runs on the slots (misses hit the zero slot),
// and the two down outputs are summed before the routing weights are applied.
//
// State changes only in llama_moe_cache_after_ubatch(), right after a ubatch's graph, with no graph
// in flight. The misses of step t are known then; their uploads go to free (staging) slots while
// step t+1 runs, and become resident after step t+1 (so for step t+2), evicting the least
// recently used resident. A graph never reads a slot being written, residents keep serving while
// uploads are in flight, and the hit/miss sequence is a deterministic function of the routing.

#include "llama.h"
#include "ggml-backend.h"

#include <cstdint>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_cgraph;
struct ggml_tensor;
typedef struct ggml_backend_sched * ggml_backend_sched_t;

struct llama_model;
struct llama_moe_cache;
struct llama_moe_cache_layer;

#ifdef __cplusplus
extern "C" {
#endif

// staging C API (not part of the public param structs, so the llama_cpp bindings' ABI is unchanged)

struct llama_moe_cache_stats {
    uint64_t hits;            // expert lookups served by a slot
    uint64_t misses;          // expert lookups computed on the host
    uint64_t uploads;         // experts copied into a slot
    uint64_t upload_bytes;    // bytes copied into slots (up + gate + down)
    uint64_t resident_bytes;  // bytes of experts resident in slots now
    uint64_t alloc_bytes;     // bytes of all companion tensors (slots + zero slot + tables)
    uint64_t n_steps;         // graphs whose routing the cache observed
    int32_t  n_layers;        // cached layers
    int32_t  n_slots;         // slots per cached layer now (llama_model_moe_cache_set_slots changes it)
    int32_t  n_inserts;       // upload cap per layer per step (0 = unlimited)
    int32_t  n_expert;        // experts per layer
    int32_t  n_expert_used;   // top-k
};

#define LLAMA_MOE_CACHE_AUTO               (-1)  // n_slots: size each device from its free memory
#define LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT  1024  // MiB the cache leaves free on each device
#define LLAMA_MOE_CACHE_ERR_NO_ROOM        (-3)  // init: fixed slots do not fit a device (a load error)
#define LLAMA_MOE_CACHE_MAX_BATCH_LIMIT    4096  // the largest ubatch the cache may be asked to serve

// Enables the cache on a loaded model: n_slots slots per host-resident MoE layer, at most
// n_inserts uploads per layer per decode step (0 = unlimited). Call before creating contexts.
// n_slots == 0 is a no-op. n_slots > n_expert is clamped (one INFO line). The slots (+ staging
// + the zero slot) of each device's layers must fit its free memory (ggml_backend_dev_memory)
// minus LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT MiB, else LLAMA_MOE_CACHE_ERR_NO_ROOM.
// Returns the number of cached layers (0 when n_slots == 0 or the model has no MoE layer),
// or a negative value on error (bad value, no host-resident MoE layer, no GGUF source, no room);
// every case where a requested cache does not engage is logged as a WARN or ERROR line, and
// every MoE layer with host experts that is not cached gets a WARN line saying why.
LLAMA_API int32_t llama_model_moe_cache_init(struct llama_model * model, int32_t n_slots, int32_t n_inserts);

// The largest ubatch (tokens) the cache serves, 1 .. LLAMA_MOE_CACHE_MAX_BATCH_LIMIT (default 1: decode
// only). Larger ubatches run the stock graph. Small batches are speculative verify batches
// ((1 + draft max) tokens per sequence) and parallel decoding; each step of up to n_tokens tokens
// is one LRU step, and starts at most top-k uploads, or the insert cap when set (at most top-k x
// n_tokens). Call before init and before
// llama_model_moe_trace_open. Returns n_tokens, or -1 (logged).
LLAMA_API int32_t llama_model_moe_cache_set_max_batch(struct llama_model * model, int32_t n_tokens);

// llama_model_moe_cache_init (n_slots >= 0) or _init_auto (n_slots == LLAMA_MOE_CACHE_AUTO) with an
// explicit floor (MiB left free on each device, also for fixed slots) and ceiling (auto only).
LLAMA_API int32_t llama_model_moe_cache_init_budget(struct llama_model * model, int32_t n_slots, int32_t n_inserts,
                                                    int32_t floor_mib, int32_t ceil_mib);

// Sets aside nbytes of dev's memory ahead of the cache, e.g. the projected KV cache and compute
// buffers of the contexts to come (common measures them with a no_alloc probe). Call before init;
// the slots are sized from free - reserve - floor. Returns false without a GGUF-loaded model or
// once the cache is on.
LLAMA_API bool llama_model_moe_cache_reserve(struct llama_model * model, ggml_backend_dev_t dev, size_t nbytes);

// For --fit: while n_slots > 0, every memory-estimation (no_alloc) load of the model file
// path_model counts n_slots fixed slots per cacheable layer in its memory breakdown, so the fitter
// sees the cache's memory (a draft model's probes, another file, count nothing). Process-wide; set
// it around common_fit_params and clear it after (path_model nullptr). auto is not counted: it
// takes what is left after fitting.
LLAMA_API void llama_moe_cache_fit_request(const char * path_model, int32_t n_slots, int32_t n_inserts);

// Like llama_model_moe_cache_init, with the slots of each device's layers chosen at load from that
// device's free memory (ggml_backend_dev_memory) minus floor_mib, capped by ceil_mib (0 = no cap),
// clamped to [0, n_expert]; slots + staging + the zero slot of every layer must fit. One line per
// device says what was chosen; a device left with 0 slots gets a WARN (its layers are not cached).
// Returns the number of cached layers, or a negative value when nothing could be cached.
LLAMA_API int32_t llama_model_moe_cache_init_auto(struct llama_model * model, int32_t n_inserts,
                                                  int32_t floor_mib, int32_t ceil_mib);

// Sets the slots per layer between generations, from 0 to the slots allocated at load (layers with
// fewer allocated slots keep theirs). Shrinking evicts the least recently used experts at once;
// output is unchanged either way (the split is exact). Returns the new slot count, -1 for a bad
// value or no cache, -2 while a graph is being computed.
LLAMA_API int32_t llama_model_moe_cache_set_slots(struct llama_model * model, int32_t n_slots);

// Totals over all cached layers. Returns false when the model has no cache.
LLAMA_API bool llama_model_moe_cache_get_stats(const struct llama_model * model, struct llama_moe_cache_stats * out);

// Writes the routing of every MoE layer to `path` (CSV, "# pybmoe-trace v1 ..." then
// workload,phase,ubatch,token,layer,rank,expert,hit; hit is 1/0 for lookups the cache served, -1
// otherwise). n_ubatch: the largest ubatch the contexts will run (tokens). Call before creating
// contexts; rows are written by a writer thread, and the file is closed when the model is freed.
// Returns the number of traced layers, or a negative value on error.
LLAMA_API int32_t llama_model_moe_trace_open(struct llama_model * model, const char * path, int32_t n_ubatch);

// Route replay: every MoE layer takes its selected experts from a routing trace (the CSV that
// llama_model_moe_trace_open writes) instead of its router's top-k; the routing weights stay the
// router's own, gathered at the replayed ids. The trace steps token by token, a token being a
// (workload, token) pair in file order; when it runs out it wraps, with a WARN line. The trace's
// layers must be MoE layers of the model, its ranks < top-k and its experts < n_expert.
// n_ubatch: the largest ubatch the contexts will run (tokens). Call before creating contexts.
// Returns the number of replayed layers, or a negative value on error (logged).
LLAMA_API int32_t llama_model_moe_route_replay_open(struct llama_model * model, const char * path, int32_t n_ubatch);

// Per-layer lookups. il is the model layer index. Returns false when layer il is not cached.
LLAMA_API bool llama_model_moe_cache_get_layer_stats(const struct llama_model * model, int32_t il,
                                                     uint64_t * hits, uint64_t * misses);

#ifdef __cplusplus
}
#endif

//
// engine-internal hooks (C++)
//

struct llama_model_loader;
struct llama_ubatch;

// records where each expert tensor's bytes live in the GGUF file(s); called once after load
void llama_moe_cache_record_sources(llama_model & model, const llama_model_loader & ml,
                                    const std::vector<std::string> & paths);

void llama_moe_cache_free(llama_moe_cache * mc);

// the cache to use for graphs of this model (the cache and/or the trace), or nullptr when both are off
const llama_moe_cache * llama_moe_cache_active(const llama_model & model);

// extra graph nodes the cache adds (for graph_max_nodes)
uint32_t llama_moe_cache_n_graph_nodes(const llama_moe_cache * mc);

// what build_moe_ffn is about to build for one layer
struct llama_moe_cache_ffn_desc {
    ggml_context * ctx;
    ggml_cgraph  * gf;
    ggml_tensor  * selected;  // I32 [n_expert_used, n_tokens], the routing (traced when --moe-trace is on)
    int      il;
    int64_t  n_ubatch;        // tokens in the ubatch (the last layer may see fewer: only the outputs)
    const ggml_tensor * up_exps;
    const ggml_tensor * gate_exps;    // nullptr: no gate
    const ggml_tensor * down_exps;
    const ggml_tensor * gate_up_exps; // fused gate_up (then up_exps and gate_exps are nullptr)
    bool     has_lora;
};

// --moe-route-replay: the ids this layer uses instead of `selected` (I32 [n_expert_used, n_rows]);
// `selected` itself when the layer is not replayed. n_ubatch: tokens in the graph's ubatch.
ggml_tensor * llama_moe_route_replay_ids(const llama_moe_cache * mc, ggml_context * ctx, ggml_tensor * selected,
                                         int il, int64_t n_ubatch);

// the cache layer that serves this FFN, or nullptr (the stock graph is built; the reason is logged once);
// also adds the trace node when tracing
const llama_moe_cache_layer * llama_moe_cache_graph_layer(const llama_moe_cache * mc, const llama_moe_cache_ffn_desc & d);

// Splits one MoE layer between host and device. `out_h` is the host chain's output before the
// routing weights (the down MUL_MAT_ID, with a down scale if the layer has one): every node between
// the FFN input and `out_h` that depends on a MUL_MAT_ID of a cached expert tensor is cloned into a
// device chain over the slots (see the comment in the source), the host MUL_MAT_IDs get the skip
// table, and the result is host + device. Any chain of views, activations, clamps, add_id biases and
// gathered scales is accepted (fused gate_up, gpt-oss biases, gemma4 scales, llama4 weighting); a
// chain it cannot clone (e.g. in-place ops, LoRA) returns `out_h` unchanged with one WARN line.
//   inp      [n_embd, 1, n_tokens]     FFN input (where the walk back stops)
//   selected I32 [n_expert_used, n_tokens]
//   result   [n_embd, n_expert_used, n_tokens]
ggml_tensor * llama_moe_cache_build_split(ggml_context * ctx, ggml_cgraph * gf, const llama_moe_cache_layer * l,
                                          ggml_tensor * inp, ggml_tensor * selected, ggml_tensor * out_h);

// the device copy of a cached layer's expert bias (up, gate, gate_up or down), or `bias` itself when
// `l` is nullptr or has none: build_moe_ffn adds the down bias from it, once, after the split's sum
ggml_tensor * llama_moe_cache_bias(const llama_moe_cache_layer * l, ggml_tensor * bias);

// around each ubatch's graph: before_ubatch marks a graph in flight; after_ubatch (ubatch nullptr when
// the graph failed) waits for it, accounts its routing (and writes trace rows), publishes the uploads
// started after the previous ubatch and starts new ones. Tables change only there.
void llama_moe_cache_before_ubatch(const llama_model & model);
void llama_moe_cache_after_ubatch(const llama_model & model, ggml_backend_sched_t sched, const llama_ubatch * ubatch);

// Prometheus text for llama-server's /metrics (empty when the cache is off): hits, misses, uploads,
// upload bytes, resident bytes, slots and bytes per device
std::string llama_moe_cache_prometheus(const llama_model * model);

// context teardown: print the summary line
void llama_moe_cache_on_context_free(const llama_model & model);
