#pragma once

// pybmoe: the VRAM tier, a device-resident cache of host-resident experts.
//
// Holds: per cached layer, the companion tensors (slots, id->slot tables, the observed routing, bias
// copies) next to the tier's residency, and the per-step protocol that drives them (account,
// settle, publish, schedule), the stats and the resize.
// Must not hold: sizing and allocation (llama-moe-vram-init.cpp), graph building
// (llama-moe-graph.cpp), file reads (llama-moe-source.h) or the policy itself
// (llama-moe-residency.h).
//
// How a cached layer is computed: for every host-resident MoE layer (experts on the CPU, router on
// a device) the model owns companion tensors in the router's buffer type:
//   up/gate/down slots  [ne0, ne1, n_phys + 1]    n_phys = slots + staging; the last is all zeros
//   dev_table           I32 [1, n_expert]         expert id -> slot (n_phys when not resident)
// and, in a host buffer, the same table (src[3] of the host MUL_MAT_ID) plus the routing that the
// last graph observed. A layer is computed twice, exactly split: the host chain skips resident
// experts (their rows are zero), the device chain runs on the slots (misses hit the zero slot),
// and the two down outputs are summed before the routing weights are applied.
//
// The tier's state changes only in llama_moe_cache_after_ubatch(), right after a ubatch's graph, with
// no graph in flight. The misses of step t are known then; their uploads go to free (staging) slots
// while step t+1 runs, and become resident after step t+1 (so for step t+2), evicting the least
// recently used resident. A graph never reads a slot being written, residents keep serving while
// uploads are in flight, and the hit/miss sequence is a deterministic function of the routing.

#include "llama-moe-base.h"
#include "llama-moe-links.h"
#include "llama-moe-residency.h"
#include "llama-moe-source.h"

#include "ggml-cpp.h"

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

struct ggml_tensor;
struct llama_layer;
struct llama_moe_cache_stats;
struct llama_moe_cache_device_stats;


// the per-expert biases of a cached layer (add_id with the original ids): up, gate or fused gate_up,
// which the device chain adds before the down projection, and down, which build_moe_ffn adds once after
// the two chains are summed (llama_moe_cache_bias); a device copy of each keeps that work on the device
int llama_moe_bias_list(const llama_layer & layer, const ggml_tensor * out[LLAMA_MOE_N_BIAS]);

struct llama_moe_vram_layer {
    int32_t il       = -1; // model layer
    int32_t ir       = -1; // index into llama_moe_vram::res.layers
    int32_t n_expert = 0;
    int32_t n_used   = 0;
    int32_t n_phys   = 0;  // slots + staging; slot n_phys is the all-zero dummy slot

    const llama_moe_log * log = nullptr; // the owner's, for graph-time lines

    // the host tensors this layer caches (key for graph building), see llama_moe_proj_list
    int n_proj = 0;
    const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
    llama_moe_source    src [LLAMA_MOE_N_PROJ] = {};
    size_t              expert_nbytes[LLAMA_MOE_N_PROJ] = {}; // one expert's slice of each tensor

    // companions: device (router's buffer type) and host
    ggml_tensor * slots[LLAMA_MOE_N_PROJ] = {};          // [ne0, ne1, n_phys + 1]
    int n_bias = 0;                                       // llama_moe_bias_list
    const ggml_tensor * bias_host[LLAMA_MOE_N_BIAS] = {}; // the model's expert biases
    ggml_tensor       * bias_dev [LLAMA_MOE_N_BIAS] = {}; // their copies next to the slots
    ggml_tensor * dev_table  = nullptr;                   // I32 [1, n_expert], a view of its device's table
    int32_t       tb         = -1;                        // index into llama_moe_vram::tables
    size_t        tb_offs    = 0;                         // its first element in that table
    ggml_tensor * host_table = nullptr;                   // I32 [n_expert]
    ggml_tensor * observed   = nullptr;                   // I32 [n_used * max_batch], -1 = not written

    size_t expert_bytes() const {
        return expert_nbytes[0] + expert_nbytes[1] + expert_nbytes[2];
    }
};

