#pragma once

// pybmoe: the hooks that the patch series calls from upstream llama.cpp: model load and teardown,
// context creation and teardown, graph building, and the step around each ubatch's graph.
//   0003  llama.cpp: record_sources; llama-model.cpp: llama_moe_cache_free; llama-context.cpp: active,
//         n_graph_nodes, before_ubatch, after_ubatch, on_context_free; llama-graph.cpp: graph_layer,
//         build_split, bias
//   0008  llama-graph.cpp: llama_moe_route_replay_ids
//   0015  llama-graph.cpp: llama_moe_stream_ids
//   0029  llama-model-loader.cpp: llama_moe_cache_lazy_ranges; llama-context.cpp: on_context_init
// Two ggml hooks the engine sets live in ggml's own headers: the MUL_MAT_ID skip table (0001,
// ggml_mul_mat_id_set_skip) and the CPU MUL_MAT_ID wait (0033, ggml_cpu_set_mul_mat_id_wait, set by
// llama-moe-inflight.cpp). common, llama-bench and the server call llama-moe.h's C API, not these.
//
// Holds: declarations only, with forward-declared types, so that an upstream file that includes it
// sees no pybmoe internals.
// Must not hold: state or logic (the owner is llama-moe-model.h; each concern has its own file), or
// the exported C API (llama-moe.h, included here for the callers' convenience).
//
// When state changes (each tier's header states its own rules):
// - the VRAM tier's tables, slots and residency: only in llama_moe_cache_after_ubatch(), with no graph in
//   flight (llama-moe-vram.h); its warm-up count op writes counters during compute;
// - the stream tier's LRU: inside the graph, in the op before each streamed layer's MUL_MAT_IDs, which
//   admits, evicts and starts the reads the MUL_MAT_IDs then wait for (llama-moe-stream.h);
// - the stream tier's auto budget: when a context is created or freed (on_context_init, on_context_free);
// - the setters (slots, sync, admit window, warm-up, upload budget, stream budget): between generations
//   only; while a graph is computed they return LLAMA_MOE_ERR_BUSY.

#include "llama-moe.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

struct ggml_context;
struct ggml_cgraph;
struct ggml_tensor;

struct llama_model;
struct llama_model_loader;
struct llama_ubatch;

struct llama_moe_tiers;       // the model's owner of everything pybmoe adds (llama-moe-model.h)
struct llama_moe_vram_layer;  // one layer of the VRAM tier (llama-moe-vram.h)
using llama_moe_cache_layer = llama_moe_vram_layer; // its name before: patch 0003 (llama-graph.cpp) still says it

//
// load and teardown
//

// records where each expert tensor's bytes live in the GGUF file(s); called once after load
void llama_moe_cache_record_sources(llama_model & model, const llama_model_loader & ml,
                                    const std::vector<std::string> & paths);

void llama_moe_cache_free(llama_moe_tiers * mc);

// the byte ranges of split file `idx` that the map must not read at load: upstream's lazy ranges `lazy`,
// plus the host-resident expert tensors of that file when llama_moe_stream_hint_lazy_load named this load
// (the stream tier reads them itself)
std::vector<std::pair<size_t, size_t>> llama_moe_cache_lazy_ranges(const llama_model_loader & ml, uint32_t idx,
                                                                   const std::vector<std::pair<size_t, size_t>> & lazy);

// context creation: its host memory (KV cache, compute and output buffers, bytes), which the stream
// tier's auto sets aside
void llama_moe_cache_on_context_init(const llama_model & model, const void * ctx, size_t kv, size_t compute, size_t output);

// context teardown: print the summary line; the stream tier gives the context's memory back to auto
void llama_moe_cache_on_context_free(const llama_model & model, const void * ctx);

//
// graph building
//

// the owner to use for graphs of this model (the cache, the trace and/or route replay), or nullptr
// when all are off
const llama_moe_tiers * llama_moe_cache_active(const llama_model & model);

// extra graph nodes the cache, the trace and route replay add (for graph_max_nodes)
uint32_t llama_moe_cache_n_graph_nodes(const llama_moe_tiers * mc);

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
ggml_tensor * llama_moe_route_replay_ids(const llama_moe_tiers * mc, ggml_context * ctx, ggml_tensor * selected,
                                         int il, int64_t n_ubatch);

// --moe-stream-cache-mb: the ids this layer's MUL_MAT_IDs use: `selected` through the op that reads
// the step's experts from the GGUF into RAM first, or `selected` itself when the layer is not streamed
ggml_tensor * llama_moe_stream_ids(const llama_moe_tiers * mc, ggml_context * ctx, ggml_tensor * selected, int il);

// the cache layer that serves this FFN, or nullptr (the stock graph is built; the reason is logged once);
// also adds the trace node when tracing
const llama_moe_vram_layer * llama_moe_cache_graph_layer(const llama_moe_tiers * mc, const llama_moe_cache_ffn_desc & d);

// Splits one MoE layer between host and device. `out_h` is the host chain's output before the
// routing weights (the down MUL_MAT_ID, with a down scale if the layer has one): every node between
// the FFN input and `out_h` that depends on a MUL_MAT_ID of a cached expert tensor is cloned into a
// device chain over the slots (see llama-moe-graph.cpp), the host MUL_MAT_IDs get the skip table,
// and the result is host + device. Any chain of views, activations, clamps, add_id biases and
// gathered scales is accepted (fused gate_up, gpt-oss biases, gemma4 scales, llama4 weighting); a
// chain it cannot clone (e.g. in-place ops, LoRA) returns `out_h` unchanged with one WARN line.
//   inp      [n_embd, 1, n_tokens]     FFN input (where the walk back stops)
//   selected I32 [n_expert_used, n_tokens]
//   result   [n_embd, n_expert_used, n_tokens]
ggml_tensor * llama_moe_cache_build_split(ggml_context * ctx, ggml_cgraph * gf, const llama_moe_vram_layer * l,
                                          ggml_tensor * inp, ggml_tensor * selected, ggml_tensor * out_h);

// the device copy of a cached layer's expert bias (up, gate, gate_up or down), or `bias` itself when
// `l` is nullptr or has none: build_moe_ffn adds the down bias from it, once, after the split's sum
ggml_tensor * llama_moe_cache_bias(const llama_moe_vram_layer * l, ggml_tensor * bias);

//
// the step around each ubatch's graph
//

typedef struct ggml_backend_sched * ggml_backend_sched_t;

// before_ubatch marks a graph in flight and gives route replay the ubatch's tokens (their sequences; n_seq_max:
// the context's, the streams the trace is cut into); after_ubatch (ubatch nullptr when the graph failed) waits for
// it, accounts its routing (and writes trace rows), publishes the uploads started after the previous
// ubatch and starts new ones. Tables change only there.
void llama_moe_cache_before_ubatch(const llama_model & model, const llama_ubatch & ubatch, uint32_t n_seq_max);
void llama_moe_cache_after_ubatch(const llama_model & model, ggml_backend_sched_t sched, const llama_ubatch * ubatch);
