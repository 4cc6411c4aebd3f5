#pragma once

// pybmoe: the exported C API of pybmoe's MoE engine (the expert cache, the routing trace and route
// replay), as the llama_cpp bindings (pybmoe.engine.bindings), pybmoe-logits, common, llama-bench and
// llama-server call it.
//
// Holds: plain stats structs, the tier options (llama_moe_params), limits and the entry points, nothing else.
// Must not hold: engine internals (llama-moe-hooks.h, the per-concern headers) or anything that
// changes llama.h's public param structs, so the llama_cpp bindings' ABI stays as upstream ships it.

#include "llama.h"
#include "ggml-backend.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

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
    int32_t  sync;            // 1: deterministic visibility (--moe-expert-cache-sync), 0: uploads never hold decode back
    uint64_t upload_wait_us;  // time steps waited for uploads (sync mode, a resize)
    uint64_t n_h2d;           // host-to-device calls the cache issued: uploads (merged runs) and table publishes
    uint64_t n_waits;         // blocking waits for uploads
    uint64_t upload_file_bytes; // of upload_bytes, read from the GGUF file; the rest came from memory
    uint64_t upload_busy_us;  // time the uploader spent copying (its GB/s: upload_bytes / this)
    uint64_t n_publish;       // of n_h2d, table publishes (one per device per step that changed a table)
    uint64_t warmup_uploads;  // of uploads scheduled, those the prefill warm-up started
    int32_t  warmup;          // experts per layer the warm-up uploads after a prefill (0 = off)
    uint64_t n_syncs;         // scheduler synchronizes the cache waited on: only before a step that changes a table
    int32_t  n_step_moves;    // the upload budget: uploads per step over all layers (0 = unlimited)
    double   layer_demand_mib; // expert MiB requested per served step by the widest cached layer (the BigMoeOnEdge seed's layer_demand_MiB)
    double   token_demand_mib; // expert MiB requested per served step by all cached layers together (token_demand_MiB)
    int32_t  admit_window;    // --moe-expert-cache-admit second-miss:W (0 = always)
    uint64_t n_bypassed;      // misses not admitted by the second-miss rule
};

// one device that holds slots (a buffer type: CUDA0, RPC0[host:port], ...)
struct llama_moe_cache_device_stats {
    char     name[128];       // the buffer type's name
    int64_t  n_slots;         // resident slots allocated at load over the layers on it (slots/layer x layers, or
                              // the pool's slots: --moe-expert-cache-mb)
    uint64_t alloc_bytes;     // companion bytes allocated there
    int32_t  n_banks;         // the pool's banks there (its layers of one expert shape share one); 0: slots per layer
    int32_t  n_layers;        // cached layers there
    int64_t  n_resident;      // experts resident there now
    int64_t  n_slots_now;     // resident slots now (a resize changes it)
    uint64_t hits;            // lookups of its layers served from its slots
    uint64_t misses;          // lookups of its layers computed on the host
};

// the results every call that can fail shares (a call's own codes, such as LLAMA_MOE_CACHE_ERR_NO_ROOM, are
// named beside it): 0 or a count on success
#define LLAMA_MOE_ERR                      (-1)  // refused or failed; the log line before says why
#define LLAMA_MOE_ERR_BUSY                 (-2)  // a setter called while a graph is computed: call it between generations

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
// n_tokens). Call before init and before llama_model_moe_trace_open. Returns n_tokens, or -1 (logged).
LLAMA_API int32_t llama_model_moe_cache_set_max_batch(struct llama_model * model, int32_t n_tokens);

// llama_model_moe_cache_init (n_slots >= 0) or _init_auto (n_slots == LLAMA_MOE_CACHE_AUTO) with an
// explicit floor (MiB left free on each device, also for fixed slots) and ceiling (auto only).
LLAMA_API int32_t llama_model_moe_cache_init_budget(struct llama_model * model, int32_t n_slots, int32_t n_inserts,
                                                    int32_t floor_mib, int32_t ceil_mib);