struct llama_moe_vram : llama_moe_device_residents {
    int32_t n_slots = 0; // slots per layer chosen at load (the most over the devices)

    std::vector<llama_moe_vram_layer> layers;
    std::vector<int32_t> layer_of_il; // model layer -> index into layers, -1 when not cached

    llama_moe_residency res;          // res.layers[l.ir] is the bookkeeping of layers[i]

    ggml_context_ptr         host_ctx;
    ggml_backend_buffer_ptr  host_buf;
    uint64_t alloc_bytes = 0;

    struct device_use {
        std::string name;     // buffer type, e.g. CUDA0, RPC0[host:port]
        int64_t     slots;    // resident slots allocated at load over the layers on it (the pool: its banks')
        size_t      bytes;    // companion bytes allocated there
        size_t      first;    // its first layer in `layers` (its layers are contiguous)
        size_t      n_layers;
        int32_t     n_banks;  // the pool's banks on it (0: slots per layer)
    };
    std::vector<device_use> devices;

    // one id->slot table per device for all its layers, published with one copy per step
    struct device_table {
        ggml_tensor *        t = nullptr; // I32 [n_expert * layers on the device]
        std::vector<int32_t> host;        // what the device holds once published
        bool                 dirty = true;
    };
    std::vector<device_table> tables;

    bool sync = false; // deterministic visibility (llama_model_moe_cache_set_sync)

    // per cached layer: a graph of a served ubatch size sent it through the cache (set at graph build, by
    // llama_moe_cache_graph_layer). Checked once, after the first served ubatch: a cached layer whose
    // decode graph never calls build_moe_ffn with its experts (an architecture that loads expert
    // tensors but computes a dense FFN) gets one WARN, since its slots would never serve.
    mutable std::unique_ptr<std::atomic<bool>[]> routed;
    bool routed_checked = false;

    // the WARN lines above, once; arch: the model's architecture name
    void check_routed(const char * arch);

    // the prefill warm-up (llama_model_moe_cache_set_warmup): per cached layer, how often each expert
    // was selected by batches the cache did not serve, counted by a graph op (graph_count)
    int32_t warmup = 0;
    std::vector<std::vector<uint32_t>> prefill_counts; // [layers][n_expert]
    bool     prefill_seen   = false;                   // counts to act on after this step
    uint64_t warmup_uploads = 0;
    struct count_op {
        llama_moe_vram * vram;
        int32_t          li;
    };
    std::vector<count_op> count_ops; // the ops' user data, one per layer

    // the op that counts `selected` (I32 [n_used, n_tokens]) for layer index li when warm-up is on
    void graph_count(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * selected, int32_t li) const;

    uint64_t uploads        = 0;
    uint64_t upload_bytes   = 0;
    uint64_t upload_wait_us = 0;
    uint64_t n_waits        = 0;
    uint64_t n_h2d_tables   = 0; // table publishes (the uploader counts its own calls)
    uint64_t n_syncs        = 0; // scheduler synchronizes before a publish (none when no table changes)

    // a table changed since the last publish
    bool dirty() const;

    std::vector<uint64_t> tickets; // per res.moving entry: done once uploader.done() reaches it

    llama_moe_uploader uploader;

    bool enabled() const {
        return n_slots > 0 && !layers.empty();
    }

    // the cached layer of model layer il, or nullptr
    const llama_moe_vram_layer * layer(int il) const;

    // the index in `layers` of residency layer ir, or -1
    int32_t layer_of_ir(int32_t ir) const;

    // llama_moe_device_residents (llama-moe-links.h): layer il's host copy of its id -> slot table
    llama_moe_device_slots device_slots(int32_t il) const override;

    // the RAM copies of streamed experts (wired by the owner; nullptr: none): uploads read them, and
    // unpin each when its copy is done
    llama_moe_ram_copies * ram = nullptr;

    // turns the tier off after a failed start-up
    void disable();

    // after a ubatch's graph, with no graph in flight: account its routing (the observed tensors)
    void account();

