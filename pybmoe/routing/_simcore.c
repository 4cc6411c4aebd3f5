// pybmoe/_simcore.c: the compiled replay core of pybmoe.sim, loaded with ctypes.
//
// Two entry points, each the exact twin of a pure-Python function in pybmoe/sim.py (the tests
// check that both give identical results on random traces):
//
//   pybmoe_sim_layer_lru  <->  sim._layer_lru_py   the engine's per-layer policy, with its upload lag
//   pybmoe_sim_global     <->  sim._global_py      global-lru, fifo, lfu, belady over (layer, expert)
//
// The event stream is cut into units: a unit is one layer's lookups in one ubatch (all its
// tokens, router order), `unit_start[u] .. unit_start[u + 1]` in the event arrays. A unit flagged
// SIM_RESET starts a new stream (a cold cache); SIM_SERVED marks a unit the engine's cache serves.
// Results are written per event: 1 hit, 0 miss, -1 not served.
//
// Build for development: gcc -O2 -shared -fPIC -o pybmoe/_simcore.so pybmoe/_simcore.c

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SIM_SERVED 1
#define SIM_RESET  2

enum { SIM_GLOBAL_LRU = 0, SIM_FIFO = 1, SIM_LFU = 2, SIM_BELADY = 3 };

enum { SIM_OK = 0, SIM_ENOMEM = -1, SIM_EINVAL = -2 };

int32_t pybmoe_simcore_version(void) {
    return 2; // 2: global-lru takes a step's lookups in router rank order (recency per lookup)
}

// ---------------------------------------------------------------- indexed min-heap of ids
// keys are (a, b), compared lexicographically; every (a, b) is unique because b ends in the id

typedef struct {
    int32_t * heap; // [cap] heap position -> id
    int32_t * pos;  // [n_ids] id -> heap position, -1 when absent
    int64_t * ka;   // [n_ids]
    int64_t * kb;   // [n_ids]
    int32_t   n;
} iheap;

static int iheap_init(iheap * h, int32_t n_ids, int32_t cap) {
    h->heap = malloc(sizeof(int32_t) * (size_t) (cap > 0 ? cap : 1));
    h->pos  = malloc(sizeof(int32_t) * (size_t) n_ids);
    h->ka   = malloc(sizeof(int64_t) * (size_t) n_ids);
    h->kb   = malloc(sizeof(int64_t) * (size_t) n_ids);
    h->n    = 0;
    if (!h->heap || !h->pos || !h->ka || !h->kb) {
        return SIM_ENOMEM;
    }
    memset(h->pos, 0xff, sizeof(int32_t) * (size_t) n_ids);
    return SIM_OK;
}

static void iheap_free(iheap * h) {
    free(h->heap); free(h->pos); free(h->ka); free(h->kb);
}

static inline int iheap_less(const iheap * h, int32_t x, int32_t y) {
    return h->ka[x] < h->ka[y] || (h->ka[x] == h->ka[y] && h->kb[x] < h->kb[y]);
}

static inline void iheap_place(iheap * h, int32_t i, int32_t id) {
    h->heap[i] = id;
    h->pos[id] = i;
}

static void iheap_up(iheap * h, int32_t i) {
    const int32_t id = h->heap[i];
    while (i > 0) {
        const int32_t p = (i - 1) >> 1;
        if (!iheap_less(h, id, h->heap[p])) {
            break;
        }
        iheap_place(h, i, h->heap[p]);
        i = p;
    }
    iheap_place(h, i, id);
}

static void iheap_down(iheap * h, int32_t i) {
    const int32_t id = h->heap[i];
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= h->n) {
            break;
        }
        if (c + 1 < h->n && iheap_less(h, h->heap[c + 1], h->heap[c])) {
            c++;
        }
        if (!iheap_less(h, h->heap[c], id)) {
            break;
        }
        iheap_place(h, i, h->heap[c]);
        i = c;
    }
    iheap_place(h, i, id);
}