// The cache sized in MiB per device (--moe-expert-cache-mb N; upstream's --moe-cache-mib N and
// LLAMA_ARG_MOE_CACHE_MIB are the same option): each device holds the most slots per layer whose
// slots, staging and zero slot fit budget_mib (1 .. INT32_MAX). A budget over the device's free memory
// minus floor_mib (and what llama_model_moe_cache_reserve set aside), or under one slot per layer, is
// LLAMA_MOE_CACHE_ERR_NO_ROOM, with one ERROR line giving the range that fits. Results as
// llama_model_moe_cache_init.
LLAMA_API int32_t llama_model_moe_cache_init_mib(struct llama_model * model, int32_t budget_mib, int32_t n_inserts,
                                                 int32_t floor_mib);

// Sets aside nbytes of dev's memory ahead of the cache, e.g. the projected KV cache and compute
// buffers of the contexts to come (common measures them with a no_alloc probe). Call before init;
// the slots are sized from free - reserve - floor. Returns false without a GGUF-loaded model or
// once the cache is on.
LLAMA_API bool llama_model_moe_cache_reserve(struct llama_model * model, ggml_backend_dev_t dev, size_t nbytes);

// For --fit: while n_slots > 0, every memory-estimation (no_alloc) load of the model file
// path_model made by the calling thread counts n_slots fixed slots per cacheable layer in its memory
// breakdown, so the fitter sees the cache's memory (a draft model's probes, another file, another
// thread, count nothing). Set it around common_fit_params and clear it after (path_model nullptr).
// auto is not counted: it takes what is left after fitting.
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

// Upload visibility. sync = false (the default): an upload becomes visible at the first step after
// its bytes have arrived, and no step waits for one. sync = true (--moe-expert-cache-sync): a miss at
// step s is resident from step s+2, each step waiting for the uploads of the one before, so hits
// and misses are a deterministic function of the routing (pybmoe simulate --policy layer-lru
// replays them exactly). Returns 0, -1 when the cache is off, -2 while a graph is being computed.
LLAMA_API int32_t llama_model_moe_cache_set_sync(struct llama_model * model, bool sync);

// Admission (--moe-expert-cache-admit always|second-miss[:W]). window 0 (the default): every miss is
// uploaded. window W > 0, second-miss: a miss is uploaded only when the expert also missed at one of
// its layer's last W served steps; a first miss is only remembered, so one-off experts stay on the
// host. pybmoe simulate --admit second-miss --admit-window W replays it exactly (sync mode);
// docs/traces.md "Admission" has its measurement. Call before the trace is opened (its header
// records admit=W). Returns W, -1 when the cache is off or W is out of 0 .. LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX,
// -2 while a graph is being computed.
#define LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX 1024
#define LLAMA_MOE_CACHE_ADMIT_WINDOW_DEFAULT 4
LLAMA_API int32_t llama_model_moe_cache_set_admit_window(struct llama_model * model, int32_t window);

// Prefill warm-up (--moe-expert-cache-warmup N): during a batch the cache does not serve (a prefill
// larger than the max batch), each cached layer counts how often each expert is selected; after it,
// the N most used experts of each layer that are not resident are uploaded (at most the staging
// slots per layer per prefill ubatch), so decode does not start cold. 0 turns it off (the default).
// Returns N, -1 when the cache is off or N < 0, -2 while a graph is being computed.
LLAMA_API int32_t llama_model_moe_cache_set_warmup(struct llama_model * model, int32_t n_per_layer);

// The upload budget: at most budget_mib MiB of expert uploads per step over all layers (beside the
// per-layer insert cap), i.e. floor(budget_mib / expert MiB) experts; the layers take turns at going
// first. 0 = unlimited (the default). Returns the experts per step, -1 when the cache is off or the
// budget is negative or under one expert, -2 while a graph is being computed.
LLAMA_API int32_t llama_model_moe_cache_set_upload_budget_mib(struct llama_model * model, int32_t budget_mib);

// Totals over all cached layers. Returns false when the model has no cache.
LLAMA_API bool llama_model_moe_cache_get_stats(const struct llama_model * model, struct llama_moe_cache_stats * out);

// Per-layer lookups. il is the model layer index. Returns false when layer il is not cached.
LLAMA_API bool llama_model_moe_cache_get_layer_stats(const struct llama_model * model, int32_t il,
                                                     uint64_t * hits, uint64_t * misses);

