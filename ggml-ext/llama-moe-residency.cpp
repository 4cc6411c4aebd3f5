// pybmoe: the residency bookkeeping of one expert tier. See llama-moe-residency.h.
//
// Holds: the policy's decisions only. Must not hold: ggml, I/O, threads or logging.

#include "llama-moe-residency.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#define LLAMA_MOE_RES_ASSERT(x)                                                        \
    do {                                                                               \
        if (!(x)) {                                                                    \
            fprintf(stderr, "%s:%d: moe residency: assertion failed: %s\n", __FILE__, __LINE__, #x); \
            abort();                                                                   \
        }                                                                              \
    } while (0)

int32_t llama_moe_stage_slots(int32_t n_expert, int32_t n_used, int32_t n_slots, int32_t n_inserts, int32_t max_batch) {
    return std::min({ n_inserts > 0 ? n_inserts : n_used, n_used * max_batch, n_expert - n_slots });
}

int32_t llama_moe_pool_stage_slots(int32_t n_layer, int32_t n_expert, int32_t n_used, int32_t n_slots) {
    return std::max(0, std::min(n_layer * std::min(n_used, n_expert), n_layer * n_expert - n_slots));
}

bool llama_moe_residency_layer::is_resident(int32_t e) const {
    return table[e] < n_phys;
}

int32_t llama_moe_residency::add_layer(int32_t n_expert, int32_t n_slots, int32_t n_stage) {
    LLAMA_MOE_RES_ASSERT(n_expert > 0 && n_slots >= 0 && n_stage >= 0);
    llama_moe_residency_layer l;
    l.n_expert = n_expert;
    l.n_slots  = n_slots;
    l.n_cap    = n_slots;
    l.n_stage  = n_stage;
    l.n_phys   = n_slots + n_stage;
    l.table.assign(n_expert, l.n_phys);
    l.moving_e.assign(n_expert, 0);
    l.used.assign(n_expert, 0);
    l.last_miss.assign(n_expert, 0);
    l.slot_expert.assign(l.n_phys, -1);
    l.slot_state.assign(l.n_phys, LLAMA_MOE_SLOT_FREE);
    l.dirty = true; // the tables have never been published
    layers.push_back(std::move(l));
    return (int32_t) layers.size() - 1;
}

int32_t llama_moe_residency::add_bank(const std::vector<int32_t> & ils, int32_t n_slots, int32_t n_stage, int32_t n_used) {
    LLAMA_MOE_RES_ASSERT(!ils.empty() && n_slots >= 0 && n_stage >= 0);
    const int32_t b = (int32_t) banks.size();
    llama_moe_residency_bank bk;
    bk.n_slots = n_slots;
    bk.n_cap   = n_slots;
    bk.n_stage = n_stage;
    bk.n_phys  = n_slots + n_stage;
    bk.n_used  = n_used;
    bk.layers  = ils;
    bk.slot_layer.assign(bk.n_phys, -1);
    bk.slot_expert.assign(bk.n_phys, -1);
    bk.slot_state.assign(bk.n_phys, LLAMA_MOE_SLOT_FREE);
    for (int32_t il : ils) {
        auto & l = layers.at(il);
        LLAMA_MOE_RES_ASSERT(l.bank < 0 && l.n_cap == 0 && l.n_stage == 0);
        l.bank   = b;
        l.n_phys = bk.n_phys;
        l.table.assign(l.n_expert, l.n_phys);
        l.slot_expert.clear();
        l.slot_state.clear();
        l.dirty = true;
    }
    banks.push_back(std::move(bk));
    bank_sync_layers(b);
    return b;
}

void llama_moe_residency::bank_sync_layers(int32_t b) {
    auto & bk = banks[b];
    const int32_t n = (int32_t) bk.layers.size();
    bk.floor = std::min(bk.n_used, bk.n_slots / n) / 2;
    for (int32_t il : bk.layers) {
        auto & l = layers[il];
        l.n_slots = bk.n_slots / n;                                  // the share, for the stats
        l.n_cap   = std::min(l.n_expert, (bk.n_cap + n - 1) / n);    // resize(n_cap) gives the bank back its n_cap
    }
}

void llama_moe_residency::lookup(int32_t il, const int32_t * ids, int64_t n) {
    auto & l = layers.at(il);
    l.served_now = true;
    l.misses_now.clear();
    l.hits_now.clear();
    l.last_step = step;
    if (l.bank >= 0) {
        banks[l.bank].last_step = step;
    }
    const uint64_t s = ++l.n_served;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t e = ids[i];
        LLAMA_MOE_RES_ASSERT(e >= 0 && e < l.n_expert);
        l.used[e] = step;
        const bool hit = l.is_resident(e);
        l.hits_now.push_back(hit);
        if (hit) {
            l.hits++;
        } else {
            l.misses++;
            if (l.last_miss[e] == s) {
                continue; // this step's miss of e was decided at its first lookup
            }
            const uint64_t prev = l.last_miss[e];
            l.last_miss[e] = s;
            if (admit_window == 0 || (prev > 0 && s - prev <= (uint64_t) admit_window)) {
                l.misses_now.push_back(e);
            } else {
                n_bypassed++;
            }
        }
    }
}

