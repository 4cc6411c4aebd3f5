#pragma once

// pybmoe: the residency bookkeeping of the expert tiers: which expert of which layer sits in which
// slot, the policy that admits and evicts, the insert cap, and when an entry becomes visible.
//
// Holds: flat per-layer arrays (in the manner of llama-kv-cells.h) and the step protocol
//   lookup (each served layer step) -> end_ubatch -> settle (moves of the last ubatch become
//   visible) -> schedule (this step's misses become moves into free slots)
// Must not hold: ggml, I/O, threads or logging. The tier that owns it moves the bytes (between
// schedule and settle) and publishes the tables; this file only decides.
//
// Two policies live here:
//   llama_moe_residency  per-layer LRU with an upload lag (the VRAM tier), or one bank of slots shared by
//                        several layers (the pool, below)
//   llama_moe_lru        one LRU over every (layer, expert) entry, no lag (the stream tier)
//
// The per-layer policy (docs/expert-cache.md, "The policy,
// exactly"): a miss at step s is scheduled after step s, its bytes move while step s+1 runs, and it
// is resident from step s+2, evicting argmin (last use, expert id) among the residents that step
// s+1 did not look up (or dropped when every resident was looked up). pybmoe.routing.sim replays
// the same rules ("layer-lru"); tests/routing/test_residency.py holds the two equal, event for
// event, on the bundled granite trace.

#include <cstddef>
#include <cstdint>
#include <vector>

enum llama_moe_slot_state : uint8_t {
    LLAMA_MOE_SLOT_FREE,
    LLAMA_MOE_SLOT_MOVING,   // bytes being written; no table entry points here
    LLAMA_MOE_SLOT_RESIDENT,
};

// an expert on its way into a slot: scheduled after one step, visible after the next
struct llama_moe_move {
    int32_t layer;  // index into llama_moe_residency::layers
    int32_t expert;
    int32_t slot;
};

// staging slots of a layer with n_slots residents: the moves one step can start; top-k unless the
// insert cap (0 = none) asks for more (a step of max_batch tokens misses at most n_used * max_batch
// distinct experts), never more than the experts that are not resident
int32_t llama_moe_stage_slots(int32_t n_expert, int32_t n_used, int32_t n_slots, int32_t n_inserts, int32_t max_batch);

// The pool (docs/expert-cache.md, "The pool"; pybmoe.routing.sim policy "pool"): the layers of a bank share
// its P resident and S staging slots, and one LRU over their (layer, expert) entries decides what it holds,
// with the same lag as per-layer slots (a miss at step s is resident from step s + 2). A settling move into a
// full bank evicts the least (last use, layer, expert) among the residents the last served step did not look
// up (the bank's own last served step), taken from its own layer or from a layer holding more than the floor f = min(top-k, P / n) / 2 entries;
// a layer under its floor may take an over-floor layer's entry even if the last step looked it up; with no
// candidate the move is dropped. A step's misses are scheduled layer by layer, in lookup order, while a
// physical slot is free. The layers' tables hold bank slot numbers, and the bank's n_phys means "not resident".
struct llama_moe_residency_bank {
    int32_t n_slots = 0; // P: resident capacity now (a resize changes it)
    int32_t n_cap   = 0; // the most n_slots can be set to
    int32_t n_stage = 0; // S
    int32_t n_phys  = 0; // n_cap + n_stage
    int32_t n_used  = 0; // top-k, for the floor
    int32_t floor   = 0; // f, entries per layer (follows n_slots)
    int32_t n_resident = 0;
    uint64_t last_step = 0; // the last step that looked any of its layers up (0 = none): what it selected is kept

    std::vector<int32_t> layers;      // indices into llama_moe_residency::layers, in forward order
    std::vector<int32_t> slot_layer;  // [n_phys] -1 when free
    std::vector<int32_t> slot_expert; // [n_phys] -1 when free
    std::vector<uint8_t> slot_state;  // [n_phys] llama_moe_slot_state
};

// the pool's staging slots: the per-layer staging of n layers without an insert cap, summed
// (pybmoe.routing.sim.pool_staging)
int32_t llama_moe_pool_stage_slots(int32_t n_layer, int32_t n_expert, int32_t n_used, int32_t n_slots);

// one layer's slots
struct llama_moe_residency_layer {
    int32_t n_expert = 0;
    int32_t n_slots  = 0; // resident capacity now (a resize changes it)
    int32_t n_cap    = 0; // the most n_slots can be set to
    int32_t n_stage  = 0; // extra slots that moves land in while the residents keep serving
    int32_t n_phys   = 0; // n_cap + n_stage; as a table value it means "not resident"
    int32_t bank     = -1; // index into llama_moe_residency::banks (then the slot_* vectors are the bank's), or -1
    std::vector<uint8_t> moving_e; // [n_expert] 1 while the expert is moving into a slot

