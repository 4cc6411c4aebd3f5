// pybmoe: the stream tier's graph op, stats and resize. See llama-moe-stream.h.
//
// Holds: what happens in a layer step (admit, release, read) and the tier's counters and C API.
// Must not hold: sizing and start-up (llama-moe-stream-init.cpp), the policy's rules
// (llama-moe-residency.cpp) or read mechanics (llama-moe-source.cpp).

#include "llama-moe-kv.h"
#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#if !defined(_WIN32)
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#endif

static long llama_moe_major_faults() {
#if defined(_WIN32)
    return 0;
#else
    rusage ru = {};
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_majflt;
#endif
}

void llama_moe_stream::unmap() {
    std::string err;
    reader.wait(err); // no lane may still read into a reservation (a step's reads, a prefetch)
    finish_waves();
    prefetch_li = -1;
    inflight.forget();
#if !defined(_WIN32)
    for (auto & l : layers) {
        for (int p = 0; p < l.n_proj; ++p) {
            if (l.region[p]) {
                munmap(l.region[p], l.region_bytes[p]);
                l.region[p] = nullptr;
            }
        }
    }
#endif
    for (auto & f : frames) {
        f.close();
    }
}

// the stream op's flag "the VRAM tier serves this step" lives in the last int of the node's op_params,
// past the custom op's own parameters (function, task count, user data: 24 bytes on 64-bit), so that
// each graph carries its own answer: llama_moe_cache_graph_layer sets it, after the op is built
static constexpr int LLAMA_MOE_STREAM_SERVED_PARAM = GGML_MAX_OP_PARAMS / sizeof(int32_t) - 1;
static_assert(2 * sizeof(void *) + sizeof(int) + sizeof(void *) <= LLAMA_MOE_STREAM_SERVED_PARAM * sizeof(int32_t),
        "the custom op's parameters reach the stream op's flag");

static void llama_moe_stream_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto * op = (llama_moe_stream_layer::op_data *) userdata;
    op->tier->step(op->li, a, dst->op_params[LLAMA_MOE_STREAM_SERVED_PARAM] != 0);
    // the ids pass through unchanged: the MUL_MAT_IDs that read them now run after the reads
    for (int64_t r = 0; r < a->ne[1]; ++r) {
        for (int64_t k = 0; k < a->ne[0]; ++k) {
            *(int32_t *) ((char *) dst->data + r*dst->nb[1] + k*dst->nb[0]) =
                *(const int32_t *) ((const char *) a->data + r*a->nb[1] + k*a->nb[0]);
        }
    }
}

ggml_tensor * llama_moe_stream::graph_ids(ggml_context * ctx, ggml_tensor * selected, int il) {
    if (index_of(il) < 0) {
        return selected;
    }
    auto & l = layers[index_of(il)];
    l.op = { this, l.li };
    ggml_tensor * out = ggml_map_custom1(ctx, selected, llama_moe_stream_op, 1, &l.op);
    ggml_format_name(out, "blk.%d.ffn_moe_stream", il);
    // not served by the VRAM tier until llama_moe_cache_graph_layer says so: a stock step (a prefill, a
    // batch over the max batch, LoRA) computes every expert on the host, device residents too
    out->op_params[LLAMA_MOE_STREAM_SERVED_PARAM] = 0;
    return out;
}

void llama_moe_stream_mark_vram_served(ggml_tensor * ids) {
    if (ids != nullptr && ids->op == GGML_OP_MAP_CUSTOM1 && strstr(ids->name, ".ffn_moe_stream") != nullptr) {
        ids->op_params[LLAMA_MOE_STREAM_SERVED_PARAM] = 1;
    }
}