void llama_moe_residency::skip(int32_t il) {
    layers.at(il).served_now = false;
}

void llama_moe_residency::end_ubatch(bool any_served) {
    if (any_served) {
        n_steps++;
        step++;
    }
}

int32_t llama_moe_residency::lru_victim(int32_t il, uint64_t used_before) const {
    const auto & l = layers.at(il);
    LLAMA_MOE_RES_ASSERT(l.bank < 0);
    int32_t victim = -1;
    for (int32_t q = 0; q < l.n_phys; ++q) {
        if (l.slot_state[q] != LLAMA_MOE_SLOT_RESIDENT || l.used[l.slot_expert[q]] >= used_before) {
            continue;
        }
        const int32_t x = l.slot_expert[q];
        const int32_t v = victim < 0 ? -1 : l.slot_expert[victim];
        if (victim < 0 || l.used[x] < l.used[v] || (l.used[x] == l.used[v] && x < v)) {
            victim = q;
        }
    }
    return victim;
}

void llama_moe_residency::evict(int32_t il, int32_t q) {
    auto & l = layers.at(il);
    LLAMA_MOE_RES_ASSERT(l.bank < 0 && q >= 0 && q < l.n_phys && l.slot_state[q] == LLAMA_MOE_SLOT_RESIDENT);
    l.table[l.slot_expert[q]] = l.n_phys;
    l.slot_state[q]  = LLAMA_MOE_SLOT_FREE;
    l.slot_expert[q] = -1;
    l.n_resident--;
    l.dirty = true;
}

void llama_moe_residency::settle(size_t n_done) {
    n_done = std::min(n_done, moving.size());
    for (size_t i = 0; i < n_done; ++i) {
        const llama_moe_move & m = moving[i];
        auto & l = layers.at(m.layer);
        // the slots the move landed in: the layer's own, or its bank's
        llama_moe_residency_bank * bk = l.bank >= 0 ? &banks[l.bank] : nullptr;
        auto & state  = bk ? bk->slot_state  : l.slot_state;
        auto & expert = bk ? bk->slot_expert : l.slot_expert;
        LLAMA_MOE_RES_ASSERT(state[m.slot] == LLAMA_MOE_SLOT_MOVING && expert[m.slot] == m.expert &&
                             (!bk || bk->slot_layer[m.slot] == m.layer));
        l.moving_e[m.expert] = 0;
        if (bk ? bk->n_resident >= bk->n_slots : l.n_resident == l.n_slots) {
            // never evict an expert the last step looked up (a bank: but see its floor, bank_victim)
            const int32_t victim = bk ? bank_victim(l.bank, m.layer) : lru_victim(m.layer, l.last_step);
            if (victim < 0) {
                // every candidate was needed just now: drop the move
                state[m.slot]  = LLAMA_MOE_SLOT_FREE;
                expert[m.slot] = -1;
                if (bk) {
                    bk->slot_layer[m.slot] = -1;
                }
                continue;
            }
            if (bk) {
                bank_evict(l.bank, victim);
            } else {
                evict(m.layer, victim);
            }
        }
        l.table[m.expert] = m.slot;
        state[m.slot]     = LLAMA_MOE_SLOT_RESIDENT;
        l.n_resident++;
        if (bk) {
            bk->n_resident++;
        }
        l.dirty = true;
    }
    moving.erase(moving.begin(), moving.begin() + (ptrdiff_t) n_done);
}