    std::vector<int32_t>  table;       // [n_expert] expert -> slot, n_phys when not resident
    std::vector<uint64_t> used;        // [n_expert] the last step the expert was looked up (0 = never)
    std::vector<int32_t>  slot_expert; // [n_phys]   -1 when free
    std::vector<uint8_t>  slot_state;  // [n_phys]   llama_moe_slot_state
    std::vector<int32_t>  misses_now;  // distinct experts missed at the last served step and admitted, in lookup order
    std::vector<uint64_t> last_miss;   // [n_expert] the layer's served step the expert last missed at (0 = never)
    uint64_t n_served   = 0;           // steps that looked this layer up (the admission window counts these)
    std::vector<int8_t>   hits_now;    // per lookup of the last served step: 1 hit, 0 miss
    bool     served_now = false;       // the last ubatch looked this layer up
    uint64_t last_step  = 0;           // the step of hits_now / misses_now
    int32_t  n_resident = 0;           // <= n_slots
    bool     dirty      = false;       // table changed since the owner last published it

    uint64_t hits   = 0;
    uint64_t misses = 0;

    bool is_resident(int32_t e) const;
};

struct llama_moe_residency {
    std::vector<llama_moe_residency_layer> layers;
    std::vector<llama_moe_residency_bank>  banks;

    int32_t  n_inserts = 0;  // moves per layer per step (0 = unlimited)
    // admission (0 = always: every miss is scheduled). W > 0, second-miss: a miss is scheduled only
    // when the expert also missed at one of the layer's last W served steps; a first miss is only
    // remembered (it takes no insert and no staging slot). pybmoe simulate --admit second-miss
    // --admit-window W replays the same rule (docs/traces.md, "Admission").
    int32_t  admit_window = 0;
    uint64_t n_bypassed   = 0; // misses not admitted
    int32_t  n_step_moves = 0; // moves per step over all layers, the upload budget (0 = unlimited); the
                               // layers take it in turn, starting one layer further each step
    uint64_t step      = 1;  // the current step; 0 in `used` means never
    uint64_t n_steps   = 0;  // ubatches with at least one served layer

    std::vector<llama_moe_move> moving; // scheduled after the last ubatch, settled after the next

    // adds a layer of n_expert experts with n_slots residents and n_stage staging slots; returns its index
    int32_t add_layer(int32_t n_expert, int32_t n_slots, int32_t n_stage);

    // makes `ils` (layers added with add_layer(n_expert, 0, 0), in forward order) one bank of n_slots
    // residents and n_stage staging slots; returns its index
    int32_t add_bank(const std::vector<int32_t> & ils, int32_t n_slots, int32_t n_stage, int32_t n_used);

    // one served layer step: ids[0 .. n) are its lookups in router order (token-major, rank-minor)
    void lookup(int32_t il, const int32_t * ids, int64_t n);

    // a ubatch that did not look layer il up
    void skip(int32_t il);

    // after every layer of a ubatch: a step passed when any layer was served
    void end_ubatch(bool any_served);

    // the first n_done moves (all of them by default) are done: each becomes resident (evicting the
    // least recently used resident the last step did not look up when the layer is full) or, when
    // every resident was looked up, is dropped. They leave `moving`; the rest stay, still moving.
    // The deterministic mode settles every move after the step that follows its schedule; the
    // default mode settles only the moves whose bytes have arrived (a prefix: one worker copies
    // them in order), so decode never waits for them.
    void settle(size_t n_done = SIZE_MAX);

    // the misses of the last served step become moves into free slots, at most the insert cap per
    // layer, the upload budget per step (n_step_moves) and never more than the free slots; an
    // expert already moving is not moved twice; appends to `moving`
    void schedule();

    // the prefill warm-up: up to n of `experts` (most used first) that are neither resident nor
    // moving become moves into free slots of layer il, marked used at the current step so that the
    // next settle keeps them over older residents; returns the moves scheduled (appended to `moving`)
    int32_t warm(int32_t il, const std::vector<int32_t> & experts, int32_t n);

    // moves the upload budget still allows this step (INT32_MAX without a budget); schedule and warm
    // take from it
    int32_t moves_left = INT32_MAX;

    // sets the residents per layer to min(n_slots, n_cap) (a bank: n_slots x its layers, at most its n_cap);
    // a shrink evicts the least recently used at once. Call with nothing moving (settle first).
    void resize(int32_t n_slots);

    // the least recently used resident slot among experts last used before `used_before`, or -1;
    // ties go to the lowest expert id, so the choice depends on the routing only, not on slot placement
    int32_t lru_victim(int32_t il, uint64_t used_before) const;

    void evict(int32_t il, int32_t slot);

private:
    // the pool's victim for a move of layer il into bank b (its slot, or -1), see llama_moe_residency_bank
    int32_t bank_victim(int32_t b, int32_t il) const;
    void    bank_evict(int32_t b, int32_t slot);
    // slot q's entry goes before slot r's as a victim: the least (last use, layer, expert)
    bool    bank_before(const llama_moe_residency_bank & bk, int32_t q, int32_t r) const;
    // the bank's slots per layer for the stats and the cap (P / n)
    void    bank_sync_layers(int32_t b);
    void    schedule_bank(int32_t b);
    // layer il's misses into free slots from cursor p on (per-layer slots: its own; a bank: the bank's); p
    // becomes -1 when no slot is free
    void    schedule_layer(int32_t il, int32_t & p);