// The devices that hold slots (0 when the cache is off), and device i of them, in the order the
// cache allocated them. get_device_stats returns false for an i out of range.
LLAMA_API int32_t llama_model_moe_cache_n_devices(const struct llama_model * model);
LLAMA_API bool    llama_model_moe_cache_get_device_stats(const struct llama_model * model, int32_t i,
                                                         struct llama_moe_cache_device_stats * out);

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


//
// the stream tier (--moe-stream-cache-mb): experts read from the GGUF into a RAM expert cache
//

struct llama_moe_stream_stats {
    uint64_t hits;            // (layer, expert) lookups found resident in RAM
    uint64_t misses;          // lookups whose expert was read from the file first
    uint64_t read_bytes;      // bytes read into the cache
    uint64_t resident_bytes;  // bytes of experts resident now
    uint64_t budget_bytes;    // the budget now
    uint64_t min_bytes;       // the mechanical minimum: the least budget the tier takes (the most one layer step
                              // needs at the ubatch, or with expert waves top-k beside the waves' window)
    uint64_t total_bytes;     // every streamed expert (a larger budget is clamped to it)
    uint64_t n_tokens;        // tokens the tier served
    uint64_t io_wait_us;      // time the graph waited for reads
    uint64_t major_faults;    // major page faults of the process since the tier started (getrusage)
    int32_t  n_layers;        // streamed layers
    int32_t  direct_io;       // 1: O_DIRECT reads, 0: buffered (the file system refused it)
    uint64_t prefetch_bytes;  // bytes the opt-in prefetch read ahead
    uint64_t prefetch_used;   // of them, bytes a step then used
    // elastic (the default): the contexts' host KV caches commit memory as they fill, and the budget follows the
    // memory at run time (the governor)
    uint64_t kv_committed_bytes; // what the contexts' host KV caches hold now (pages written)
    uint64_t kv_capacity_bytes;  // their whole capacity
    uint64_t kv_released_bytes;  // bytes given back by freed cells since the process started
    uint64_t free_bytes;         // the memory free at the governor's last reading (0: not read yet)
    uint64_t n_yields;           // times the governor shrank the budget
    uint64_t n_grows;            // times it grew it back
    int32_t  elastic;            // 1: elastic, 0: the static plan (PYBMOE_MOE_STREAM_ELASTIC=0)
};

#define LLAMA_MOE_STREAM_AUTO                (-1)   // budget_mib: size from available memory
#define LLAMA_MOE_STREAM_FLOOR_AUTO          (-1)   // floor_mib: 1/16 of the memory limit (cgroup, else MemTotal), 64 .. 1536 MiB
#define LLAMA_MOE_STREAM_FLOOR_MIB_DEFAULT   1536   // the largest auto floor, MiB (the BigMoeOnEdge seed's fixed default)
#define LLAMA_MOE_STREAM_FLOOR_MIN_MIB       64     // the smallest auto floor, and what auto leaves free at the least, MiB
#define LLAMA_MOE_STREAM_IO_THREADS_DEFAULT  4      // read lanes
#define LLAMA_MOE_STREAM_IO_THREADS_MAX      64     // the most read lanes it takes
#define LLAMA_MOE_STREAM_ERR_BUDGET          (-3)   // init: a budget under the mechanical minimum (a load error)

// Turns the stream tier on: the experts of every host-resident MoE layer (all of them on a CPU-only
// run) are no longer read through the memory map; each layer step's experts are read from the GGUF
// into a RAM cache of budget_mib MiB. LLAMA_MOE_STREAM_AUTO sizes it: the memory available
// (MemAvailable, or the cgroup's limit minus its usage less its page cache when smaller; read under
// $PYBMOE_MEM_ROOT when set) minus the dense weights in host memory, the read lanes' bounce buffers
// and floor_mib (LLAMA_MOE_STREAM_FLOOR_AUTO: 1/16 of the limit, 64 .. 1536 MiB), capped by ceil_mib
// when > 0; then each context's host memory (KV cache, compute and output buffers) is set aside when
// the context is created, and given back when it is freed. A floor that leaves less than the
// minimum shrinks (WARN) as long as 64 MiB stay free. The budget must hold the largest set one layer
// step can need with ubatches of n_ubatch tokens (min(n_expert, top-k x n_ubatch) experts of the
// widest layer), else LLAMA_MOE_STREAM_ERR_BUDGET with the arithmetic in one line; a budget above
// every expert's bytes is clamped (INFO), and a fixed budget that does not fit beside the process's
// other memory gets one WARN. io_threads read lanes (1 .. 64). Call after load, before creating
// contexts. Returns the streamed layers (0: inert, with an INFO line, on a model without MoE
// layers), or a negative value (logged) on error.
LLAMA_API int32_t llama_model_moe_stream_init(struct llama_model * model, int32_t budget_mib, int32_t floor_mib,
                                              int32_t ceil_mib, int32_t io_threads, int32_t n_ubatch);