int llama_moe_residency::start_move(int32_t il, int32_t e, int32_t & p) {
    auto & l = layers[il];
    if (l.is_resident(e)) {
        return 0; // became resident at this settle (an earlier miss of the same expert)
    }
    if (l.moving_e[e]) {
        return 0; // still moving from an earlier step (the default mode does not wait for it)
    }
    // moves go to free slots only (the layer's own, or its bank's): residents keep serving while they are written
    llama_moe_residency_bank * bk = l.bank >= 0 ? &banks[l.bank] : nullptr;
    auto & state = bk ? bk->slot_state : l.slot_state;
    while (p < l.n_phys && state[p] != LLAMA_MOE_SLOT_FREE) {
        p++;
    }
    if (p == l.n_phys) {
        return -1;
    }
    state[p] = LLAMA_MOE_SLOT_MOVING;
    (bk ? bk->slot_expert : l.slot_expert)[p] = e;
    if (bk) {
        bk->slot_layer[p] = il;
    }
    l.moving_e[e] = 1;
    moving.push_back({ il, e, p });
    return 1;
}

void llama_moe_residency::schedule_layer(int32_t il, int32_t & p) {
    auto & l = layers[il];
    int32_t budget = n_inserts > 0 ? n_inserts : l.n_expert;
    for (int32_t e : l.misses_now) {
        if (budget == 0 || moves_left == 0) {
            break;
        }
        const int r = start_move(il, e, p);
        if (r < 0) {
            p = -1; // no free slot left
            break;
        }
        budget -= r;
        moves_left -= r;
    }
}

void llama_moe_residency::schedule_bank(int32_t b) {
    const auto & bk = banks[b];
    if (bk.n_slots == 0) {
        return; // resized to nothing: a move could never become resident
    }
    // one cursor over the bank's slots: the layers' misses in forward order, until no slot is free
    const int32_t n = (int32_t) bk.layers.size();
    const int32_t first = n_step_moves > 0 ? (int32_t) (step % (uint64_t) n) : 0;
    int32_t p = 0;
    for (int32_t k = 0; k < n && p >= 0; ++k) {
        schedule_layer(bk.layers[(first + k) % n], p);
    }
}

void llama_moe_residency::schedule() {
    const int32_t n_layers = (int32_t) layers.size();
    moves_left = n_step_moves > 0 ? n_step_moves : INT32_MAX;
    // with an upload budget the layers take turns at going first, so none is starved
    const int32_t first = n_step_moves > 0 && n_layers > 0 ? (int32_t) (step % (uint64_t) n_layers) : 0;
    for (int32_t k = 0; k < n_layers; ++k) {
        const int32_t il = (first + k) % n_layers;
        int32_t p = 0;
        if (layers[il].bank < 0 && layers[il].n_slots > 0) { // resized to nothing: a move could never become resident
            schedule_layer(il, p);
        }
    }
    for (int32_t b = 0; b < (int32_t) banks.size(); ++b) {
        schedule_bank(b);
    }
    for (auto & l : layers) {
        l.misses_now.clear();
    }
}

int32_t llama_moe_residency::warm(int32_t il, const std::vector<int32_t> & experts, int32_t n) {
    auto & l = layers.at(il);
    if ((l.bank >= 0 ? banks[l.bank].n_slots : l.n_slots) == 0) {
        return 0;
    }
    int32_t done = 0;
    int32_t p = 0;
    for (int32_t e : experts) {
        if (done == n || moves_left == 0) {
            break;
        }
        LLAMA_MOE_RES_ASSERT(e >= 0 && e < l.n_expert);
        const int r = start_move(il, e, p);
        if (r < 0) {
            break;
        }
        if (r > 0) {
            l.used[e] = step;
            done++;
            moves_left--;
        }
    }
    return done;
}