    // expert e of layer il into the first free slot at or after p (p advances): 1 when a move
    // starts, 0 when e is resident or already moving, -1 when no slot is free
    int start_move(int32_t il, int32_t e, int32_t & p);
};

// One LRU over the (layer, expert) entries of all streamed layers (the stream tier, the RAM expert
// cache of the BigMoeOnEdge seed). A layer step's experts are admitted together, taken in router
// rank order: a hit becomes the most recent entry; a miss evicts the least recently used entry that
// the step does not need, then enters as the most recent. There is no lag: the tier reads an
// admitted entry's bytes before the step's computation runs. pybmoe.routing.sim replays the same
// rule ("global-lru"). A step that needs more entries than the capacity holds: once every resident
// is one the step needs, its further misses pass through (they are not admitted, and evict nothing;
// the stream tier reads them in expert waves while the layer computes, llama-moe-waves.h), as the
// simulator's "bypassed" misses.
//
// The scan guard (scan_guard, on by default: "global-lru-scan" in pybmoe.routing.sim): a step that
// wants at least half of its layer's experts and whose distinct experts times the streamed layers
// exceed the capacity (a scan: a pass of such steps, a prefill, would flush the whole cache before it
// came back to this layer, so plain LRU keeps none of it) admits its misses at the least recent end instead, in router rank order, each behind the last; a repeated
// lookup of such an entry in the same step does not move it. Its hits of entries resident before the
// step still become the most recent. So a prefill's misses evict each other, the next layer's step
// first, and the residents it hits (those of earlier passes, and decode's) stay: a pass reads what
// the budget cannot hold, not the whole pass. Other steps (decode, whose next token reuses its experts,
// small ubatches, any step whose pass fits) are plain LRU.
//
// The lend (see `lend`): the capacity of a step is capacity + lend, unless it wants half of its layer or
// more; such a step first evicts the least recently used entries it does not need until capacity remain,
// then admits as above within capacity.
struct llama_moe_lru {
    int32_t  n_layer    = 0;
    int32_t  n_expert   = 0;
    int64_t  capacity   = 0; // entries: the budget
    // entries the stream tier's prefetch window lends to the steps that want less than half of their layer
    // (decode): such a step may hold capacity + lend entries; a step that wants half or more first evicts
    // down to capacity, so that the window's memory is free for the prefetch it triggers. "lend" in
    // pybmoe.routing.sim replays the same rule
    int64_t  lend       = 0;
    int64_t  n_resident = 0;
    uint64_t hits       = 0;
    uint64_t misses     = 0;
    uint64_t evictions  = 0;

    // entry e = layer * n_expert + expert
    std::vector<int32_t>  prev;     // [n_entries] toward the most recent; -1 at the head
    std::vector<int32_t>  next;     // [n_entries] toward the least recent; -1 at the tail
    std::vector<uint8_t>  resident; // [n_entries]
    std::vector<uint64_t> need;     // [n_entries] the last step that needed the entry
    int32_t  head = -1;             // most recent
    int32_t  tail = -1;             // least recent
    uint64_t gen  = 0;              // steps so far

    bool     scan_guard   = true;   // see above; false: plain global LRU ("global-lru")
    uint64_t n_scan_steps = 0;      // steps the guard admitted at the least recent end
    int64_t  n_distinct_now = 0;    // distinct experts the last step wanted

    // the last step wanted at least half of its layer's experts (a prefill's step: the scan guard's first
    // test, and the stream tier's prefetch trigger)
    bool wants_half() const {
        return 2 * n_distinct_now >= n_expert;
    }
    std::vector<uint64_t> cold;     // [n_entries] the step that admitted the entry at the least recent end

    void init(int32_t n_layer, int32_t n_expert, int64_t capacity);

    // one layer step: ids[0 .. n) in router order (token-major, rank-minor). hit[i] is 1 for a hit
    // and 0 for a miss; `admitted` gets the entries to read, `evicted` the entries dropped (in the
    // order they happen; an evicted entry's memory is free before any admitted entry is read)
    // `passed` gets the entries that missed and were not admitted (distinct, in first-lookup order): every
    // resident was needed by the step
    void step(int32_t layer, const int32_t * ids, int64_t n, std::vector<int8_t> & hit,
              std::vector<int32_t> & admitted, std::vector<int32_t> & evicted, std::vector<int32_t> & passed);

    // a new capacity; a shrink evicts from the least recent end at once, down to capacity + lend
    void resize(int64_t capacity, std::vector<int32_t> & evicted);

private:
    void unlink(int32_t e);
    void push_front(int32_t e);
    void push_back(int32_t e);
    // evicts the least recently used entry the current step does not need (appended to `evicted`); false
    // when the step needs every resident
    bool evict_unneeded(std::vector<int32_t> & evicted);
    std::vector<uint64_t> passed_gen; // [n_entries] the step that passed the entry through
};
