// pybmoe/routing/_simcore.c: the replay core of pybmoe.routing.sim, loaded with ctypes; the one
// implementation of the replay (pybmoe/routing/sim.py has no other). CMakeLists.txt builds it as the
// target pybmoe_simcore and installs it next to sim.py, so every `pip install .` has it.
//
// Three entry points, each held to the plain statement of its rule in the tests' oracle
// (tests/routing/lru_oracle.py): identical results and counters on random traces and unit streams
// (tests/routing/test_sim.py, test_sim_core.py, test_admission.py, test_pool.py):
//
//   pybmoe_sim_layer_lru_admit <-> lru_oracle.layer_lru      the engine's per-layer policy, with its upload
//                                                            lag, and an admission rule (always / second miss)
//   pybmoe_sim_global          <-> lru_oracle.global_policy  global-lru(-scan), fifo, lfu, belady over
//                                                            (layer, expert)
//   pybmoe_sim_pool            <-> lru_oracle.pool           the VRAM tier's pool: one bank over (layer,
//                                                            expert) entries, sync or instant, LRU or
//                                                            ClassLRU, a per-layer guard
//
// and pybmoe_sim_crf_decay, ClassLRU's decay table, for the tests (see there) and no other caller.
//
// The event stream is cut into units: a unit is one layer's lookups in one ubatch (all its
// tokens, router order), `unit_start[u] .. unit_start[u + 1]` in the event arrays. A unit flagged
// SIM_RESET starts a new stream (a cold cache); SIM_SERVED marks a unit the engine's cache serves.
// Results are written per event: 1 hit, 0 miss, -1 not served.
//
// Build for development: gcc -O2 -shared -fPIC -o pybmoe/routing/_simcore.so pybmoe/routing/_simcore.c

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SIM_SERVED 1
#define SIM_RESET  2

enum { SIM_GLOBAL_LRU = 0, SIM_FIFO = 1, SIM_LFU = 2, SIM_BELADY = 3, SIM_GLOBAL_LRU_SCAN = 4 };

enum { SIM_OK = 0, SIM_ENOMEM = -1, SIM_EINVAL = -2 };

int32_t pybmoe_simcore_version(void) {
    return 6; // 2: global-lru takes a step's lookups in router rank order (recency per lookup)
              // 3: layer-lru's admission rule (pybmoe_sim_layer_lru_admit) and wasted uploads
              // 4: global-lru-scan, and pybmoe_sim_global's n_layer
              // 5: pybmoe_sim_global's lend (the stream tier's prefetch window, lent to decode)
              // 6: pybmoe_sim_pool (the VRAM tier's pool) and pybmoe_sim_crf_decay
              // (pybmoe_sim_layer_lru, version 2's entry point, was later removed without a new version:
              // sim.py never called it, and a version 6 library built before has every entry point it calls)
}

// ---------------------------------------------------------------- indexed min-heap of ids
// keys are int64, unique (they end in the id); layer-lru's residents

typedef struct {
    int32_t * heap; // [cap] heap position -> id
    int32_t * pos;  // [n_ids] id -> heap position, -1 when absent
    int64_t * key;  // [n_ids]
    int32_t   n;
} iheap;

static int iheap_init(iheap * h, int32_t n_ids, int32_t cap) {
    h->heap = malloc(sizeof(int32_t) * (size_t) (cap > 0 ? cap : 1));
    h->pos  = malloc(sizeof(int32_t) * (size_t) n_ids);
    h->key  = malloc(sizeof(int64_t) * (size_t) n_ids);
    h->n    = 0;
    if (!h->heap || !h->pos || !h->key) {
        return SIM_ENOMEM;
    }
    memset(h->pos, 0xff, sizeof(int32_t) * (size_t) n_ids);
    return SIM_OK;
}

static void iheap_free(iheap * h) {
    free(h->heap); free(h->pos); free(h->key);
}

static inline void iheap_place(iheap * h, int32_t i, int32_t id) {
    h->heap[i] = id;
    h->pos[id] = i;
}

static inline void iheap_up(iheap * h, int32_t i) {
    const int32_t id = h->heap[i];
    const int64_t k  = h->key[id];
    while (i > 0) {
        const int32_t p = (i - 1) >> 1;
        if (k >= h->key[h->heap[p]]) {
            break;
        }
        iheap_place(h, i, h->heap[p]);
        i = p;
    }
    iheap_place(h, i, id);
}

static inline void iheap_down(iheap * h, int32_t i) {
    const int32_t id = h->heap[i];
    const int64_t k  = h->key[id];
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= h->n) {
            break;
        }
        if (c + 1 < h->n && h->key[h->heap[c + 1]] < h->key[h->heap[c]]) {
            c++;
        }
        if (h->key[h->heap[c]] >= k) {
            break;
        }
        iheap_place(h, i, h->heap[c]);
        i = c;
    }
    iheap_place(h, i, id);
}

static inline void iheap_push(iheap * h, int32_t id, int64_t k) {
    h->key[id] = k;
    iheap_place(h, h->n++, id);
    iheap_up(h, h->n - 1);
}