// The contexts and the budget fitted together, before any context is created (common calls it after
// llama_model_moe_stream_init; upstream's --fit does the same for device memory). `measure` returns the
// host memory (bytes: KV cache, compute and output buffers) of every context the run will create (the
// main one, a draft or MTP one) at a context of n_ctx tokens in all over n_seq slots, or < 0 when it
// cannot tell. *n_ctx: the context asked, tokens in all (0: the model's n_ctx_train per slot when not
// unified, in all when unified); *n_seq: its slots; unified: one KV pool that every slot draws from
// (else each slot holds n_ctx / n_seq tokens). user_sized: the user sized the context (-c, or --fit
// off): it is never shrunk. A default context that leaves the budget under its target (the larger of
// the cache cycle plus LLAMA_MOE_FIT_MARGIN_PCT % and LLAMA_MOE_FIT_KEEP_PCT % of the budget beside
// its least context) shrinks: fewer slots first (when not unified), then shorter ones, never under
// n_ctx_min tokens in all; on LLAMA_MOE_FIT_SHRUNK *n_ctx and *n_seq are the context to create.
// One the user sized runs as asked, with the cycle WARN when the budget falls under the cycle. A fixed
// budget that does not fit beside the contexts is clamped to the largest that leaves the floor (a WARN).
// One line states the arithmetic. Returns LLAMA_MOE_FIT_* (below); LLAMA_MOE_FIT_ERR_REFUSED (one
// ERROR line with the numbers) when even that context leaves the experts under the tier's mechanical
// minimum: create no context then.
#define LLAMA_MOE_FIT_NONE         0    // the tier is off, or the contexts could not be measured: nothing changed
#define LLAMA_MOE_FIT_KEPT         1    // the context as asked, the budget at or above the cycle plus the margin
#define LLAMA_MOE_FIT_SHRUNK       2    // a default context was shrunk (*n_ctx, *n_seq set)
#define LLAMA_MOE_FIT_UNDER_CYCLE  3    // runs as asked with the budget under the cycle plus the margin
#define LLAMA_MOE_FIT_ERR_REFUSED  (-3) // the context cannot fit beside the dense weights and the tier's minimum
#define LLAMA_MOE_FIT_MARGIN_PCT   10   // a default context leaves the budget the cache cycle plus this, %
#define LLAMA_MOE_FIT_KEEP_PCT     100  // and this share of what the least context would leave, %
#define LLAMA_MOE_FIT_CTX_MIN      4096 // the least context a shrink leaves, tokens in all (upstream --fit's -fitc default)
typedef int64_t (*llama_moe_fit_measure_cb)(uint32_t n_ctx, uint32_t n_seq, void * user_data);
LLAMA_API int32_t llama_model_moe_stream_fit(struct llama_model * model, uint32_t * n_ctx, uint32_t * n_seq, bool unified,
                                             bool user_sized, uint32_t n_ctx_min, llama_moe_fit_measure_cb measure,
                                             void * user_data);

// Sets the budget between generations (MiB, from the mechanical minimum up; above every expert's
// bytes it is clamped). A shrink evicts the least recently used experts at once. Returns the new
// budget in MiB, -1 for a bad value or no tier, -2 while a graph is being computed.
LLAMA_API int32_t llama_model_moe_stream_set_budget_mib(struct llama_model * model, int32_t budget_mib);

// Returns false when the tier is off.
LLAMA_API bool llama_model_moe_stream_get_stats(const struct llama_model * model, struct llama_moe_stream_stats * out);