void llama_moe_residency::resize(int32_t n_slots) {
    LLAMA_MOE_RES_ASSERT(moving.empty() && n_slots >= 0);
    for (int32_t il = 0; il < (int32_t) layers.size(); ++il) {
        auto & l = layers[il];
        l.misses_now.clear();
        if (l.bank >= 0) {
            continue;
        }
        l.n_slots = std::min(n_slots, l.n_cap);
        // shrinking evicts at once, least recently used first
        while (l.n_resident > l.n_slots) {
            evict(il, lru_victim(il, UINT64_MAX));
        }
    }
    for (int32_t b = 0; b < (int32_t) banks.size(); ++b) {
        auto & bk = banks[b];
        bk.n_slots = (int32_t) std::min<int64_t>((int64_t) n_slots * (int64_t) bk.layers.size(), bk.n_cap);
        // shrinking evicts at once, the least (last use, layer, expert) first
        while (bk.n_resident > bk.n_slots) {
            int32_t v = -1;
            for (int32_t q = 0; q < bk.n_phys; ++q) {
                if (bk.slot_state[q] == LLAMA_MOE_SLOT_RESIDENT && (v < 0 || bank_before(bk, q, v))) {
                    v = q;
                }
            }
            bank_evict(b, v);
        }
        bank_sync_layers(b);
    }
}

bool llama_moe_residency::bank_before(const llama_moe_residency_bank & bk, int32_t q, int32_t r) const {
    const int32_t lq = bk.slot_layer[q], lr = bk.slot_layer[r];
    const uint64_t uq = layers[lq].used[bk.slot_expert[q]], ur = layers[lr].used[bk.slot_expert[r]];
    if (uq != ur) {
        return uq < ur;
    }
    return lq != lr ? lq < lr : bk.slot_expert[q] < bk.slot_expert[r];
}

int32_t llama_moe_residency::bank_victim(int32_t b, int32_t il) const {
    const auto & bk = banks[b];
    const uint64_t s = bk.last_step;
    int32_t best = -1;
    // its own layer's entries, or those of a layer over the floor, that the last served step did not look up
    for (int32_t q = 0; q < bk.n_phys; ++q) {
        if (bk.slot_state[q] != LLAMA_MOE_SLOT_RESIDENT) {
            continue;
        }
        const int32_t ly = bk.slot_layer[q];
        if (layers[ly].used[bk.slot_expert[q]] >= s || (ly != il && layers[ly].n_resident <= bk.floor)) {
            continue;
        }
        if (best < 0 || bank_before(bk, q, best)) {
            best = q;
        }
    }
    if (best < 0 && layers[il].n_resident < bk.floor) {
        // under its floor: a layer over its floor gives, even an entry the last step looked up
        for (int32_t q = 0; q < bk.n_phys; ++q) {
            if (bk.slot_state[q] != LLAMA_MOE_SLOT_RESIDENT) {
                continue;
            }
            const int32_t ly = bk.slot_layer[q];
            if (ly != il && layers[ly].n_resident > bk.floor && (best < 0 || bank_before(bk, q, best))) {
                best = q;
            }
        }
    }
    return best;
}

void llama_moe_residency::bank_evict(int32_t b, int32_t q) {
    auto & bk = banks[b];
    LLAMA_MOE_RES_ASSERT(q >= 0 && q < bk.n_phys && bk.slot_state[q] == LLAMA_MOE_SLOT_RESIDENT);
    auto & l = layers[bk.slot_layer[q]];
    l.table[bk.slot_expert[q]] = l.n_phys;
    l.n_resident--;
    l.dirty = true;
    bk.slot_state[q]  = LLAMA_MOE_SLOT_FREE;
    bk.slot_layer[q]  = -1;
    bk.slot_expert[q] = -1;
    bk.n_resident--;
}

//
// llama_moe_lru
//