static inline int32_t iheap_pop(iheap * h) {
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
// The residents: up to SIM_SCAN_SLOTS slots an array scanned for the victim (a few cycles per
// resident, nothing per hit), above that a min-heap on (used, id) whose keys catch up lazily.
//
// Admission (window > 0: "second miss"): a distinct miss of step s is scheduled only if the same
// expert also missed at one of the steps s - window .. s - 1 of this layer (a ghost history: the
// step of each expert's last miss, lastmiss[e], 0 = none since the stream began); otherwise it is
// only remembered, and it takes neither an insert nor a physical slot. window 0: every miss is
// scheduled (admission "always", the engine today). Every miss updates lastmiss, scheduled or not.
//
// counters[0] += uploads completed (admitted or dropped), counters[1] += uploads dropped,
// counters[2] += uploads wasted: dropped, or evicted before any lookup hit them.

#define SIM_SCAN_SLOTS 64

int32_t pybmoe_sim_layer_lru_admit(int64_t n_units, const int64_t * unit_start, const uint8_t * unit_flags,
                                   const int32_t * expert, int32_t n_expert, int32_t slots, int32_t cap,
                                   int32_t staging, int32_t window, int8_t * out, int64_t * counters) {
    if (n_units < 0 || n_expert <= 0 || slots < 1 || slots > n_expert || cap < 0 || staging < 0 || window < 0) {
        return SIM_EINVAL;
    }
    iheap h;
    int rc = iheap_init(&h, n_expert, slots);
    uint8_t * resident = calloc((size_t) n_expert, 1);
    int64_t * used     = calloc((size_t) n_expert, sizeof(int64_t));
    int64_t * missmark = calloc((size_t) n_expert, sizeof(int64_t)); // unit + 1 that listed e in misses
    int64_t * lastmiss = calloc((size_t) n_expert, sizeof(int64_t)); // the step e last missed at, 0 none
    uint8_t * gothit   = calloc((size_t) n_expert, 1);               // a resident hit since it landed
    int32_t * flight   = malloc(sizeof(int32_t) * (size_t) n_expert);
    int32_t * misses   = malloc(sizeof(int32_t) * (size_t) n_expert);
    int32_t * rs       = malloc(sizeof(int32_t) * (size_t) slots); // the residents, in no order (scan)
    const int scan     = slots <= SIM_SCAN_SLOTS;
    if (rc != SIM_OK || !resident || !used || !missmark || !lastmiss || !gothit || !flight || !misses || !rs) {
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
            memset(lastmiss, 0, sizeof(int64_t) * (size_t) n_expert);
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
                    out[i] = 1; // its heap key lags until it reaches the top (below)
                    gothit[e] = 1;
                } else {
                    out[i] = 0;
                    if (missmark[e] != u + 1) {
                        missmark[e] = u + 1;
                        const int64_t prev = lastmiss[e];
                        lastmiss[e] = step;
                        if (window == 0 || (prev > 0 && step - prev <= window)) {
                            misses[n_misses++] = e; // admitted: scheduled below
                        }
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
                // the victim: the least (used, id) among the residents
                int32_t v, j = 0;
                if (scan) {
                    int64_t best = used[rs[0]] * n_expert + rs[0];
                    for (int32_t x = 1; x < n_res; ++x) {
                        const int64_t k = used[rs[x]] * n_expert + rs[x];
                        j    = k < best ? x : j;
                        best = k < best ? k : best;
                    }
                    v = rs[j];
                } else {
                    // heap keys only lag (a hit raises used[] and leaves the heap as it is): a top
                    // whose key is current is the least; a top that lags gets its key and sinks
                    v = h.heap[0];
                    for (int64_t k = used[v] * n_expert + v; h.key[v] != k; k = used[v] * n_expert + v) {
                        h.key[v] = k;
                        iheap_down(&h, 0);
                        v = h.heap[0];
                    }
                }
                if (used[v] >= last_step) { // every resident was selected at the last step
                    counters[1]++;
                    counters[2]++;
                    continue;
                }
                counters[2] += !gothit[v];
                if (scan) {
                    rs[j] = rs[n_res - 1];
                } else {
                    iheap_pop(&h);
                }
                resident[v] = 0;
                n_res--;
            }
            resident[e] = 1;
            gothit[e]   = 0;
            if (scan) {
                rs[n_res] = e;
            } else {
                iheap_push(&h, e, used[e] * n_expert + e);
            }
            n_res++;
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
    free(resident); free(used); free(missmark); free(lastmiss); free(gothit); free(flight); free(misses); free(rs);
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
//   global-lru (last lookup: the event index)     fifo (unit it was admitted at, id)
//   lfu (units that needed it since admission, last unit, id)
//   belady (-next unit that needs it, id); the incoming entry is bypassed when its own next
//   use is no sooner than the victim's.
//   global-lru-scan: global-lru, but a unit that wants at least half of its layer's experts
//   (n_entries / n_layer) and whose distinct entries times n_layer exceed the capacity (a scan:
//   a pass of such units would flush the cache) admits its misses at the
//   minimum end, each below the last (the engine's llama_moe_lru scan guard); their repeated
//   lookups in the unit do not move them, the unit's hits of earlier residents move as in
//   global-lru.
//
// No heap: each policy keeps its residents in key order where the minimum is at hand (lists
// for global-lru and fifo, frequency buckets for lfu, next-use buckets under a bit tree for
// belady). The residents a unit needs (marked) keep their old place and key while the unit
// admits: the victim search walks up from the minimum with a cursor that skips marked entries
// (global-lru, fifo, lfu; belady's marked entries all sit in the current unit's bucket, below
// every other), so a unit costs about O(its lookups) whatever it evicts. After the unit its entries
// get their new keys, which lie above every other resident's (global-lru, fifo, lfu; in id
// order where they tie) or are placed by value (belady).
//
// counters[0] += entries admitted.

#define SIM_NEVER ((int64_t) 1 << 62)

typedef struct {
    uint8_t * resident;  // [n]
    int64_t * mark;      // [n] unit + 1 that needs it
    int64_t * first_ev;  // [n] event of its first lookup in that unit
    int32_t * buf;       // [n] a unit's admissions (fifo), kept in id order
} gstate;

static int gstate_init(gstate * g, int32_t n) {
    g->resident = calloc((size_t) n, 1);
    g->mark     = calloc((size_t) n, sizeof(int64_t));
    g->first_ev = calloc((size_t) n, sizeof(int64_t));
    g->buf      = malloc(sizeof(int32_t) * (size_t) n);
    return g->resident && g->mark && g->first_ev && g->buf ? SIM_OK : SIM_ENOMEM;
}

static void gstate_free(gstate * g) {
    free(g->resident); free(g->mark); free(g->first_ev); free(g->buf);
}

// pass 1: the cache as it was before the unit answers every lookup, and the unit's entries are
// marked; returns the unit's distinct entries (fewer than its lookups: an entry is looked up twice)
static inline int64_t unit_answer(gstate * g, int64_t b, int64_t end, const int32_t * entry, int64_t tag, int8_t * out) {
    int64_t n_distinct = 0;
    for (int64_t i = b; i < end; ++i) {
        const int32_t e = entry[i];
        if (g->mark[e] != tag) {
            g->mark[e]     = tag;
            g->first_ev[e] = i;
            n_distinct++;
        }
        out[i] = (int8_t) g->resident[e];
    }
    return n_distinct;
}

// pass 3 (T > 1 only): a repeated lookup of an entry admitted at this unit hits
static inline void unit_repeats(const gstate * g, int64_t b, int64_t end, const int32_t * entry, int8_t * out) {
    for (int64_t i = b; i < end; ++i) {
        const int32_t e = entry[i];
        if (out[i] == 0 && g->first_ev[e] != i && g->resident[e]) {
            out[i] = 1;
        }
    }
}

// e into g->buf [0, n), kept in id order (a unit's few entries)
static inline void sorted_put(gstate * g, int32_t n, int32_t e) {
    int32_t j = n;
    while (j > 0 && g->buf[j - 1] > e) {
        g->buf[j] = g->buf[j - 1];
        j--;
    }
    g->buf[j] = e;
}

// ---- global-lru and fifo: a doubly linked list in key order, node n_entries the sentinel

static inline void dl_unlink(int32_t * prv, int32_t * nxt, int32_t x) {
    nxt[prv[x]] = nxt[x];
    prv[nxt[x]] = prv[x];
}

// x into the list right after node p
static inline void dl_insert_after(int32_t * prv, int32_t * nxt, int32_t p, int32_t x) {
    const int32_t n = nxt[p];
    nxt[p] = x;
    prv[x] = p;
    nxt[x] = n;
    prv[n] = x;
}

// x at the maximum end (before the sentinel s)
static inline void dl_append(int32_t * prv, int32_t * nxt, int32_t s, int32_t x) {
    dl_insert_after(prv, nxt, prv[s], x);
}

// x at the minimum end (after the sentinel s)
static inline void dl_prepend(int32_t * prv, int32_t * nxt, int32_t s, int32_t x) {
    dl_insert_after(prv, nxt, s, x);
}

// the list's next victim from *cur (the list's minimum end when *cur < 0) on, skipping the entries unit `tag`
// needs: unlinked and no longer resident, *cur past it; 0 when there is none
static inline int list_evict(gstate * g, int32_t * prv, int32_t * nxt, int32_t S, int64_t tag, int32_t * cur) {
    if (*cur < 0) {
        *cur = nxt[S];
    }
    while (*cur != S && g->mark[*cur] == tag) { // needed by this unit: never evicted
        *cur = nxt[*cur];
    }
    if (*cur == S) {
        return 0;
    }
    const int32_t v = *cur;
    *cur = nxt[v];
    dl_unlink(prv, nxt, v);
    g->resident[v] = 0;
    return 1;
}

// is_lru: recency order (global-lru); scan: with the scan guard; n_layer: the layers of n_entries / n_layer
// experts each the entries span (the guard's and the lend's "half of its layer"); lend: entries a unit that
// wants less than half of its layer may hold beyond capacity (the engine's prefetch window, lent to decode);
// a unit that wants half or more first evicts from the minimum end, skipping its own entries, down to capacity
static int32_t sim_list(int is_lru, int scan_guard, int64_t n_layer, int64_t lend, int64_t n_units,
                        const int64_t * unit_start, const uint8_t * unit_flags, const int32_t * entry,
                        int32_t n_entries, int64_t capacity, int8_t * out, int64_t * counters) {
    gstate g;
    int rc = gstate_init(&g, n_entries);
    int32_t * prv = malloc(sizeof(int32_t) * ((size_t) n_entries + 1));
    int32_t * nxt = malloc(sizeof(int32_t) * ((size_t) n_entries + 1));
    if (rc != SIM_OK || !prv || !nxt) {
        rc = SIM_ENOMEM;
        goto done;
    }
    const int32_t S = n_entries;
    prv[S] = nxt[S] = S;
    int64_t n_res = 0;
    for (int64_t u = 0; u < n_units; ++u) {
        if (unit_flags[u] & SIM_RESET) {
            for (int32_t x = nxt[S]; x != S; x = nxt[x]) {
                g.resident[x] = 0;
            }
            prv[S] = nxt[S] = S;
            n_res = 0;
        }
        const int64_t b = unit_start[u], end = unit_start[u + 1];
        const int64_t tag = u + 1;
        const int64_t n_distinct = unit_answer(&g, b, end, entry, tag, out);
        const int dup = n_distinct < end - b;
        const int half = n_layer > 0 && 2 * n_distinct >= n_entries / n_layer;
        const int scan = scan_guard && half && n_distinct * n_layer > capacity;
        // the lend: a unit that wants half of its layer or more holds capacity entries, the others capacity + lend
        const int64_t cap = half ? capacity : (capacity + lend < n_entries ? capacity + lend : n_entries);
        int32_t cur = -1, n_adm = 0;
        while (n_res > cap && list_evict(&g, prv, nxt, S, tag, &cur)) {
            n_res--;
        }
        // pass 2: admit the missed entries in order of first appearance
        for (int64_t i = b; i < end && cap > 0; ++i) {
            const int32_t e = entry[i];
            if (out[i] != 0 || g.first_ev[e] != i) {
                continue;
            }
            if (n_res >= cap) {
                if (!list_evict(&g, prv, nxt, S, tag, &cur)) {
                    continue; // no victim: bypassed, all its lookups in this unit miss
                }
                n_res--;
            }
            g.resident[e] = 1;
            n_res++;
            counters[0]++;
            if (scan) {
                dl_prepend(prv, nxt, S, e); // at the minimum end, below the unit's earlier admissions
            } else if (is_lru) {
                dl_append(prv, nxt, S, e); // its place is set below
            } else {
                sorted_put(&g, n_adm++, e);
            }
        }
        if (dup) {
            unit_repeats(&g, b, end, entry, out);
        }
        if (is_lru) {
            // recency per lookup, in rank order: each lookup of a resident entry takes it to the tail
            for (int64_t i = b; i < end; ++i) {
                const int32_t e = entry[i];
                if (scan && out[g.first_ev[e]] == 0) {
                    continue; // admitted by this scan (its first lookup missed): it stays at the minimum end
                }
                if (g.resident[e] && nxt[e] != S) {
                    dl_unlink(prv, nxt, e);
                    dl_append(prv, nxt, S, e);
                }
            }
        } else {
            for (int32_t j = 0; j < n_adm; ++j) { // admitted at one unit: in id order
                dl_append(prv, nxt, S, g.buf[j]);
            }
        }
    }
done:
    gstate_free(&g);
    free(prv); free(nxt);
    return rc;
}

// ---- lfu: buckets of equal frequency in a list by frequency (a pool of at most capacity + 2
// nodes, node capacity + 1 the sentinel); in a bucket, entries in (last unit, id) order

typedef struct {
    int64_t f;        // frequency (-1: the sentinel)
    int32_t h, t;     // first and last entry, -1 none
    int32_t n, p;     // next and previous bucket (n: also the free list)
} lfu_bucket;

typedef struct {
    int32_t n, p;     // next and previous entry in its bucket, -1 none
    int32_t b;        // its bucket
    int32_t pad_;
    int64_t lastu;    // the last unit that needed it
} lfu_entry;

typedef struct {
    lfu_bucket * bk;
    lfu_entry  * en;
    int32_t      s, free_;  // sentinel, first free node
} lfu_t;

static void lfu_reset(lfu_t * q, int32_t n_nodes) {
    q->s = n_nodes - 1;
    q->bk[q->s].n = q->bk[q->s].p = q->s;
    q->bk[q->s].f = -1; // no frequency: the tests below need not look for the sentinel
    q->free_ = -1;
    for (int32_t b = n_nodes - 2; b >= 0; --b) {
        q->bk[b].n = q->free_;
        q->free_ = b;
    }
}

// the bucket of frequency f right after bucket `after`, made if there is none
static inline int32_t lfu_bucket_after(lfu_t * q, int32_t after, int64_t f) {
    const int32_t nb = q->bk[after].n;
    if (q->bk[nb].f == f) {
        return nb;
    }
    const int32_t b = q->free_;
    lfu_bucket * k = &q->bk[b];
    q->free_ = k->n;
    k->f = f;
    k->h = k->t = -1;
    k->p = after;
    k->n = nb;
    q->bk[after].n = b;
    q->bk[nb].p = b;
    return b;
}

static inline void lfu_remove(lfu_t * q, int32_t e) {
    const lfu_entry * x = &q->en[e];
    lfu_bucket * k = &q->bk[x->b];
    if (x->p >= 0) q->en[x->p].n = x->n; else k->h = x->n;
    if (x->n >= 0) q->en[x->n].p = x->p; else k->t = x->p;
    if (k->h < 0) { // empty: back to the free list
        q->bk[k->p].n = k->n;
        q->bk[k->n].p = k->p;
        k->n = q->free_;
        q->free_ = x->b;
    }
}

// e into bucket b after its entry t (-1: first)
static inline void lfu_insert_after(lfu_t * q, int32_t b, int32_t t, int32_t e) {
    lfu_bucket * k = &q->bk[b];
    lfu_entry * x = &q->en[e];
    const int32_t n = t >= 0 ? q->en[t].n : k->h;
    x->p = t;
    x->n = n;
    x->b = b;
    if (t >= 0) q->en[t].n = e; else k->h = e;
    if (n >= 0) q->en[n].p = e; else k->t = e;
}

static int32_t sim_lfu(int64_t n_units, const int64_t * unit_start, const uint8_t * unit_flags, const int32_t * entry,
                       int32_t n_entries, int64_t capacity, int8_t * out, int64_t * counters) {
    if (capacity > INT32_MAX - 2) {
        return SIM_EINVAL;
    }
    gstate g;
    int rc = gstate_init(&g, n_entries);
    const int32_t n_nodes = (int32_t) capacity + 2;
    lfu_t q;
    q.bk = malloc(sizeof(lfu_bucket) * (size_t) n_nodes);
    q.en = malloc(sizeof(lfu_entry) * (size_t) n_entries);
    if (rc != SIM_OK || !q.bk || !q.en) {
        rc = SIM_ENOMEM;
        goto done;
    }
    lfu_reset(&q, n_nodes);
    int64_t n_res = 0;
    for (int64_t u = 0; u < n_units; ++u) {
        if (unit_flags[u] & SIM_RESET) {
            memset(g.resident, 0, (size_t) n_entries);
            lfu_reset(&q, n_nodes);
            n_res = 0;
        }
        const int64_t b = unit_start[u], end = unit_start[u + 1];
        const int64_t tag = u + 1;
        const int dup = unit_answer(&g, b, end, entry, tag, out) < end - b;
        // pass 2: admit the missed entries in order of first appearance; the cursor: entry cx of bucket cb
        int32_t cb = -1, cx = -1;
        for (int64_t i = b; i < end && capacity > 0; ++i) {
            const int32_t e = entry[i];
            if (out[i] != 0 || g.first_ev[e] != i) {
                continue;
            }
            if (n_res == capacity) {
                if (cb < 0) {
                    cb = q.bk[q.s].n;
                    cx = cb == q.s ? -1 : q.bk[cb].h;
                }
                while (cb != q.s) {
                    if (cx < 0) {
                        cb = q.bk[cb].n;
                        cx = cb == q.s ? -1 : q.bk[cb].h;
                    } else if (g.mark[cx] == tag) { // needed by this unit: never evicted
                        cx = q.en[cx].n;
                    } else {
                        break;
                    }
                }
                if (cb == q.s) {
                    continue; // bypassed
                }
                const int32_t v = cx, nx = q.en[v].n, nb = q.bk[cb].n;
                lfu_remove(&q, v);
                if (nx >= 0) {
                    cx = nx;
                } else {
                    cb = nb;
                    cx = cb == q.s ? -1 : q.bk[cb].h;
                }
                g.resident[v] = 0;
                n_res--;
            }
            g.resident[e] = 1;
            n_res++;
            counters[0]++;
        }
        if (dup) {
            unit_repeats(&g, b, end, entry, out);
        }
        // the unit's entries get their new keys (frequency + 1, or 1 when admitted; this unit; id),
        // each at the end of its bucket, after the others of this unit there of lower id
        for (int64_t i = b; i < end; ++i) {
            const int32_t e = entry[i];
            if (g.first_ev[e] != i || !g.resident[e]) {
                continue;
            }
            lfu_entry * x = &q.en[e];
            int32_t nb;
            if (out[i] != 1) {
                nb = lfu_bucket_after(&q, q.s, 1);
            } else {
                lfu_bucket * ob = &q.bk[x->b];
                const int64_t f = ob->f + 1;
                if ((ob->h == e) & (ob->t == e) & (q.bk[ob->n].f != f)) {
                    ob->f = f; // alone in its bucket, and no bucket of f yet: the bucket moves up
                    x->lastu = u;
                    continue;
                }
                nb = lfu_bucket_after(&q, x->b, f);
                lfu_remove(&q, e);
            }
            x->lastu = u;
            int32_t t = q.bk[nb].t;
            while (t >= 0 && q.en[t].lastu == u && t > e) {
                t = q.en[t].p;
            }
            lfu_insert_after(&q, nb, t, e);
        }
    }
done:
    gstate_free(&g);
    free(q.bk); free(q.en);
    return rc;
}

// ---- belady: residents are kept by next use. Those needed again by a later unit v sit in the
// bucket of v (a singly linked list, unsorted: a bucket holds at most the entries unit v looks
// up), the non-empty buckets in a bit tree (the furthest at hand); those never needed again are
// in a second bit tree over entries (the lowest id at hand). Every resident is needed at the
// current unit u or later, and those needed at u (the marked ones) are the bucket of u, the
// lowest: so the victim is the lowest id never needed again, else the lowest id of the furthest
// bucket, unless that is u's (no victim).

// a bit set with a summary word per 64 words, and so on up to one word: the lowest or the
// highest set bit in O(levels)
typedef struct {
    uint64_t * w[7];     // level k: bit j says whether word j of level k - 1 is not zero
    int32_t    levels;
} bitree;

static int bitree_init(bitree * t, int64_t n_bits) {
    int64_t n = n_bits > 0 ? n_bits : 1;
    t->levels = 0;
    do {
        n = (n + 63) / 64;
        t->w[t->levels] = calloc((size_t) n, sizeof(uint64_t));
        if (!t->w[t->levels++]) {
            return SIM_ENOMEM;
        }
    } while (n > 1 && t->levels < 7);
    return n == 1 ? SIM_OK : SIM_EINVAL;
}

static void bitree_free(bitree * t) {
    for (int32_t k = 0; k < t->levels; ++k) {
        free(t->w[k]);
    }
}

static inline void bitree_set(bitree * t, int64_t i) {
    for (int32_t k = 0; k < t->levels; ++k) {
        uint64_t * w = &t->w[k][i >> 6];
        const uint64_t was = *w;
        *w = was | ((uint64_t) 1 << (i & 63));
        if (was) {
            break; // the levels above know already
        }
        i >>= 6;
    }
}

static inline void bitree_unset(bitree * t, int64_t i) {
    for (int32_t k = 0; k < t->levels; ++k) {
        uint64_t * w = &t->w[k][i >> 6];
        *w &= ~((uint64_t) 1 << (i & 63));
        if (*w) {
            break;
        }
        i >>= 6;
    }
}

static inline int64_t bitree_max(const bitree * t) {
    const uint64_t top = t->w[t->levels - 1][0];
    if (!top) {
        return -1;
    }
    int64_t i = 63 - __builtin_clzll(top);
    for (int32_t k = t->levels - 2; k >= 0; --k) {
        i = i * 64 + (63 - __builtin_clzll(t->w[k][i]));
    }
    return i;
}

// unset every bit: O(bits set), not O(size), for streams that reset often
static void bitree_clear(bitree * t) {
    for (int64_t x = bitree_max(t); x >= 0; x = bitree_max(t)) {
        bitree_unset(t, x);
    }
}

static inline int64_t bitree_min(const bitree * t) {
    const uint64_t top = t->w[t->levels - 1][0];
    if (!top) {
        return -1;
    }
    int64_t i = __builtin_ctzll(top);
    for (int32_t k = t->levels - 2; k >= 0; --k) {
        i = i * 64 + __builtin_ctzll(t->w[k][i]);
    }
    return i;
}

static int32_t sim_belady(int64_t n_units, const int64_t * unit_start, const uint8_t * unit_flags,
                          const int32_t * entry, int32_t n_entries, int64_t capacity, int8_t * out,
                          int64_t * counters) {
    const int64_t n_events = n_units > 0 ? unit_start[n_units] : 0;
    gstate g;
    int rc = gstate_init(&g, n_entries);
    // per event: the next unit of the same stream that needs its entry (SIM_NEVER: none)
    int64_t * next  = malloc(sizeof(int64_t) * (size_t) (n_events > 0 ? n_events : 1));
    int64_t * seen  = malloc(sizeof(int64_t) * (size_t) n_entries);
    // the bucket of unit v: its first entry (valid while bit v is set), then enx[] (-1: the last)
    int32_t * bhead = malloc(sizeof(int32_t) * (size_t) (n_units > 0 ? n_units : 1));
    int32_t * enx   = malloc(sizeof(int32_t) * (size_t) n_entries);
    bitree used = { 0 }, never = { 0 };
    if (rc == SIM_OK && next && seen && bhead && enx) {
        rc = bitree_init(&used, n_units);
        if (rc == SIM_OK) {
            rc = bitree_init(&never, n_entries);
        }
    } else {
        rc = SIM_ENOMEM;
    }
    if (rc != SIM_OK) {
        goto done;
    }
    // backwards over each stream: seen[e] = the earliest later unit needing e
    {
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
            memset(g.resident, 0, (size_t) n_entries);
            bitree_clear(&used);
            bitree_clear(&never);
            n_res = 0;
        }
        const int64_t b = unit_start[u], end = unit_start[u + 1];
        const int64_t tag = u + 1;
        const int dup = unit_answer(&g, b, end, entry, tag, out) < end - b;
        // pass 2: admit the missed entries in order of first appearance
        for (int64_t i = b; i < end && capacity > 0; ++i) {
            const int32_t e = entry[i];
            if (out[i] != 0 || g.first_ev[e] != i) {
                continue;
            }
            if (n_res == capacity) {
                const int64_t vn = bitree_min(&never);
                if (vn >= 0) {
                    if (next[i] == SIM_NEVER) {
                        continue; // the incoming entry is never needed again either: bypassed
                    }
                    bitree_unset(&never, vn);
                    g.resident[vn] = 0;
                } else {
                    const int64_t vb = bitree_max(&used);
                    if (vb <= u) {
                        continue; // every resident is needed by this unit: bypassed
                    }
                    if (next[i] >= vb) {
                        continue; // the incoming entry is the one needed furthest away: bypassed
                    }
                    int32_t * best = &bhead[vb];
                    for (int32_t * p = &enx[*best]; *p >= 0; p = &enx[*p]) {
                        best = *p < *best ? p : best;
                    }
                    const int32_t v = *best;
                    *best = enx[v];
                    if (bhead[vb] < 0) {
                        bitree_unset(&used, vb);
                    }
                    g.resident[v] = 0;
                }
                n_res--;
            }
            g.resident[e] = 1;
            n_res++;
            counters[0]++;
        }
        if (dup) {
            unit_repeats(&g, b, end, entry, out);
        }
        // the unit's entries leave the bucket of u (all of it) for the bucket of their next use
        bitree_unset(&used, u);
        for (int64_t i = b; i < end; ++i) {
            const int32_t e = entry[i];
            if (g.first_ev[e] != i || !g.resident[e]) {
                continue;
            }
            const int64_t nu = next[i];
            if (nu == SIM_NEVER) {
                bitree_set(&never, e);
            } else if (used.w[0][nu >> 6] >> (nu & 63) & 1) {
                enx[e] = bhead[nu];
                bhead[nu] = e;
            } else {
                enx[e] = -1;
                bhead[nu] = e;
                bitree_set(&used, nu);
            }
        }
    }
done:
    gstate_free(&g);
    bitree_free(&used); bitree_free(&never);
    free(next); free(seen); free(bhead); free(enx);
    return rc;
}

// n_layer: the layers the entries span (global-lru-scan's guard and the lend; the others ignore it);
// lend: the engine's prefetch window, entries lent to the units that want less than half of their layer
// (global-lru and global-lru-scan only; 0 for the others)
int32_t pybmoe_sim_global(int32_t policy, int64_t n_units, const int64_t * unit_start, const uint8_t * unit_flags,
                          const int32_t * entry, int32_t n_entries, int64_t capacity, int32_t n_layer, int64_t lend,
                          int8_t * out, int64_t * counters) {
    const int is_list_lru = policy == SIM_GLOBAL_LRU || policy == SIM_GLOBAL_LRU_SCAN;
    if (policy < SIM_GLOBAL_LRU || policy > SIM_GLOBAL_LRU_SCAN || n_units < 0 || n_entries <= 0 || capacity < 0 ||
        lend < 0 || (lend > 0 && !is_list_lru) || ((policy == SIM_GLOBAL_LRU_SCAN || lend > 0) && n_layer < 1)) {
        return SIM_EINVAL;
    }
    if (capacity > n_entries) {
        capacity = n_entries;
    }
    const int64_t * st = unit_start;
    const uint8_t * fl = unit_flags;
    switch (policy) {
        case SIM_GLOBAL_LRU:
            return sim_list(1, 0, lend > 0 ? n_layer : 0, lend, n_units, st, fl, entry, n_entries, capacity, out, counters);
        case SIM_GLOBAL_LRU_SCAN:
            return sim_list(1, 1, n_layer, lend, n_units, st, fl, entry, n_entries, capacity, out, counters);
        case SIM_FIFO:
            return sim_list(0, 0, 0, 0, n_units, st, fl, entry, n_entries, capacity, out, counters);
        case SIM_LFU:        return sim_lfu(n_units, st, fl, entry, n_entries, capacity, out, counters);
        default:             return sim_belady(n_units, st, fl, entry, n_entries, capacity, out, counters);
    }
}

// ---------------------------------------------------------------- the pool (docs/expert-cache.md, "The pool")
//
// One bank of `capacity` slots over (layer, expert) entries, entry = layer * n_expert + expert. Units are layer
// steps in forward order; SIM_STEP marks the first unit of a ubatch, unit_tokens[u] its tokens (the ClassLRU
// clock). Two timings:
//   sync (0), the engine's: a served ubatch's lookups see the residents as they were before it (used[x] = the
//     step); right after every ubatch, served or not, the uploads scheduled after the previous one settle in
//     order (a full bank evicts a victim among the residents not selected at the last served step, or drops the
//     upload when there is none), then the ubatch's distinct misses (first appearance, layer-major) are
//     scheduled while in flight < staging + free slots. A miss at step s is resident from s + 2.
//   instant (1), upstream's: each layer step's lookups are answered, then its distinct misses are admitted in
//     order of first appearance, each evicting a victim the step does not need (none: bypassed); a repeated
//     lookup of an admitted entry hits; recency per lookup (used[x] = the event index).
// Victims, among the candidates the guard allows (an entry of the incoming entry's own layer, or of a layer
// holding more than `floor` entries; only the own layer's when that layer holds `cap`, 0 = no cap; when there
// is none and the incoming entry's layer holds fewer than `floor`, an entry of a layer holding more than
// `floor`, the protection notwithstanding):
//   lru (0): the least (used, entry);
//   classlru (1): the largest age / 2^class, age = clock - the clock at its last use (tokens), class =
//     floor(log2(CRF)) at its last use, at most SIM_CRF_CLASSES - 1; CRF = uses decayed with a half-life of
//     SIM_CRF_HALF_LIFE tokens, kept across evictions, fixed point with SIM_CRF_FRAC fraction bits; ties: lru.
// The residents are an unordered array scanned for each victim: O(capacity) per eviction.
//
// counters[0] += uploads (sync: completed, dropped included; instant: admissions), [1] += dropped,
// [2] += wasted (sync: dropped, or evicted before any hit).

#define SIM_STEP 4
#define SIM_CRF_HALF_LIFE 128
#define SIM_CRF_CLASSES 8
#define SIM_CRF_FRAC 24

// 2^30 * 2^(-j / 128), rounded (lru_oracle.CRF_DECAY computes it; the tests compare the two)
static const uint32_t sim_crf_decay[SIM_CRF_HALF_LIFE] = {
    1073741824u, 1067942999u, 1062175491u, 1056439131u, 1050733751u, 1045059183u, 1039415261u, 1033801819u,
    1028218693u, 1022665720u, 1017142735u, 1011649578u, 1006186087u, 1000752102u, 995347464u, 989972014u,
    984625594u, 979308048u, 974019220u, 968758955u, 963527098u, 958323496u, 953147997u, 948000448u,
    942880699u, 937788600u, 932724001u, 927686753u, 922676710u, 917693724u, 912737649u, 907808339u,
    902905651u, 898029440u, 893179563u, 888355878u, 883558244u, 878786521u, 874040567u, 869320244u,
    864625413u, 859955938u, 855311680u, 850692504u, 846098274u, 841528855u, 836984114u, 832463917u,
    827968132u, 823496627u, 819049271u, 814625932u, 810226483u, 805850792u, 801498734u, 797170178u,
    792865000u, 788583072u, 784324269u, 780088465u, 775875538u, 771685363u, 767517817u, 763372778u,
    759250125u, 755149737u, 751071493u, 747015274u, 742980960u, 738968435u, 734977579u, 731008277u,
    727060411u, 723133865u, 719228525u, 715344277u, 711481005u, 707638598u, 703816941u, 700015924u,
    696235434u, 692475362u, 688735596u, 685016026u, 681316545u, 677637043u, 673977412u, 670337545u,
    666717336u, 663116678u, 659535466u, 655973594u, 652430958u, 648907455u, 645402981u, 641917433u,
    638450708u, 635002706u, 631573326u, 628162466u, 624770026u, 621395908u, 618040012u, 614702239u,
    611382493u, 608080675u, 604796689u, 601530438u, 598281827u, 595050760u, 591837143u, 588640881u,
    585461881u, 582300049u, 579155293u, 576027521u, 572916640u, 569822560u, 566745190u, 563684439u,
    560640218u, 557612438u, 554601009u, 551605844u, 548626854u, 545663953u, 542717053u, 539786068u,
};

// Only tests/routing/test_pool.py calls this: the table above is written out as literals, and the
// replays reach only the ages their traces happen to have, so the test reads all 128 entries here.
uint32_t pybmoe_sim_crf_decay(int32_t j) {
    return j >= 0 && j < SIM_CRF_HALF_LIFE ? sim_crf_decay[j] : 0;
}

static inline uint64_t crf_use(uint64_t crf, int64_t age) {
    if (crf && age > 0) {
        const int64_t halvings = age / SIM_CRF_HALF_LIFE;
        crf = (crf * sim_crf_decay[age % SIM_CRF_HALF_LIFE]) >> 30;
        crf = halvings >= 63 ? 0 : crf >> halvings;
    }
    return crf + ((uint64_t) 1 << SIM_CRF_FRAC);
}

static inline uint8_t crf_class(uint64_t crf) {
    const int c = 63 - __builtin_clzll(crf) - SIM_CRF_FRAC;
    return (uint8_t) (c < SIM_CRF_CLASSES - 1 ? c : SIM_CRF_CLASSES - 1);
}

typedef struct {
    int32_t   n_expert, floor, cap, key;
    int64_t   capacity, n_res, clock;
    uint8_t * resident; // [n_entries]
    int32_t * pos;      // [n_entries] its place in rs
    int32_t * rs;       // [capacity] the residents, unordered
    int32_t * cnt;      // [n_layer] residents per layer
    int64_t * used;     // [n_entries] sync: the served step of its last lookup; instant: that lookup's event
    int64_t * mark;     // [n_entries] tag of the unit (instant) or ubatch (sync) that looked it up
    int64_t * first_ev; // [n_entries] its first event in that unit (instant)
    uint64_t * crf;     // [n_entries] 0: never used
    int64_t * last;     // [n_entries] the clock at its last use
    uint8_t * cls;      // [n_entries]
    uint8_t * gothit;   // [n_entries] a hit since it landed (sync)
    int32_t * flight;   // [n_entries]
    int32_t * misses;   // [n_entries]
} pool_t;

static inline void pool_touch(pool_t * p, int32_t x) {
    const uint64_t c = crf_use(p->crf[x], p->clock - (p->crf[x] ? p->last[x] : p->clock));
    p->crf[x]  = c;
    p->last[x] = p->clock;
    p->cls[x]  = crf_class(c);
}

static inline int pool_full_for(const pool_t * p, int32_t x) {
    return p->n_res >= p->capacity || (p->cap > 0 && p->cnt[x / p->n_expert] >= p->cap);
}

// whether y goes before b as the victim
static inline int pool_before(const pool_t * p, int32_t y, int32_t b) {
    if (p->key == 1) {
        const int64_t sy = (p->clock - p->last[y]) << p->cls[b];
        const int64_t sb = (p->clock - p->last[b]) << p->cls[y];
        if (sy != sb) {
            return sy > sb;
        }
    }
    return p->used[y] < p->used[b] || (p->used[y] == p->used[b] && y < b);
}

// the victim for x: sync protects the residents used at step `guard_v` or later, instant those marked `guard_v`
static int32_t pool_victim(const pool_t * p, int32_t x, int sync, int64_t guard_v) {
    const int32_t lx  = x / p->n_expert;
    const int     own = p->cap > 0 && p->cnt[lx] >= p->cap;
    int32_t best = -1;
    for (int64_t j = 0; j < p->n_res; ++j) {
        const int32_t y = p->rs[j];
        if (sync ? p->used[y] >= guard_v : p->mark[y] == guard_v) {
            continue;
        }
        const int32_t ly = y / p->n_expert;
        if (ly != lx && (own || p->cnt[ly] <= p->floor)) {
            continue;
        }
        if (best < 0 || pool_before(p, y, best)) {
            best = y;
        }
    }
    if (best < 0 && p->cnt[lx] < p->floor) {
        // under its floor: a layer over its floor gives, even an entry selected at the last step
        for (int64_t j = 0; j < p->n_res; ++j) {
            const int32_t y  = p->rs[j];
            const int32_t ly = y / p->n_expert;
            if (ly != lx && p->cnt[ly] > p->floor && (best < 0 || pool_before(p, y, best))) {
                best = y;
            }
        }
    }
    return best;
}

static inline void pool_evict(pool_t * p, int32_t v) {
    const int32_t j = p->pos[v];
    p->rs[j] = p->rs[p->n_res - 1];
    p->pos[p->rs[j]] = j;
    p->n_res--;
    p->resident[v] = 0;
    p->gothit[v] = 0;
    p->cnt[v / p->n_expert]--;
}

static inline void pool_admit(pool_t * p, int32_t x) {
    p->pos[x] = (int32_t) p->n_res;
    p->rs[p->n_res++] = x;
    p->resident[x] = 1;
    p->gothit[x] = 0;
    p->cnt[x / p->n_expert]++;
}

int32_t pybmoe_sim_pool(int32_t timing, int32_t key, int64_t n_units, const int64_t * unit_start,
                        const uint8_t * unit_flags, const int32_t * unit_tokens, const int32_t * entry,
                        int32_t n_layer, int32_t n_expert, int64_t capacity, int32_t floor, int32_t cap,
                        int64_t staging, int8_t * out, int64_t * counters) {
    if (timing < 0 || timing > 1 || key < 0 || key > 1 || n_units < 0 || n_layer <= 0 || n_expert <= 0 ||
        (int64_t) n_layer * n_expert > INT32_MAX || capacity < 0 || floor < 0 || cap < 0 || staging < 0) {
        return SIM_EINVAL;
    }
    const int32_t n = n_layer * n_expert;
    if (capacity > n) {
        capacity = n;
    }
    pool_t p = { .n_expert = n_expert, .floor = floor, .cap = cap, .key = key, .capacity = capacity };
    p.resident = calloc((size_t) n, 1);
    p.pos      = calloc((size_t) n, sizeof(int32_t));
    p.rs       = malloc(sizeof(int32_t) * (size_t) (capacity > 0 ? capacity : 1));
    p.cnt      = calloc((size_t) n_layer, sizeof(int32_t));
    p.used     = calloc((size_t) n, sizeof(int64_t));
    p.mark     = calloc((size_t) n, sizeof(int64_t));
    p.first_ev = calloc((size_t) n, sizeof(int64_t));
    p.crf      = calloc((size_t) n, sizeof(uint64_t));
    p.last     = calloc((size_t) n, sizeof(int64_t));
    p.cls      = calloc((size_t) n, 1);
    p.gothit   = calloc((size_t) n, 1);
    p.flight   = malloc(sizeof(int32_t) * (size_t) n);
    p.misses   = malloc(sizeof(int32_t) * (size_t) n);
    int32_t rc = SIM_OK;
    if (!p.resident || !p.pos || !p.rs || !p.cnt || !p.used || !p.mark || !p.first_ev || !p.crf || !p.last ||
        !p.cls || !p.gothit || !p.flight || !p.misses) {
        rc = SIM_ENOMEM;
        goto done;
    }
    int64_t n_flight = 0, n_misses = 0, step = 0, last_step = 0;
    for (int64_t u = 0; u < n_units;) {
        if (unit_flags[u] & SIM_RESET) {
            memset(p.resident, 0, (size_t) n);
            memset(p.cnt, 0, sizeof(int32_t) * (size_t) n_layer);
            memset(p.used, 0, sizeof(int64_t) * (size_t) n);
            memset(p.crf, 0, sizeof(uint64_t) * (size_t) n);
            memset(p.gothit, 0, (size_t) n);
            p.n_res = p.clock = 0;
            n_flight = n_misses = step = last_step = 0;
        }
        if (timing == 1) { // ---- instant: one layer step
            if (unit_flags[u] & SIM_STEP) {
                p.clock += unit_tokens[u];
            }
            const int64_t b = unit_start[u], end = unit_start[u + 1], tag = u + 1;
            const uint8_t fl = unit_flags[u];
            u++;
            if (!(fl & SIM_SERVED)) {
                memset(out + b, -1, (size_t) (end - b));
                continue;
            }
            for (int64_t i = b; i < end; ++i) {
                const int32_t x = entry[i];
                if (p.mark[x] != tag) {
                    p.mark[x]     = tag;
                    p.first_ev[x] = i;
                }
                out[i] = (int8_t) p.resident[x];
            }
            for (int64_t i = b; i < end; ++i) {
                const int32_t x = entry[i];
                if (p.first_ev[x] != i || p.resident[x]) {
                    continue;
                }
                if (pool_full_for(&p, x)) {
                    const int32_t v = pool_victim(&p, x, 0, tag);
                    if (v < 0) {
                        continue; // bypassed: all its lookups in this step miss
                    }
                    pool_evict(&p, v);
                }
                pool_admit(&p, x);
                counters[0]++;
            }
            for (int64_t i = b; i < end; ++i) {
                const int32_t x = entry[i];
                if (p.resident[x]) {
                    if (p.first_ev[x] != i) {
                        out[i] = 1; // a repeat of an admitted entry hits
                    }
                    p.used[x] = i;
                }
            }
            if (key == 1) {
                for (int64_t i = b; i < end; ++i) {
                    if (p.first_ev[entry[i]] == i) {
                        pool_touch(&p, entry[i]);
                    }
                }
            }
            continue;
        }
        // ---- sync: one ubatch, units u .. v - 1
        int64_t v = u + 1;
        while (v < n_units && !(unit_flags[v] & SIM_STEP)) {
            v++;
        }
        const int64_t b = unit_start[u], end = unit_start[v], tag = u + 1;
        n_misses = 0;
        if (unit_flags[u] & SIM_SERVED) {
            last_step = ++step;
            p.clock += unit_tokens[u];
            for (int64_t i = b; i < end; ++i) {
                const int32_t x = entry[i];
                const int first = p.mark[x] != tag;
                p.mark[x] = tag;
                p.used[x] = step;
                if (p.resident[x]) {
                    out[i] = 1;
                    p.gothit[x] = 1;
                } else {
                    out[i] = 0;
                    if (first) {
                        p.misses[n_misses++] = x;
                    }
                }
                if (first && key == 1) {
                    pool_touch(&p, x);
                }
            }
        } else {
            memset(out + b, -1, (size_t) (end - b));
        }
        // after the ubatch: the uploads scheduled after the previous one settle
        for (int64_t j = 0; j < n_flight; ++j) {
            const int32_t x = p.flight[j];
            counters[0]++;
            if (pool_full_for(&p, x)) {
                const int32_t vt = pool_victim(&p, x, 1, last_step);
                if (vt < 0) {
                    counters[1]++;
                    counters[2]++;
                    continue;
                }
                counters[2] += !p.gothit[vt];
                pool_evict(&p, vt);
            }
            pool_admit(&p, x);
        }
        n_flight = 0;
        // then this ubatch's misses are scheduled
        for (int64_t j = 0; j < n_misses; ++j) {
            const int32_t x = p.misses[j];
            if (p.resident[x]) {
                continue;
            }
            if (n_flight == staging + (p.capacity - p.n_res)) {
                break;
            }
            p.flight[n_flight++] = x;
        }
        u = v;
    }
done:
    free(p.resident); free(p.pos); free(p.rs); free(p.cnt); free(p.used); free(p.mark); free(p.first_ev);
    free(p.crf); free(p.last); free(p.cls); free(p.gothit); free(p.flight); free(p.misses);
    return rc;
}