int32_t llama_moe_stream::pin(int32_t il, int32_t e, const void * mem[LLAMA_MOE_N_PROJ]) {
    if (index_of(il) < 0) {
        return -1;
    }
    const auto & l = layers[index_of(il)];
    const int32_t entry = l.li * lru.n_expert + e;
    std::lock_guard<std::mutex> lock(mutex);
    if (!lru.resident[entry]) {
        return -1;
    }
    for (int p = 0; overlap && p < l.n_proj; ++p) {
        if (inflight.busy(entry, p)) {
            return -1; // admitted, its bytes still on their way: read it from the file
        }
    }
    if (pins.empty()) {
        pins.assign(lru.resident.size(), 0);
    }
    pins[entry]++;
    for (int p = 0; p < l.n_proj; ++p) {
        mem[p] = l.base[p] + (size_t) e * l.expert_nbytes[p];
    }
    return entry;
}

void llama_moe_stream::unpin(int32_t entry) {
    {
        std::lock_guard<std::mutex> lock(mutex);
        pins[entry]--;
    }
    pin_cv.notify_all();
}

void llama_moe_stream::wait_unpinned(std::unique_lock<std::mutex> & lock, const std::vector<int32_t> & entries) {
    if (pins.empty()) {
        return;
    }
    pin_cv.wait(lock, [&] {
        for (int32_t e : entries) {
            if (pins[e] > 0) {
                return false;
            }
        }
        return true;
    });
}

void llama_moe_stream::interior(int32_t entry, int p, uint8_t * & addr, size_t & len) const {
#if !defined(_WIN32)
    static const size_t page = (size_t) sysconf(_SC_PAGESIZE);
#else
    static const size_t page = 4096;
#endif
    const auto & l = layers[entry / lru.n_expert];
    const size_t e = (size_t) (entry % lru.n_expert);
    // only the pages that lie wholly inside this expert's bytes: a neighbour may share the others
    const uintptr_t b0 = (uintptr_t) l.base[p] + e * l.expert_nbytes[p];
    const uintptr_t b1 = b0 + l.expert_nbytes[p];
    const uintptr_t p0 = (b0 + page - 1) & ~(uintptr_t) (page - 1);
    const uintptr_t p1 = b1 & ~(uintptr_t) (page - 1);
    addr = (uint8_t *) p0;
    len  = p1 > p0 ? p1 - p0 : 0;
}

void llama_moe_stream::release(const std::vector<int32_t> & entries) {
    for (int32_t entry : entries) {
        for (int p = 0; p < layers[entry / lru.n_expert].n_proj; ++p) {
            release_proj(entry, p);
        }
    }
}

void llama_moe_stream::release_proj(int32_t entry, int p) {
#if !defined(_WIN32)
    uint8_t * addr = nullptr;
    size_t    len  = 0;
    interior(entry, p, addr, len);
    if (!frames[p].unmap(entry, addr, len) && len > 0) {
        madvise(addr, len, MADV_DONTNEED);
    }
#else
    GGML_UNUSED(entry); GGML_UNUSED(p);
#endif
}

void llama_moe_stream::wave_read(int32_t li, int32_t p, const std::vector<int32_t> & experts) {
    size_t nbytes = 0;
    std::vector<llama_moe_read> jobs = read_jobs(layers[li], experts, nbytes, /*track =*/ true, p, /*marked =*/ true);
    reader.append(jobs);
    std::lock_guard<std::mutex> lock(mutex);
    read_bytes += nbytes;
}

void llama_moe_stream::wave_drop(int32_t li, int32_t p, const std::vector<int32_t> & experts) {
    for (int32_t e : experts) {
        release_proj(li * lru.n_expert + e, p);
    }
}

void llama_moe_stream::finish_waves() {
    const int32_t li = waves.layer();
    if (li < 0) {
        return;
    }
    std::vector<int32_t> unread[LLAMA_MOE_N_PROJ];
    waves.finish(unread);
    for (int p = 0; p < LLAMA_MOE_N_PROJ; ++p) {
        for (int32_t e : unread[p]) {
            inflight.done((int64_t) li * lru.n_expert + e, 1, p, /*ok =*/ true, ""); // never read, nothing waits for it
        }
    }
    inflight.unhold();
}