void llama_moe_lru::init(int32_t n_layer_, int32_t n_expert_, int64_t capacity_) {
    LLAMA_MOE_RES_ASSERT(n_layer_ > 0 && n_expert_ > 0 && capacity_ >= 0);
    n_layer    = n_layer_;
    n_expert   = n_expert_;
    capacity   = capacity_;
    n_resident = 0;
    hits = misses = evictions = 0;
    const size_t n = (size_t) n_layer * n_expert;
    prev.assign(n, -1);
    next.assign(n, -1);
    resident.assign(n, 0);
    need.assign(n, 0);
    cold.assign(n, 0);
    passed_gen.assign(n, 0);
    head = tail = -1;
    gen  = 0;
    n_scan_steps = 0;
}

void llama_moe_lru::unlink(int32_t e) {
    if (prev[e] >= 0) { next[prev[e]] = next[e]; } else { head = next[e]; }
    if (next[e] >= 0) { prev[next[e]] = prev[e]; } else { tail = prev[e]; }
    prev[e] = next[e] = -1;
}

void llama_moe_lru::push_front(int32_t e) {
    prev[e] = -1;
    next[e] = head;
    if (head >= 0) { prev[head] = e; } else { tail = e; }
    head = e;
}

void llama_moe_lru::push_back(int32_t e) {
    next[e] = -1;
    prev[e] = tail;
    if (tail >= 0) { next[tail] = e; } else { head = e; }
    tail = e;
}

void llama_moe_lru::step(int32_t layer, const int32_t * ids, int64_t n, std::vector<int8_t> & hit,
                         std::vector<int32_t> & admitted, std::vector<int32_t> & evicted, std::vector<int32_t> & passed) {
    LLAMA_MOE_RES_ASSERT(layer >= 0 && layer < n_layer);
    gen++;
    const int32_t base = layer * n_expert;
    n_distinct_now = 0;
    for (int64_t i = 0; i < n; ++i) {
        LLAMA_MOE_RES_ASSERT(ids[i] >= 0 && ids[i] < n_expert);
        n_distinct_now += need[base + ids[i]] != gen;
        need[base + ids[i]] = gen; // never evicted by this step
    }
    // the scan guard: a step that wants half of its layer or more (a prefill's), and a pass of such steps
    // does not fit in the capacity
    const bool scan = scan_guard && wants_half() && n_distinct_now * n_layer > capacity;
    n_scan_steps += scan;
    // the lend: a step that wants half of its layer or more holds capacity entries, the others capacity + lend
    const int64_t cap = wants_half() ? capacity : capacity + lend;
    while (n_resident > cap && evict_unneeded(evicted)) {
    }
    hit.resize(n);
    for (int64_t i = 0; i < n; ++i) {
        const int32_t e = base + ids[i];
        if (resident[e]) {
            hits++;
            hit[i] = 1;
            if (!scan || cold[e] != gen) { // an entry this scan admitted stays at the least recent end
                unlink(e);
                push_front(e);
            }
            continue;
        }
        misses++;
        hit[i] = 0;
        if (n_resident >= cap && !evict_unneeded(evicted)) {
            // every resident is needed by this step: the miss passes through (not admitted); a repeated
            // lookup of it misses again
            if (passed_gen[e] != gen) {
                passed_gen[e] = gen;
                passed.push_back(e);
            }
            continue;
        }
        resident[e] = 1;
        n_resident++;
        if (scan) {
            cold[e] = gen;
            push_back(e);
        } else {
            push_front(e);
        }
        admitted.push_back(e);
    }
}

bool llama_moe_lru::evict_unneeded(std::vector<int32_t> & evicted) {
    int32_t v = tail;
    while (v >= 0 && need[v] == gen) {
        v = prev[v];
    }
    if (v < 0) {
        return false; // every resident is needed by this step (a capacity under the step's set)
    }
    unlink(v);
    resident[v] = 0;
    n_resident--;
    evictions++;
    evicted.push_back(v);
    return true;
}

void llama_moe_lru::resize(int64_t capacity_, std::vector<int32_t> & evicted) {
    LLAMA_MOE_RES_ASSERT(capacity_ >= 0);
    capacity = capacity_;
    while (n_resident > capacity + lend) {
        const int32_t v = tail;
        unlink(v);
        resident[v] = 0;
        n_resident--;
        evictions++;
        evicted.push_back(v);
    }
}
