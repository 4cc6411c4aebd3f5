#pragma once

// pybmoe: the stream tier (--moe-stream-cache-mb): the experts of every host-resident MoE layer are
// not read from the memory map; each layer step's experts are read from the GGUF (O_DIRECT, on read
// lanes) into a RAM expert cache of a budget in MiB, before that layer's host MUL_MAT_ID runs. The
// kernel reads the same bytes at the same offsets, so the output is bit-identical to a run with
// every expert in RAM.
//
// Holds: per streamed layer, the anonymous reservations its expert tensors are rebound to; the
// graph op that admits a layer step's experts (llama_moe_lru) and reads the misses; the budget,
// its sizing (auto, floor, ceiling, the mechanical minimum), the cliff guard, stats and resize.
// Must not hold: the policy's rules (llama-moe-residency.h), file I/O mechanics
// (llama-moe-source.h) or the VRAM tier: with both on, the experts resident on a device are computed
// there and not streamed, which this tier learns through `devices` (llama-moe-links.h), and the VRAM
// tier's uploads read this tier's RAM copies through the llama_moe_ram_copies it implements.

#include "llama-moe-frames.h"
#include "llama-moe-inflight.h"
#include "llama-moe-links.h"
#include "llama-moe-overlap.h"
#include "llama-moe-residency.h"
#include "llama-moe-source.h"
#include "llama-moe-waves.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_model;
struct llama_moe_stream_stats;

struct llama_moe_stream;

struct llama_moe_stream_layer {
    int32_t il = -1;  // model layer
    int32_t li = -1;  // index into llama_moe_stream::layers (and the LRU's layers)
    int n_proj = 0;
    ggml_tensor *    exps[LLAMA_MOE_N_PROJ] = {};
    llama_moe_source src [LLAMA_MOE_N_PROJ] = {};
    size_t           expert_nbytes[LLAMA_MOE_N_PROJ] = {};
    void *           region[LLAMA_MOE_N_PROJ] = {};      // anonymous reservation the tensor is rebound to
    size_t           region_bytes[LLAMA_MOE_N_PROJ] = {};
    // where the tensor's bytes start in the reservation: region + (file offset mod 4096), so that an expert's
    // address and its file offset share their alignment and an O_DIRECT read of the aligned window around
    // it lands in place (the window's extra bytes are its neighbours' own bytes, or the reservation's slack)
    uint8_t *        base[LLAMA_MOE_N_PROJ] = {};

    std::vector<int8_t> hits_now; // per lookup of the last step: 1 hit, 0 miss, -1 computed on a device
    uint64_t hits   = 0;
    uint64_t misses = 0;

    // the graph op's user data (whether the VRAM tier serves the step is the node's own flag:
    // llama_moe_stream_mark_vram_served)
    struct op_data {
        llama_moe_stream * tier;
        int32_t            li;
    } op;

    size_t entry_bytes() const {
        return expert_nbytes[0] + expert_nbytes[1] + expert_nbytes[2];
    }
};

struct llama_moe_stream : llama_moe_ram_copies {
    std::vector<llama_moe_stream_layer> layers;

    // the VRAM tier's residents (wired by the owner; nullptr: none), for the steps it serves
    const llama_moe_device_residents * devices = nullptr;
    std::vector<int32_t> layer_of_il; // model layer -> index into layers, -1 when not streamed

    // model layer il's index into layers, or -1 when il is not streamed (or out of range)
    int32_t index_of(int il) const {
        return il >= 0 && il < (int) layer_of_il.size() ? layer_of_il[il] : -1;
    }

    llama_moe_lru    lru;
    llama_moe_reader reader;

    size_t  entry_bytes   = 0; // the largest layer's (layer, expert) entry: all its projections
    int64_t budget_bytes  = 0;
    int64_t min_bytes     = 0; // the largest set one layer step can need at the configured ubatch: at or above
                               // it every step fits, and no step runs in waves