void llama_moe_stream::lookups(int32_t li, const ggml_tensor * ids, bool vram_served, std::vector<int32_t> & want,
                               std::vector<int64_t> & where) const {
    const int64_t n_used = ids->ne[0];
    const int64_t n_rows = ids->ne[1];
    // the VRAM tier's published table: experts resident on the device are computed there, when the
    // VRAM tier serves this step (in a stock step the host computes them too)
    const llama_moe_device_slots dev = vram_served && devices != nullptr ? devices->device_slots(layers[li].il)
                                                                         : llama_moe_device_slots();
    want.reserve(n_used * n_rows);
    where.reserve(n_used * n_rows);
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t k = 0; k < n_used; ++k) {
            const int32_t e = *(const int32_t *) ((const char *) ids->data + r*ids->nb[1] + k*ids->nb[0]);
            if (dev.slot != nullptr && dev.slot[e] < dev.n_phys) {
                continue;
            }
            want.push_back(e);
            where.push_back(r*n_used + k);
        }
    }
}

void llama_moe_stream::take_prefetched(int32_t li, const std::vector<int32_t> & admitted, std::vector<int32_t> & experts,
                                       size_t & nbytes) {
    const auto & l = layers[li];
    const bool from_prefetch = prefetch_li == li;
    std::vector<uint8_t> is_admitted(from_prefetch ? lru.n_expert : 0, 0);
    for (int32_t a : admitted) {
        const int32_t e = a % lru.n_expert;
        if (from_prefetch) {
            is_admitted[e] = 1;
        }
        if (from_prefetch && prefetched[e]) {
            prefetch_used += l.entry_bytes();
            nbytes        += l.entry_bytes(); // a miss's bytes, read ahead of the step
            continue;
        }
        experts.push_back(e);
    }
    if (from_prefetch) {
        std::vector<int32_t> unused;
        for (int32_t e = 0; e < lru.n_expert; ++e) {
            if (prefetched[e] && !is_admitted[e]) {
                unused.push_back(li * lru.n_expert + e);
            }
        }
        release(unused);
        prefetch_li = -1;
    }
    std::sort(experts.begin(), experts.end());
}

std::vector<llama_moe_read> llama_moe_stream::prefetch_next(int32_t li) {
    std::vector<llama_moe_read> ahead;
    const int32_t nl = li + 1;
    prefetched.assign(lru.n_expert, 0);
    std::vector<int32_t> next;
    {
        std::lock_guard<std::mutex> lock(mutex);
        for (int32_t e = 0; e < lru.n_expert && (int64_t) next.size() < prefetch_entries; ++e) {
            if (!lru.resident[(size_t) nl * lru.n_expert + e]) {
                next.push_back(e);
                prefetched[e] = 1;
            }
        }
    }
    if (!next.empty()) {
        size_t pb = 0;
        ahead = read_jobs(layers[nl], next, pb, /*track =*/ false);
        prefetch_li = nl;
        prefetch_bytes += pb;
    }
    return ahead;
}