static void iheap_push(iheap * h, int32_t id, int64_t a, int64_t b) {
    h->ka[id] = a;
    h->kb[id] = b;
    iheap_place(h, h->n++, id);
    iheap_up(h, h->n - 1);
}

static void iheap_set(iheap * h, int32_t id, int64_t a, int64_t b) {
    const int64_t oa = h->ka[id], ob = h->kb[id];
    h->ka[id] = a;
    h->kb[id] = b;
    if (a < oa || (a == oa && b < ob)) {
        iheap_up(h, h->pos[id]);
    } else {
        iheap_down(h, h->pos[id]);
    }
}

static int32_t iheap_pop(iheap * h) {
    const int32_t top = h->heap[0];
    h->pos[top] = -1;
    h->n--;
    if (h->n > 0) {
        iheap_place(h, 0, h->heap[h->n]);
        iheap_down(h, 0);
    }
    return top;
}

static void iheap_clear(iheap * h) {
    for (int32_t i = 0; i < h->n; ++i) {
        h->pos[h->heap[i]] = -1;
    }
    h->n = 0;
}

// ---------------------------------------------------------------- layer-lru (the engine's policy)
//
// Events are one (workload, layer) stream after another; within a stream, units are that
// layer's ubatches in order. A served unit is a step s: its lookups are answered by the resident
// set and set used[e] = s. Right after every unit, served or not (the engine's
// llama_moe_cache_after_ubatch), the uploads scheduled after the previous unit become resident
// (evicting argmin (used, id) among residents not used at the last served step; none -> the
// upload is dropped), then the distinct misses of this unit are scheduled (insert cap, free
// physical slots).
//
// counters[0] += uploads completed (admitted or dropped), counters[1] += uploads dropped.

int32_t pybmoe_sim_layer_lru(int64_t n_units, const int64_t * unit_start, const uint8_t * unit_flags,
                             const int32_t * expert, int32_t n_expert, int32_t slots, int32_t cap,
                             int32_t staging, int8_t * out, int64_t * counters) {
    if (n_units < 0 || n_expert <= 0 || slots < 1 || slots > n_expert || cap < 0 || staging < 0) {
        return SIM_EINVAL;
    }
    iheap h;
    int rc = iheap_init(&h, n_expert, slots);
    uint8_t * resident = calloc((size_t) n_expert, 1);
    int64_t * used     = calloc((size_t) n_expert, sizeof(int64_t));
    int64_t * missmark = calloc((size_t) n_expert, sizeof(int64_t)); // unit + 1 that listed e in misses
    int32_t * flight   = malloc(sizeof(int32_t) * (size_t) n_expert);
    int32_t * misses   = malloc(sizeof(int32_t) * (size_t) n_expert);
    if (rc != SIM_OK || !resident || !used || !missmark || !flight || !misses) {
        rc = SIM_ENOMEM;
        goto done;
    }
    int32_t n_flight = 0, n_misses = 0, n_res = 0;
    int64_t step = 0, last_step = 0;
    for (int64_t u = 0; u < n_units; ++u) {
        if (unit_flags[u] & SIM_RESET) {
            iheap_clear(&h);
            memset(resident, 0, (size_t) n_expert);
            memset(used, 0, sizeof(int64_t) * (size_t) n_expert);
            n_flight = n_misses = n_res = 0;
            step = last_step = 0;
        }
        // --- the graph
        const int64_t b = unit_start[u], end = unit_start[u + 1];
        if (unit_flags[u] & SIM_SERVED) {
            last_step = ++step;
            for (int64_t i = b; i < end; ++i) {
                const int32_t e = expert[i];
                used[e] = step;
                if (resident[e]) {
                    out[i] = 1;
                    iheap_set(&h, e, step, e);
                } else {
                    out[i] = 0;
                    if (missmark[e] != u + 1) {
                        missmark[e] = u + 1;
                        misses[n_misses++] = e;
                    }
                }
            }
        } else {
            memset(out + b, -1, (size_t) (end - b));
        }
        // --- after it: the uploads scheduled after the previous unit become resident
        for (int32_t i = 0; i < n_flight; ++i) {
            const int32_t e = flight[i];
            counters[0]++;
            if (n_res == slots) {
                const int32_t v = h.heap[0];
                if (used[v] >= last_step) { // every resident was selected at the last step
                    counters[1]++;
                    continue;
                }
                iheap_pop(&h);
                resident[v] = 0;
                n_res--;
            }
            resident[e] = 1;
            n_res++;
            iheap_push(&h, e, used[e], e);
        }
        n_flight = 0;
        // --- and this unit's misses are scheduled into free physical slots
        for (int32_t i = 0; i < n_misses; ++i) {
            const int32_t e = misses[i];
            if (resident[e]) {
                continue;
            }
            if (cap > 0 && n_flight == cap) {
                break;
            }
            if (n_flight == staging + (slots - n_res)) {
                break;
            }
            flight[n_flight++] = e;
        }
        n_misses = 0;
    }
done:
    iheap_free(&h);
    free(resident); free(used); free(missmark); free(flight); free(misses);
    return rc;
}