    // Expert waves (llama-moe-waves.h): a budget under min_bytes is taken down to least_bytes(); a step that
    // needs more experts than the LRU holds reads the rest while the layer computes, wave_entries experts per
    // projection ahead of its slowest thread. Those entries' memory comes out of such a budget: the LRU holds
    // budget / entry - wave_entries entries (lru_entries). Needs patch 0033's hook (waves_on); without it the
    // least budget is min_bytes, as before
    llama_moe_waves waves;
    bool    waves_on      = false;
    int64_t wave_entries  = 0;
    int32_t n_used        = 0; // top-k

    // the least budget the tier takes, bytes: one token's top-k experts beside the waves' window, or the
    // largest step without waves
    int64_t least_bytes() const {
        return waves_on ? std::min<int64_t>(min_bytes, ((int64_t) n_used + wave_entries) * (int64_t) entry_bytes) : min_bytes;
    }

    // the LRU's entries at a budget of `bytes`
    int64_t lru_entries(int64_t bytes) const {
        const int64_t n = bytes / (int64_t) entry_bytes;
        return waves_on && bytes < min_bytes ? std::max<int64_t>(n - wave_entries, 0) : n;
    }
    int64_t total_bytes   = 0; // every streamed expert
    int32_t n_ubatch      = 0;

    // sizing facts from init, bytes: what auto sized from, and what a fixed budget is checked against
    bool    is_auto      = false;
    int64_t auto_room_entries = 0; // auto: the entries the memory held at init, before the contexts and the caps
    int64_t auto_cap_entries  = 0; // auto: the most entries it takes (the ceiling, every streamed expert)
    int64_t avail_bytes  = 0; // llama_moe_mem_avail::avail() at init
    int64_t limit_bytes  = 0; // the cgroup's limit, else MemTotal
    int64_t dense_bytes  = 0; // the dense weights in host memory
    int64_t entry_cost   = 0; // an entry's bytes plus the partial pages it can commit
    int64_t floor_bytes  = 0; // what auto leaves free (a fixed budget is clamped to leave it too)
    int64_t cycle_bytes  = 0; // the cache cycle: every streamed layer's top-k experts (the cliff guard's figure)
    int64_t fixed_bytes  = 0; // a fixed budget as asked (a clamp takes budget_bytes under it, never this)
    int64_t fixed_asked  = 0; // what --moe-stream-cache-mb gave, bytes (fixed_bytes is at most every streamed expert)
    int64_t fixed_said   = INT64_MAX; // the fixed budget the last line gave (clamp_fixed's WARN compares with it)
    int64_t fit_ctx_bytes = 0; // the contexts' host memory the fit planned before any was created
    std::map<const void *, int64_t> contexts; // live contexts -> their host memory that counts against the budget:
                                              // KV cache, compute, output; elastic: compute and output only

    // Elastic (the default; PYBMOE_MOE_STREAM_ELASTIC=0: the static plan): the contexts' host KV caches commit
    // memory as they fill (llama-moe-kv.h), so a context costs the budget nothing up front; the governor
    // (llama-moe-governor.h) makes the budget follow the memory at run time, before each ubatch (govern)
    bool elastic = true;
    std::map<const void *, int64_t> context_kv_ubatch;  // live contexts -> the KV bytes of one full ubatch's cells
    int64_t gov_step      = 0;  // the governor's hysteresis, bytes
    int64_t gov_said      = 0;  // the budget its last line gave
    int64_t gov_free      = -1; // the memory free at its last reading, bytes (-1: not read yet)
    int64_t gov_last_us   = 0;
    uint64_t gov_yields   = 0;  // times it shrank the budget, and grew it
    uint64_t gov_grows    = 0;

    // the entries whose memory the tier holds now (resident, or a free page frame still allocated)
    int64_t charged_entries() const {
        return frames[0].on() ? std::max<int64_t>(lru.n_resident, frames[0].n_frames()) : lru.n_resident;
    }