#define LLAMA_MOE_DENSE_MMAP 0 // the dense weights stay memory-mapped (stock)
#define LLAMA_MOE_DENSE_WARM 1 // one sequential buffered read of the dense weights at load (page cache warm)
#define LLAMA_MOE_DENSE_ANON 2 // the dense weights read with O_DIRECT into anonymous memory (not page cache)
#define LLAMA_MOE_DENSE_AUTO 3 // anon when the GGUF does not fit in the memory available beside the stream tier, else mmap

// The policy for the non-expert weights in host memory (--dense-weights; the BigMoeOnEdge seed's):
// mmap changes nothing; warm reads them once, sequentially and buffered, and logs "dense warm-up:
// X MiB in Y s"; anon copies them into anonymous memory (from the map when their pages are there,
// else with O_DIRECT) and rebinds the tensors there, so a memory limit reclaims page cache before
// them; auto picks anon when the stream tier is on and the GGUF is larger than the memory available
// at load (the page cache cannot hold it all, so a limit would reclaim dense pages too), unless the
// budget and the dense weights do not fit together (anonymous pages cannot be reclaimed: mmap then
// degrades where anon would get the process killed); else mmap. One INFO line gives the pick and
// the figures. Tensors in a
// repacked buffer are left as they are. Call after llama_model_moe_stream_init (its sizing already
// leaves room for them). Returns the MiB handled (0 for mmap), or -1 (logged) on error.
LLAMA_API int32_t llama_model_moe_dense_weights(struct llama_model * model, int32_t mode);

// The next model loaded from `path` on this thread will run the stream tier: its host-resident expert
// tensors are mapped without being read at load (no MAP_POPULATE over them; the rest of the file is
// prefetched as before), since the tier reads them itself. Call right before llama_model_load_from_file;
// the load consumes it (nullptr clears it). A run whose tier then does not engage faults those pages in
// on demand, as an unpopulated map does.
LLAMA_API void llama_moe_stream_hint_lazy_load(const char * path);

// Per-layer lookups of the stream tier. Returns false when layer il is not streamed.
LLAMA_API bool llama_model_moe_stream_get_layer_stats(const struct llama_model * model, int32_t il,
                                                      uint64_t * hits, uint64_t * misses);

//
// the one apply entry: the after-load sequence of every tier, in its order, for every caller
// (common: llama-server and llama-cli; llama-bench; pybmoe.Llama)
//

// Every tier option as a plain value. The callers parse their flags and env twins into it; the
// engine reads no option from elsewhere. llama_moe_default_params() has every tier off.
struct llama_moe_params {
    // the VRAM tier (--moe-expert-cache and its companions)
    int32_t cache_slots;        // slots per host-resident MoE layer: 0 = off, or LLAMA_MOE_CACHE_AUTO
    int32_t cache_mib;          // or MiB per device (--moe-expert-cache-mb, --moe-cache-mib): 0 = sized by cache_slots
    int32_t cache_inserts;      // uploads per layer per decode step (0 = unlimited)
    int32_t cache_floor_mib;    // MiB left free on each device (default LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT)
    int32_t cache_ceil_mib;     // auto: the most MiB per device (0 = no cap)
    int32_t cache_max_batch;    // the largest ubatch the cache serves, tokens (0 = the engine's default, 1)
    int32_t cache_admit_window; // second-miss window, steps (0 = every miss is uploaded)
    int32_t cache_warmup;       // experts per layer uploaded after a prefill the cache did not serve (0 = off)
    int32_t cache_upload_mib;   // MiB of uploads per step over all layers (0 = unlimited)
    bool    cache_sync;         // deterministic upload visibility (--moe-expert-cache-sync)
    // the disk tier (--moe-stream-cache-mb and its companions) and the dense weights
    int32_t stream_mib;         // the RAM budget, MiB: 0 = off, or LLAMA_MOE_STREAM_AUTO
    int32_t stream_floor_mib;   // auto: MiB left free (default LLAMA_MOE_STREAM_FLOOR_AUTO)
    int32_t stream_ceil_mib;    // auto: the most MiB it takes (0 = no cap)
    int32_t stream_io_threads;  // read lanes, 1 .. LLAMA_MOE_STREAM_IO_THREADS_MAX
    int32_t dense_weights;      // LLAMA_MOE_DENSE_* (AUTO, the default, picks only with the stream tier asked for)
    // the routing trace and route replay (nullptr: none)
    const char * trace_path;
    const char * route_replay_path;
    int32_t n_ubatch;           // the largest ubatch the contexts will run, tokens (the stream tier, trace, replay)
    bool    strict;             // a tier asked for that does not engage is an error (the bindings), not a WARN
    // the contexts and the stream tier's budget fitted together (llama_model_moe_stream_fit), when
    // fit_measure is set and the stream tier is on; common passes its no_alloc probe
    llama_moe_fit_measure_cb fit_measure;
    void *   fit_user_data;
    uint32_t fit_n_ctx;         // the context asked, tokens in all (0: n_ctx_train)
    uint32_t fit_n_seq;         // its slots
    uint32_t fit_n_ctx_min;     // the least context a shrink leaves, tokens in all
    bool     fit_unified;       // one KV pool for every slot
    bool     fit_user_sized;    // -c given (or --fit off): never shrunk
};