    // uploads that are done become resident: in sync mode every upload started after the previous
    // ubatch (waiting for them), else only those whose bytes have arrived; `all` waits for every one
    // (a resize)
    void settle(bool all = false);

    // the host and device tables follow the residency (both copies change together)
    void publish();

    // this step's misses: uploads into free slots, copied while the next graph runs, from the best
    // source: a RAM copy (`ram`, when its layer is streamed and the expert is resident there), the
    // host tensor's memory when it holds the GGUF layout (mmap, a CPU or pinned host buffer), else
    // the file; runs of adjacent experts into adjacent slots are one copy
    void schedule();

    void get_stats(llama_moe_cache_stats & out) const;

    // device i's share: its slots (or pool), residents, hits and misses (llama_model_moe_cache_get_device_stats)
    void get_device_stats(size_t i, llama_moe_cache_device_stats & out) const;

    // the teardown line: "moe-cache: <hit>% hit, resident <X> MiB, uploads <n> (<Y> MiB), ..."; with the pool
    // it ends with each device's: ", pool <device>: <P> slots, <R> resident, <h>% hit"
    void print_summary() const;
};

struct llama_model;

// llama-moe-vram-sizing.cpp: the MiB of one slot in every layer of `ils` and of their bias copies; and
// the slots per device: fixed (n_slots), auto (free memory minus what the contexts take and floor_mib,
// capped by ceil_mib) or budget_mib > 0 (MiB per device); stage_for(slots) gives the staging slots. A
// device auto leaves at 0 slots is dropped from by_buft; false (logged): a fixed count or a MiB budget
// does not fit a device.
struct llama_moe_tiers;
using llama_moe_vram_by_buft = std::map<ggml_backend_buffer_type_t, std::vector<int>>;

// the device companions built so far: handed to the model once start-up has succeeded, freed with
// the start-up otherwise (a cache that turns itself off keeps no device memory)
using llama_moe_held_buffers = std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>>;

// llama-moe-vram-alloc.cpp: the companions of every device in by_buft (slots_of.at(buft) per layer; pool: the
// layers of one expert shape share a bank in the bytes those slots would take) and the host tables. Sets
// vram.n_slots (the most per layer; the pool: its largest share) and n_slots_min. false (logged): a buffer
// could not be allocated, and the tier is disabled.
bool llama_moe_vram_alloc_devices(llama_model & model, llama_moe_tiers & mc, const llama_moe_vram_by_buft & by_buft,
                                  const std::map<ggml_backend_buffer_type_t, int32_t> & slots_of,
                                  const std::function<int32_t(int32_t)> & stage_for, bool pool, int32_t n_inserts,
                                  std::string & budgets, llama_moe_held_buffers & held, int32_t & n_slots_min);
void llama_moe_vram_layer_mib(const llama_model & model, const std::vector<int> & ils, double & per_slot, double & fixed);
bool llama_moe_vram_size_devices(const llama_model & model, const llama_moe_tiers & mc, llama_moe_vram_by_buft & by_buft,
                                 std::map<ggml_backend_buffer_type_t, int32_t> & slots_of, int32_t n_slots,
                                 int32_t n_expert, bool is_auto, bool estimate, int32_t floor_mib, int32_t ceil_mib,
                                 int32_t budget_mib, const std::function<int32_t(int32_t)> & stage_for);

// llama-moe-vram-init.cpp: selects the layers, sizes the slots (fixed or auto, floor, ceiling),
// allocates the companions and starts the uploader; the C API's init entry points and the --fit
// probe (n_slots == LLAMA_MOE_CACHE_AUTO: auto)
int32_t llama_moe_vram_init(llama_model * model, int32_t n_slots, int32_t n_inserts, int32_t floor_mib, int32_t ceil_mib,
                            int32_t budget_mib);

// called on every load: when this thread asked for --fit accounting of this file
// (llama_moe_cache_fit_request) and the load is a memory estimate, counts the slots in it
void llama_moe_vram_fit_probe(llama_model & model, const std::string & path);