    // the most the budget takes now, bytes: auto's room beside the contexts, or a fixed budget's room (at most
    // what was asked); never under the minimum
    int64_t cap_bytes() const {
        return std::max(is_auto ? auto_room() : fixed_room(contexts_bytes()), least_bytes());
    }

    // the governor's turn (no graph in flight): reads the memory free now and moves the budget by the rule of
    // llama-moe-governor.h; one line when the budget moved by a step or more since the last one, the
    // cycle WARN on each crossing. At most every 2 ms
    void govern();

    int64_t contexts_bytes() const {
        int64_t n = 0;
        for (const auto & [c, b] : contexts) {
            n += b;
        }
        return n;
    }

    // the contexts' host memory: the live ones, or the fit's plan for those to come when that is larger
    int64_t planned_contexts_bytes() const {
        return std::max(contexts_bytes(), fit_ctx_bytes);
    }

    // what the budget and everything beside it need, bytes (the dense policy's check)
    int64_t need_bytes() const {
        return (budget_bytes / (int64_t) entry_bytes + prefetch_entries) * entry_cost + dense_bytes + planned_contexts_bytes();
    }

    // what the budget and the contexts share, bytes: the memory available at init less the dense weights, the
    // prefetch window and the floor (auto: auto_room_entries of entry_cost)
    int64_t shared_room() const;

    // a context was created (its host memory: KV cache, compute and output buffers) or freed. auto sets
    // it aside: the budget shrinks (evicting at once) or grows back, never below the mechanical minimum
    // (a WARN says so); a fixed budget that no longer fits beside the contexts is clamped to the largest
    // that leaves the floor (a WARN with the arithmetic), and grows back toward what was asked as they go.
    // Called with no graph in flight. n_threads: the context's compute threads (the larger of its decode
    // and batch counts), for the overlap's auto rule (below)
    // kv_ubatch: the KV bytes of one full ubatch's cells (the governor keeps that much free beside the floor)
    void on_context(const void * ctx, int64_t host_bytes, int64_t kv, int64_t compute, int64_t output,
                    int64_t kv_ubatch, int32_t n_threads);
    void on_context_free(const void * ctx);

    // auto's budget beside the live contexts, bytes (may be under the minimum)
    int64_t auto_room() const;

    // a fixed budget beside contexts of ctx_bytes: what was asked, or less where that does not fit
    // (shared_room less the contexts, in whole entries; may be under the minimum)
    int64_t fixed_room(int64_t ctx_bytes) const;

    // a fixed budget clamped to fixed_room(ctx_bytes) when it is over it (one WARN with the arithmetic
    // each time the clamp goes down), or grown back toward what was asked
    void clamp_fixed(int64_t ctx_bytes);

    // one WARN whenever the budget crosses under the cache cycle (from `before` to budget_bytes)
    void warn_cycle(int64_t before) const;

    // sets the budget (bytes, clamped to every expert's); a shrink evicts the least recently used at once.
    // Returns the budget set. quiet: no line (the governor says its own)
    int64_t resize(int64_t want, bool quiet = false);

    // counters (the graph op updates them during compute; the getters read them under `mutex`)
    mutable std::mutex mutex;
    uint64_t n_tokens    = 0;  // rows the first streamed layer computed
    uint64_t read_bytes  = 0;  // bytes copied into the cache (the ranges themselves)
    uint64_t io_wait_us  = 0;  // time the graph waited for reads
    long     majflt_at_start = 0;

    std::string error; // the first read error (the op aborts with it)

    // Prefetch (its reads are timing, not policy): after a step that wanted at least half of its layer's
    // experts (a prefill), the lanes read the next streamed layer's non-resident experts into their own
    // places in the reservation while this layer computes, at most prefetch_entries of them. The next step
    // admits exactly what the LRU admits; an admitted expert whose bytes arrived is not read again, and a
    // prefetched one the step did not admit has its pages given back. The window's memory (prefetch_entries
    // entries, counted by auto and by the fit WARN) is lent to decode: lru.lend = prefetch_entries, so a
    // step that wants less than half of its layer holds up to budget + window entries, and one that wants
    // half or more first evicts down to the budget (llama_moe_lru). The simulator replays the same rule
    // (lend_entries); the output is that of every other run. 0 turns both off.
    int64_t              prefetch_entries = 0;
    int32_t              prefetch_li      = -1; // the layer whose reads are in flight, -1: none
    std::vector<uint8_t> prefetched;            // [n_expert] of prefetch_li
    uint64_t             prefetch_bytes   = 0;  // counters: bytes prefetched, and of them those a step used
    uint64_t             prefetch_used    = 0;