// What llama_model_moe_apply did. cache, stream: the tier's init result (> 0: the layers it took;
// 0: inert, the model has no MoE layer it can take; < 0: asked for and off; 0 when not asked for).
// fit: LLAMA_MOE_FIT_*. n_ctx, n_seq: the context to create (the fitted one, else as asked).
struct llama_moe_apply_report {
    int32_t  cache;
    int32_t  stream;
    int32_t  fit;
    uint32_t n_ctx;
    uint32_t n_seq;
};

// llama_model_moe_apply's result: OK, or which step refused (its ERROR line, naming the flag, is logged)
enum llama_moe_apply_status {
    LLAMA_MOE_APPLY_OK                 =   0,
    LLAMA_MOE_APPLY_ERR_PARAMS         =  -1, // no model, no params, or both cache_slots and cache_mib
    LLAMA_MOE_APPLY_ERR_CACHE_MAX_BATCH = -2, // cache_max_batch out of 1 .. LLAMA_MOE_CACHE_MAX_BATCH_LIMIT
    LLAMA_MOE_APPLY_ERR_CACHE_NO_ROOM  =  -3, // fixed slots do not fit a device
    LLAMA_MOE_APPLY_ERR_CACHE_OFF      =  -4, // strict: the cache asked for did not engage
    LLAMA_MOE_APPLY_ERR_CACHE_ADMIT    =  -5, // the admission window was refused
    LLAMA_MOE_APPLY_ERR_CACHE_UPLOAD   =  -6, // the upload budget is under one expert
    LLAMA_MOE_APPLY_ERR_STREAM_BUDGET  =  -7, // the budget cannot hold one layer step
    LLAMA_MOE_APPLY_ERR_STREAM_OFF     =  -8, // strict: the stream tier asked for did not engage
    LLAMA_MOE_APPLY_ERR_FIT_REFUSED    =  -9, // the context and the budget do not fit together
    LLAMA_MOE_APPLY_ERR_DENSE          = -10, // the dense weights' policy could not be applied
    LLAMA_MOE_APPLY_ERR_TRACE          = -11, // the routing trace cannot be written
    LLAMA_MOE_APPLY_ERR_REPLAY         = -12, // the routing trace to replay was refused
};

LLAMA_API struct llama_moe_params llama_moe_default_params(void);

// The after-load sequence, once for every caller: the expert cache (max batch, slots, sync,
// admission, warm-up, upload budget), the stream tier, the fit, the dense weights' policy, the
// routing trace and route replay, in that order (each step sizes for the ones before it). Call
// after llama_model_load_from_file and before any context; a caller that measures its contexts'
// device memory calls llama_model_moe_cache_reserve first. A tier asked for that does not engage
// logs a WARN naming its flag (an error under strict). report may be nullptr. Returns
// LLAMA_MOE_APPLY_OK or an LLAMA_MOE_APPLY_ERR_*; on an error, free the model.
LLAMA_API int32_t llama_model_moe_apply(struct llama_model * model, const struct llama_moe_params * params,
                                        struct llama_moe_apply_report * report);

#ifdef __cplusplus
}
#endif