// ---------------------------------------------------------------- global policies
//
// Entries are (layer, expert) ids 0 .. n_entries - 1; units are layer steps in forward order.
// Admission is instant and per unit: the unit's lookups are answered by the cache as it was
// before the unit, then its missed entries are admitted in order of first appearance; a victim
// is the minimum of the policy's key among residents the unit does not need; with no victim
// the entry is not admitted (bypassed). A later lookup of an admitted entry within the same
// unit is a hit. Keys (all end in the id, so they are unique):
//   global-lru (last unit that needed it, id)     fifo (unit it was admitted at, id)
//   lfu (units that needed it since admission, last unit, id)
//   belady (-next unit that needs it, id); the incoming entry is bypassed when its own next
//   use is no sooner than the victim's.
//
// counters[0] += entries admitted.

#define SIM_NEVER ((int64_t) 1 << 62)

int32_t pybmoe_sim_global(int32_t policy, int64_t n_units, const int64_t * unit_start, const uint8_t * unit_flags,
                          const int32_t * entry, int32_t n_entries, int64_t capacity, int8_t * out,
                          int64_t * counters) {
    if (policy < SIM_GLOBAL_LRU || policy > SIM_BELADY || n_units < 0 || n_entries <= 0 || capacity < 0) {
        return SIM_EINVAL;
    }
    if (capacity > n_entries) {
        capacity = n_entries;
    }
    const int64_t n_events = n_units > 0 ? unit_start[n_units] : 0;
    iheap h;
    int rc = iheap_init(&h, n_entries, (int32_t) capacity);
    uint8_t * resident = calloc((size_t) n_entries, 1);
    int64_t * mark     = calloc((size_t) n_entries, sizeof(int64_t)); // unit + 1 that needs it
    int64_t * freq     = calloc((size_t) n_entries, sizeof(int64_t));
    int64_t * first_ev = calloc((size_t) n_entries, sizeof(int64_t)); // event of its first lookup in the unit
    int32_t * stash    = malloc(sizeof(int32_t) * (size_t) (n_entries));
    int64_t * next     = NULL; // belady: per event, the next unit of the same stream that needs the entry
    int64_t * seen     = NULL;
    if (rc != SIM_OK || !resident || !mark || !freq || !first_ev || !stash) {
        rc = SIM_ENOMEM;
        goto done;
    }
    if (policy == SIM_BELADY) {
        next = malloc(sizeof(int64_t) * (size_t) (n_events > 0 ? n_events : 1));
        seen = malloc(sizeof(int64_t) * (size_t) n_entries);
        if (!next || !seen) {
            rc = SIM_ENOMEM;
            goto done;
        }
        // backwards over each stream: seen[e] = the earliest later unit needing e
        int64_t end_u = n_units;
        for (int64_t s = n_units - 1; s >= 0; --s) {
            if (!(unit_flags[s] & SIM_RESET) && s > 0) {
                continue;
            }
            for (int32_t e = 0; e < n_entries; ++e) {
                seen[e] = SIM_NEVER;
            }
            for (int64_t u = end_u - 1; u >= s; --u) {
                for (int64_t i = unit_start[u]; i < unit_start[u + 1]; ++i) {
                    next[i] = seen[entry[i]];
                }
                for (int64_t i = unit_start[u]; i < unit_start[u + 1]; ++i) {
                    seen[entry[i]] = u;
                }
            }
            end_u = s;
        }
    }
    int64_t n_res = 0;
    for (int64_t u = 0; u < n_units; ++u) {
        if (unit_flags[u] & SIM_RESET) {
            iheap_clear(&h);
            memset(resident, 0, (size_t) n_entries);
            n_res = 0;
        }
        const int64_t b = unit_start[u], end = unit_start[u + 1];
        const int64_t tag = u + 1;
        // pass 1: the cache as it was before the unit answers; residents the unit needs get new keys
        int dup = 0;
        for (int64_t i = b; i < end; ++i) {
            const int32_t e = entry[i];
            const int first = mark[e] != tag;
            if (first) {
                mark[e] = tag;
                first_ev[e] = i;
            } else {
                dup = 1;
            }
            if (!resident[e]) {
                out[i] = 0;
                continue;
            }
            out[i] = 1;
            if (policy == SIM_GLOBAL_LRU) {
                iheap_set(&h, e, i, e); // every hit becomes the most recent entry, in rank order
                continue;
            }
            if (!first) {
                continue;
            }
            switch (policy) {
                case SIM_GLOBAL_LRU: break;
                case SIM_FIFO: break;
                case SIM_LFU: freq[e]++; iheap_set(&h, e, freq[e], u * (int64_t) n_entries + e); break;
                case SIM_BELADY: iheap_set(&h, e, -next[i], e); break;
            }
        }
        // pass 2: admit the missed entries in order of first appearance
        for (int64_t i = b; i < end; ++i) {
            const int32_t e = entry[i];
            if (out[i] != 0 || first_ev[e] != i || capacity == 0) {
                continue;
            }
            if (n_res == capacity) {
                int32_t n_stash = 0, victim = -1;
                while (h.n > 0) {
                    const int32_t x = iheap_pop(&h);
                    if (mark[x] == tag) {
                        stash[n_stash++] = x; // needed by this unit: never evicted
                        continue;
                    }
                    victim = x;
                    break;
                }
                if (victim >= 0 && policy == SIM_BELADY && next[i] >= -h.ka[victim]) {
                    stash[n_stash++] = victim; // the incoming entry is the one needed furthest away
                    victim = -1;
                }
                for (int32_t j = 0; j < n_stash; ++j) {
                    iheap_push(&h, stash[j], h.ka[stash[j]], h.kb[stash[j]]);
                }
                if (victim < 0) {
                    continue; // bypassed: all its lookups in this unit miss
                }
                resident[victim] = 0;
                n_res--;
            }
            resident[e] = 1;
            n_res++;
            counters[0]++;
            switch (policy) {
                case SIM_GLOBAL_LRU: iheap_push(&h, e, i, e); break;
                case SIM_FIFO: iheap_push(&h, e, u, e); break;
                case SIM_LFU: freq[e] = 1; iheap_push(&h, e, 1, u * (int64_t) n_entries + e); break;
                case SIM_BELADY: iheap_push(&h, e, -next[i], e); break;
            }
        }
        // pass 3 (T > 1 only): a repeated lookup of an entry admitted at this unit hits
        if (dup) {
            for (int64_t i = b; i < end; ++i) {
                if (out[i] == 0 && first_ev[entry[i]] != i && resident[entry[i]]) {
                    out[i] = 1;
                    if (policy == SIM_GLOBAL_LRU) {
                        iheap_set(&h, entry[i], i, entry[i]);
                    }
                }
            }
        }
    }
done:
    iheap_free(&h);
    free(resident); free(mark); free(freq); free(first_ev); free(stash); free(next); free(seen);
    return rc;
}