    // waits for the prefetch in flight; unless it is for layer `li`, gives its pages back
    void settle_prefetch(int32_t li);

    // The VRAM tier's uploads of entries resident here read this tier's RAM copy instead of the
    // file. An entry is pinned from the upload's schedule (no graph in flight) until the uploader
    // has read it; a step that evicts a pinned entry waits for it before dropping its pages, so the
    // policy, and the bytes, are exactly those of a run without the VRAM tier's reads.
    std::vector<int32_t>    pins; // [n_layer * n_expert] uploads reading the entry (under `mutex`)
    std::condition_variable pin_cv;

    // llama_moe_ram_copies (llama-moe-links.h)
    bool    streams(int32_t il) const override { return on() && index_of(il) >= 0; }
    int32_t pin(int32_t il, int32_t e, const void * mem[LLAMA_MOE_N_PROJ]) override;
    void    unpin(int32_t entry) override;
    // waits (the lock holds `mutex`) until no upload reads any of `entries`
    void    wait_unpinned(std::unique_lock<std::mutex> & lock, const std::vector<int32_t> & entries);

    bool on() const {
        return !layers.empty();
    }

    // the ids layer il's MUL_MAT_IDs use: `selected` through the op that makes its experts resident,
    // or `selected` itself when the layer is not streamed
    ggml_tensor * graph_ids(ggml_context * ctx, ggml_tensor * selected, int il);

    // the op's work for one layer step (ids: I32 [n_used, n_rows], any strides); `vram_served`: the
    // VRAM tier serves this step (its graph has the cache chain), so its residents (`devices`) are not
    // looked up
    void step(int32_t li, const ggml_tensor * ids, bool vram_served);

    // step's parts: this tier's lookups of the step (the experts in router order, and their index among
    // all ids); the admitted experts whose bytes a prefetch brought are counted, the others left in
    // `experts` (sorted), and the prefetched ones not admitted give their pages back; the reads of the
    // next layer's non-resident experts, at most prefetch_entries of them (a prefill step)
    void lookups(int32_t li, const ggml_tensor * ids, bool vram_served, std::vector<int32_t> & want,
                 std::vector<int64_t> & where) const;
    void take_prefetched(int32_t li, const std::vector<int32_t> & admitted, std::vector<int32_t> & experts, size_t & nbytes);
    std::vector<llama_moe_read> prefetch_next(int32_t li);

    // the page frames the resident entries' interior pages live in, one pool per projection
    // (llama-moe-frames.h); off: every entry's pages are the reservation's own, faulted in at a miss
    // and given back at an eviction. The read lanes map an entry's frames just before they read it
    // (read_jobs), the compute thread gives them back (release)
    llama_moe_frames frames[LLAMA_MOE_N_PROJ];

    // entry's interior in projection p: the whole pages inside its bytes (their ends may share a page
    // with a neighbour); len 0 when there is none
    void interior(int32_t entry, int p, uint8_t * & addr, size_t & len) const;

    // drops entries' bytes: their interiors go back to the kernel, or their frames to the free list
    void release(const std::vector<int32_t> & entries);
    // the same for projection p only
    void release_proj(int32_t entry, int p);

    // the waves' callbacks (llama-moe-waves.h): read projection p of layer li's experts (marked in flight
    // already) on the lanes, appended to their batch; drop their pages
    void wave_read(int32_t li, int32_t p, const std::vector<int32_t> & experts);
    void wave_drop(int32_t li, int32_t p, const std::vector<int32_t> & experts);
    // the step in waves is over: drops what it still holds, clears the flags of what it never read
    void finish_waves();