void llama_moe_stream::step(int32_t li, const ggml_tensor * ids, bool vram_served) {
    auto & l = layers[li];
    const int64_t n_used = ids->ne[0];
    const int64_t n_rows = ids->ne[1];

    std::vector<int32_t> want;   // lookups of this tier, in router order
    std::vector<int64_t> where;  // their index among all ids
    lookups(li, ids, vram_served, want, where);

    // io wait: the time this step waits for reads (a prefetch's, then its own)
    using clock = std::chrono::steady_clock;
    auto t0 = clock::now();
    std::string err;
    settle_prefetch(li); // its reads are done; a prefetch for another layer gives its pages back
    int64_t us = std::chrono::duration_cast<std::chrono::microseconds>(clock::now() - t0).count();

    std::vector<int8_t>  hit;
    std::vector<int32_t> admitted, evicted, passed;
    {
        std::unique_lock<std::mutex> lock(mutex);
        lru.step(li, want.data(), (int64_t) want.size(), hit, admitted, evicted, passed);
        if (li == 0) {
            time_overlap(std::chrono::duration_cast<std::chrono::microseconds>(t0.time_since_epoch()).count(),
                    !lru.wants_half());
        }
        l.hits_now.assign(n_used * n_rows, -1);
        for (size_t i = 0; i < want.size(); ++i) {
            l.hits_now[where[i]] = hit[i];
            l.hits   += hit[i] == 1;
            l.misses += hit[i] == 0;
        }
        wait_unpinned(lock, evicted); // an upload may still read one of them
    }
    release(evicted); // before the admitted entries' bytes arrive: a shared page is never dropped after

    // the admitted experts whose bytes a prefetch brought are there already; the prefetched ones the step
    // did not admit give their pages back
    std::vector<int32_t> experts;
    size_t nbytes = 0;
    take_prefetched(li, admitted, experts, nbytes);
    // with the overlap, each of the step's ranges is marked in flight until its lane has read it, and
    // the layer's MUL_MAT_IDs wait for each expert's bytes there (llama-moe-inflight.h). Decode steps only:
    // a prefill step's compute takes every core the lanes need (2 cores, 2 threads: prefill 11-13 % slower
    // with it at C and B, docs/stream-tier.md, "Reads behind compute"), and the prefetch already overlaps it
    const bool async = overlap_now() && !lru.wants_half();
    std::vector<llama_moe_read> jobs = read_jobs(l, experts, nbytes, /*track =*/ async);

    // the misses the budget could not admit: read in waves while the layer computes (llama-moe-waves.h);
    // each is marked in flight in every projection now, so a thread that reaches one waits for its read
    std::vector<int32_t> wave;
    if (!passed.empty()) {
        if (!waves_on) {
            // note: the budget is checked against the largest step at load when there are no waves
            GGML_ABORT("moe-stream: a layer step needs more experts than the budget holds, and expert waves are off");
        }
        for (int32_t a : passed) {
            wave.push_back(a % lru.n_expert);
        }
        std::sort(wave.begin(), wave.end());
        for (int32_t e : wave) {
            for (int p = 0; p < l.n_proj; ++p) {
                inflight.mark((int64_t) li * lru.n_expert + e, p);
            }
        }
        inflight.hold();
    }

    // a prefill step (it wanted half of its layer or more, as the LRU counted it; it blocks, so `async` is
    // false): read the next layer's non-resident experts while this one computes
    std::vector<llama_moe_read> ahead;
    if (prefetch_entries > 0 && li + 1 < (int32_t) layers.size() && lru.wants_half() && wave.empty()) {
        ahead = prefetch_next(li);
    }
    if (!wave.empty()) {
        // the admitted misses and the first window of each projection's wave in one batch; a blocking step
        // waits for both, and the layer's MUL_MAT_IDs read the rest of the wave ahead of themselves
        reader.submit(jobs);
        waves.begin(li, l.n_proj, wave);
        if (!async) {
            t0 = clock::now();
            if (!reader.wait(err)) {
                llama_moe_read_failed(err);
            }
            us += std::chrono::duration_cast<std::chrono::microseconds>(clock::now() - t0).count();
        }
    } else if (async) {
        // the layer computes while it is read (the next step, or a resize, waits for any read left)
        if (!jobs.empty()) {
            reader.submit(jobs);
        }
    } else {
        t0 = clock::now();
        if (!reader.read(jobs, err)) {
            // note: the expert's bytes are not there, so the layer's output would be wrong: stop here
            llama_moe_read_failed(err);
        }
        us += std::chrono::duration_cast<std::chrono::microseconds>(clock::now() - t0).count();
        if (!ahead.empty()) {
            reader.submit(ahead);
        }
    }
    std::lock_guard<std::mutex> lock(mutex);
    read_bytes += nbytes;
    io_wait_us += (uint64_t) us;
    if (li == 0) {
        n_tokens += (uint64_t) n_rows;
    }
}