    // the reads of layer li's experts `experts` (sorted) into their places, one per run of consecutive
    // ids cut at ~8 MiB, each mapping its experts' page frames first; adds their bytes to nbytes. track:
    // each range is marked in flight (`inflight`) now, and in place by its lane once read
    // only_p >= 0: that projection only; marked: the ranges are marked in flight already (the waves')
    std::vector<llama_moe_read> read_jobs(const llama_moe_stream_layer & l, const std::vector<int32_t> & experts,
                                          size_t & nbytes, bool track, int only_p = -1, bool marked = false);

    // Reads behind compute (decode steps, those that want less than half of their layer): a step submits
    // its reads and returns; the layer's MUL_MAT_IDs wait for each expert's bytes (patch 0033's hook), so
    // the hits and the misses already read compute while the rest are read. The bytes each expert's rows
    // read, and so the output, are those of a blocking step. Off (by the rule below), a prefill step, or a
    // CPU backend without the hook: the step reads every miss before the layer computes.
    // PYBMOE_MOE_STREAM_OVERLAP unset (or auto): on while every live context's compute threads leave at
    // least one of the process's CPUs to the read lanes (n_cpus: its affinity mask); where they take every
    // CPU, timed: the first decode tokens alternate with and without, and the faster way stays
    // (llama-moe-overlap.h); 1: always on; 0: off. `overlap`: the flags and the hook are set up (1 or auto);
    // `overlap_auto`: the auto rule decides; `overlap_spare`: its answer for the live contexts;
    // `overlap_arm`: the trial's way for the ubatch being computed
    bool               overlap       = false;
    bool               overlap_auto  = false;
    bool               overlap_spare = false;
    int                overlap_said  = -1;    // the auto rule's answer its last line gave (-1: none yet)
    std::atomic<bool>  overlap_arm { false };
    llama_moe_overlap_trial overlap_trial;
    int32_t            n_cpus        = 1;
    std::map<const void *, int32_t> context_threads; // live contexts -> their compute threads
    llama_moe_inflight inflight;

    // whether this step may go behind compute (before the step's own decode/prefill test)
    bool overlap_now() const {
        return overlap && (!overlap_auto || overlap_spare || overlap_arm.load(std::memory_order_relaxed));
    }
    // the first streamed layer's step of a ubatch, at now_us: the trial's way for the ubatch, where it
    // applies (auto, every CPU computing); one line when it decides. Under `mutex`
    void time_overlap(int64_t now_us, bool decode);

    // the auto rule again, after a context came or went; one line when its answer changes
    void update_overlap();

    uint32_t n_graph_nodes() const {
        return (uint32_t) layers.size();
    }

    void get_stats(llama_moe_stream_stats & out) const;

    // "moe-stream: <hit>% hit, resident <X> MiB, misses <n> (read <Y> MiB, <Z> MiB/token), io wait <T> s,
    // major faults <F>, prefetched <P> MiB (<U> MiB of it used), scan steps <S>, wave steps <W>"
    void print_summary() const;

    // gives the reservations back (the tensors must not be read after)
    void unmap();

    ~llama_moe_stream() override {
        unmap();
    }
};

// llama-moe-stream-init.cpp: the C API's init (layer selection, sizing, reservations, preamble)
int32_t llama_moe_stream_init(llama_model * model, int32_t budget_mib, int32_t floor_mib, int32_t ceil_mib,
                              int32_t io_threads, int32_t n_ubatch);

// `ids` (llama_moe_stream::graph_ids' output; any other tensor is left alone) is in a graph whose layer
// the VRAM tier serves: the experts resident in its slots are computed there, so the op neither looks
// them up nor reads them. Called by llama_moe_cache_build_split once the VRAM chain is built, the one
// place that knows; without it (a stock step, a chain that could not be split) the op reads every expert.
void llama_moe_stream_mark_vram_served(ggml_tensor * ids);