std::vector<llama_moe_read> llama_moe_stream::read_jobs(const llama_moe_stream_layer & l, const std::vector<int32_t> & experts,
                                                         size_t & nbytes, bool track, int only_p, bool marked) {
    // one read per run of consecutive expert ids (they are adjacent in the file and in the reservation; a
    // prefill step wants most of a layer), cut into reads of at most ~8 MiB so that the lanes share the work
    std::vector<llama_moe_read> jobs;
    for (int p = 0; p < l.n_proj; ++p) {
        if (only_p >= 0 && p != only_p) {
            continue;
        }
        const size_t n = l.expert_nbytes[p];
        const size_t per_job = std::max<size_t>(1, (8u << 20) / n);
        for (size_t i = 0; i < experts.size(); ) {
            size_t j = i + 1;
            while (j < experts.size() && experts[j] == experts[j - 1] + 1 && j - i < per_job) {
                j++;
            }
            const size_t e = (size_t) experts[i];
            llama_moe_read job { l.src[p].file, l.src[p].offs + e * n, (j - i) * n, l.base[p] + e * n, /*in_place =*/ true, {}, {} };
            if (frames[p].on()) {
                const int32_t first = l.li * lru.n_expert + (int32_t) e;
                const int32_t count = (int32_t) (j - i);
                llama_moe_stream * self = this;
                job.before = [self, p, first, count] {
                    for (int32_t entry = first; entry < first + count; ++entry) {
                        uint8_t * addr = nullptr;
                        size_t    len  = 0;
                        self->interior(entry, p, addr, len);
                        self->frames[p].map(entry, addr, len);
                    }
                };
            }
            if (track) {
                const int64_t first = (int64_t) l.li * lru.n_expert + (int64_t) e;
                const int64_t count = (int64_t) (j - i);
                for (int64_t entry = first; entry < first + count && !marked; ++entry) {
                    inflight.mark(entry, p);
                }
                llama_moe_inflight * fl = &inflight;
                job.after = [fl, first, count, p](bool ok, const std::string & err) {
                    fl->done(first, count, p, ok, err);
                };
            }
            jobs.push_back(std::move(job));
            nbytes += (j - i) * n;
            i = j;
        }
    }
    return jobs;
}

void llama_moe_stream::settle_prefetch(int32_t li) {
    // every read in flight: the last step's (with the overlap, its layer waited for them expert by expert)
    // and the prefetch
    std::string err;
    if (!reader.wait(err)) {
        llama_moe_read_failed(err);
    }
    finish_waves(); // the last step's layer is done: what its waves still hold goes
    if (prefetch_li < 0) {
        return;
    }
    if (prefetch_li != li) {
        std::vector<int32_t> unused;
        for (int32_t e = 0; e < lru.n_expert; ++e) {
            if (prefetched[e]) {
                unused.push_back(prefetch_li * lru.n_expert + e);
            }
        }
        release(unused);
        prefetch_li = -1;
    }
}

void llama_moe_stream::get_stats(llama_moe_stream_stats & out) const {
    std::lock_guard<std::mutex> lock(mutex);
    out = {};
    out.hits           = lru.hits;
    out.misses         = lru.misses;
    out.read_bytes     = read_bytes;
    out.resident_bytes = (uint64_t) lru.n_resident * entry_bytes;
    out.budget_bytes   = (uint64_t) budget_bytes;
    out.min_bytes      = (uint64_t) least_bytes(); // the least budget the tier takes (with waves, under one step's set)
    out.total_bytes    = (uint64_t) total_bytes;
    out.n_tokens       = n_tokens;
    out.io_wait_us     = io_wait_us + inflight.wait_us.load();
    out.major_faults   = (uint64_t) std::max(0L, llama_moe_major_faults() - majflt_at_start);
    out.n_layers       = (int32_t) layers.size();
    out.direct_io      = reader.direct ? 1 : 0;
    out.prefetch_bytes = prefetch_bytes;
    out.prefetch_used  = prefetch_used;
    const llama_moe_kv_usage kv = llama_moe_kv_get_usage();
    out.kv_committed_bytes = kv.committed;
    out.kv_capacity_bytes  = kv.capacity;
    out.kv_released_bytes  = kv.released;
    out.free_bytes         = (uint64_t) std::max<int64_t>(gov_free, 0);
    out.n_yields           = gov_yields;
    out.n_grows            = gov_grows;
    out.elastic            = elastic ? 1 : 0;
}

void llama_moe_stream::print_summary() const {
    llama_moe_stream_stats st;
    get_stats(st);
    uint64_t n_scans = 0;
    uint64_t n_waves = 0;
    {
        std::lock_guard<std::mutex> lock(mutex);
        n_scans = lru.n_scan_steps;
        n_waves = waves.n_steps;
    }
    const uint64_t n = st.hits + st.misses;
    const double mib = 1024.0 * 1024.0;
    LLAMA_LOG("moe-stream: %.1f%% hit, resident %.1f MiB, misses %llu (read %.1f MiB, %.2f MiB/token), io wait %.3f s, "
            "major faults %llu, prefetched %.1f MiB (%.1f MiB of it used), scan steps %llu, wave steps %llu, budget %.1f MiB "
            "(yielded %llu, grew %llu times), KV caches %.1f of %.1f MiB committed\n", n ? 100.0*st.hits/n : 0.0,
            st.resident_bytes/mib, (unsigned long long) st.misses, st.read_bytes/mib,
            st.n_tokens ? st.read_bytes/mib/st.n_tokens : 0.0, st.io_wait_us/1e6,
            (unsigned long long) st.major_faults, st.prefetch_bytes/mib, st.prefetch_used/mib,
            (unsigned long long) n_scans, (unsigned long long) n_waves, st.budget_bytes/mib,
            (unsigned long long) st.n_yields, (unsigned long long) st.n_grows, st.kv_committed_bytes/mib,
            st.kv_capacity_bytes/mib);
}

//
// C API
//

bool llama_model_moe_stream_get_stats(const llama_model * model, llama_moe_stream_stats * out) {
    const llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->stream.on() || out == nullptr) {
        return false;
    }
    mc->stream.get_stats(*out);
    return true;
}

bool llama_model_moe_stream_get_layer_stats(const llama_model * model, int32_t il, uint64_t * hits, uint64_t * misses) {
    const llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->stream.on() || mc->stream.index_of(il) < 0) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mc->stream.mutex);
    const auto & l = mc->stream.layers[mc->stream.index_of(il)];
    if (hits)   { *hits   = l.hits; }
    if (misses) { *misses = l.misses; }
    return true;
}

int32_t llama_model_moe_stream_set_budget_mib(llama_model * model, int32_t budget_mib) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || !mc->stream.on()) {
        LLAMA_LOG_ERROR("%s: moe-stream: the stream tier is off; nothing to resize\n", __func__);
        return -1;
    }
    if (mc->busy(__func__, "moe-stream", "resize")) {
        return LLAMA_MOE_ERR_BUSY;
    }
    auto & st = mc->stream;
    const int64_t min_mib = (st.least_bytes() + (1 << 20) - 1) >> 20;
    if (budget_mib < min_mib) {
        LLAMA_LOG_ERROR("%s: moe-stream: %d MiB is under the mechanical minimum of %lld MiB (%lld experts of %.2f MiB, %s); "
                "accepted: >= %lld\n", __func__, budget_mib,
                (long long) min_mib, (long long) (st.least_bytes() / (int64_t) st.entry_bytes), st.entry_bytes/1024.0/1024.0,
                st.waves_on ? "top-k and the expert waves' window" : format("the most one layer step needs at ubatch %d", st.n_ubatch).c_str(),
                (long long) min_mib);
        return -1;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    const int64_t want = st.resize((int64_t) budget_mib << 20);
    st.is_auto = false; // a budget set by hand is kept when contexts come and go, unless they leave it no room
    st.fixed_bytes = want;
    return (int32_t) (want >> 20);
}
