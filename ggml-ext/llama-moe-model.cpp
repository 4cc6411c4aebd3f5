// pybmoe: the model's owner and the hooks around it: load, teardown and the step around each
// ubatch's graph, which drives the tiers, the trace and route replay in order. See llama-moe-model.h.
//
// Holds: the order of the per-step protocol and the owner's lifetime. Must not hold: a concern's
// own logic (each is a call into its file).

#include "llama-moe-model.h"
#include "llama-moe-sigbus.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-batch.h"
#include "llama-model-loader.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

//
// load and teardown
//

// the path llama_moe_stream_hint_lazy_load named for this thread's next load ("" when none): a hint to the
// loader, consumed by llama_moe_cache_record_sources at the end of that load, so no model carries it
static thread_local std::string llama_moe_lazy_hint;

void llama_moe_cache_record_sources(llama_model & model, const llama_model_loader & ml, const std::vector<std::string> & paths) {
    llama_moe_lazy_hint.clear(); // the load it was for is done
    if (paths.empty() || paths[0].empty()) {
        return; // loaded from a FILE * or from metadata: no source; init reports it
    }
    auto * mc = model.moe_cache ? model.moe_cache : new llama_moe_tiers();
    model.moe_cache = mc;
    mc->sources.record(ml, paths);
    llama_moe_vram_fit_probe(model, paths[0]);
    if (!model.hparams.no_alloc) {
        llama_moe_sigbus_register(model); // a mapped file that shrinks is named, not a silent SIGBUS
    }
}

void llama_moe_cache_free(llama_moe_tiers * mc) {
    if (mc) {
        mc->gov_poll.stop();
    }
    llama_moe_sigbus_unregister(mc);
    delete mc;
}

void llama_moe_cache_on_context_init(const llama_model & model, const void * ctx, size_t kv, size_t compute, size_t output) {
    llama_moe_tiers * mc = model.moe_cache;
    if (mc == nullptr || !mc->stream.on()) {
        return;
    }
    // auto may resize: not while another context's graph reads the entries (that context's turn ends first)
    std::lock_guard<std::mutex> turn(mc->graph_mutex);
    std::lock_guard<std::mutex> lock(mc->mutex);
    // the context's compute threads (decode and batch), for the overlap's auto rule
    auto * lctx = (llama_context *) const_cast<void *>(ctx);
    const int32_t n_threads = std::max(llama_n_threads(lctx), llama_n_threads_batch(lctx));
    // the KV bytes of one full ubatch's new cells (each token takes one cell of every layer)
    const uint32_t n_ctx     = std::max<uint32_t>(1, llama_n_ctx(lctx));
    const int64_t  kv_ubatch = (int64_t) ((double) kv * std::min(llama_n_ubatch(lctx), n_ctx) / n_ctx);
    mc->stream.on_context(ctx, (int64_t) (kv + compute + output), (int64_t) kv, (int64_t) compute, (int64_t) output,
                          kv_ubatch, n_threads);
    // the plan is made: from here the governor also has its turns while no graph runs (once per model)
    llama_moe_governor_idle_start(mc);
}

void llama_moe_cache_on_context_free(const llama_model & model, const void * ctx) {
    llama_moe_tiers * mc = model.moe_cache;
    if (mc == nullptr) {
        return;
    }
    // auto may resize (as on_context_init): the turn first, then the step's lock, in the step's order
    std::unique_lock<std::mutex> turn(mc->graph_mutex, std::defer_lock);
    if (mc->stream.on()) {
        turn.lock();
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    if (mc->vram.enabled()) {
        mc->vram.uploader.wait(); // the copies already queued count in the line, whatever the timing
        mc->vram.print_summary();
    }
    if (mc->stream.on()) {
        mc->stream.print_summary();
        mc->stream.on_context_free(ctx);
    }
}

//
// the load: which ranges the map leaves unread
//

void llama_moe_stream_hint_lazy_load(const char * path) {
    llama_moe_lazy_hint = path ? path : "";
}

std::vector<std::pair<size_t, size_t>> llama_moe_cache_lazy_ranges(const llama_model_loader & ml, uint32_t idx,
                                                                   const std::vector<std::pair<size_t, size_t>> & lazy) {
    std::vector<std::pair<size_t, size_t>> out = lazy;
    const char * env = getenv("PYBMOE_MOE_STREAM_LAZY_LOAD"); // 0: populate as before (the load benchmark's "before")
    if (llama_moe_lazy_hint.empty() || (env && atoi(env) == 0)) {
        return out;
    }
    size_t n = 0;
    for (const auto & [key, ctx] : ml.ctx_map) {
        if (!ggml_backend_buft_is_host(key.buft)) {
            continue; // a device's experts are copied there at load: read either way
        }
        for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); t != nullptr; t = ggml_get_next_tensor(ctx.get(), t)) {
            if (strstr(ggml_get_name(t), "_exps.") == nullptr) {
                continue;
            }
            const auto it = ml.weights_map.find(ggml_get_name(t));
            if (it == ml.weights_map.end() || it->second.idx != idx) {
                continue;
            }
            out.emplace_back(it->second.offs, it->second.offs + ggml_nbytes(t));
            n += ggml_nbytes(t);
        }
    }
    if (n > 0) {
        LLAMA_LOG_INFO("%s: moe-stream: file %u: %.1f MiB of host-resident experts are mapped without being read at load "
                "(the stream tier reads them)\n", __func__, idx, n / 1024.0 / 1024.0);
    }
    return out;
}

//
// graph building
//

const llama_moe_tiers * llama_moe_cache_active(const llama_model & model) {
    const llama_moe_tiers * mc = model.moe_cache;
    return mc && mc->active() ? mc : nullptr;
}

//
// the step around each ubatch's graph
//

void llama_moe_cache_before_ubatch(const llama_model & model, const llama_ubatch & ubatch, uint32_t n_seq_max) {
    llama_moe_tiers * mc = model.moe_cache;
    if (mc == nullptr) {
        return;
    }
    if (mc->active()) {
        mc->graph_mutex.lock(); // released at the end of llama_moe_cache_after_ubatch
    }
    if (mc->replay.on()) {
        // each token's replayed experts: its sequence's next token in the trace
        std::lock_guard<std::mutex> lock(mc->mutex);
        mc->replay.fill(ubatch, n_seq_max);
    }
    if (mc->stream.on()) {
        // the governor's turn, before this ubatch commits new KV cells (evict, then run)
        std::lock_guard<std::mutex> lock(mc->mutex);
        mc->stream.govern();
    }
    mc->n_busy++;
}

static void llama_moe_cache_step(llama_moe_tiers * mc, ggml_backend_sched_t sched, const llama_ubatch * ubatch);

void llama_moe_governor_idle_start(llama_moe_tiers * mc) {
    if (mc == nullptr || !mc->stream.on() || !mc->stream.elastic) {
        return;
    }
    mc->gov_poll.start([mc]() {
        // a graph that runs holds the lock, and its before-step is the governor's turn
        std::unique_lock<std::mutex> graph(mc->graph_mutex, std::try_to_lock);
        if (!graph.owns_lock()) {
            return;
        }
        std::lock_guard<std::mutex> lock(mc->mutex);
        mc->stream.govern();
    }, LLAMA_MOE_GOVERNOR_IDLE_MS);
}

void llama_moe_cache_after_ubatch(const llama_model & model, ggml_backend_sched_t sched, const llama_ubatch * ubatch) {
    llama_moe_tiers * mc = model.moe_cache;
    if (mc == nullptr) {
        return;
    }
    mc->n_busy--;
    if (!mc->active()) {
        return; // nothing to do (and no turn was taken: the tiers are set up before any context)
    }
    if (ubatch != nullptr) { // else the graph failed
        if (!mc->vram.routed_checked && mc->vram.enabled() && (int32_t) ubatch->n_tokens <= mc->max_batch) {
            mc->vram.check_routed(model.arch_name().c_str());
        }
        llama_moe_cache_step(mc, sched, ubatch);
    }
    mc->graph_mutex.unlock();
}

static void llama_moe_cache_step(llama_moe_tiers * mc, ggml_backend_sched_t sched, const llama_ubatch * ubatch) {
    std::lock_guard<std::mutex> lock(mc->mutex);
    // note: no scheduler synchronize here. What this step reads (the observed routing, the trace's
    // rows, the stream tier's hits) was written by CPU nodes, which have all run once the graph
    // compute returns; only a table publish must wait for the device graph (it reads the tables)

    if (mc->replay.on()) {
        mc->replay.advance(*ubatch);
    }

    auto & vram = mc->vram;
    if (vram.enabled()) {
        vram.account();
    }
    if (mc->trace.on()) {
        const auto & stream = mc->stream;
        mc->trace.rows(*ubatch, [&vram](int il) -> const llama_moe_residency_layer * {
            const llama_moe_vram_layer * l = vram.enabled() ? vram.layer(il) : nullptr;
            return l && vram.res.layers[l->ir].served_now ? &vram.res.layers[l->ir] : nullptr;
        }, [&stream](int il) -> const std::vector<int8_t> * {
            const int li = stream.index_of(il);
            return li >= 0 ? &stream.layers[li].hits_now : nullptr;
        });
        if (mc->stream.on()) {
            for (auto & l : mc->stream.layers) {
                l.hits_now.clear(); // consumed: a layer the next ubatch does not stream writes -1
            }
        }
    }
    if (!vram.enabled()) {
        return;
    }

    vram.settle();   // uploads started after the previous ubatch become visible now
    if (vram.dirty()) {
        ggml_backend_sched_synchronize(sched); // no graph reads the tables from here on
        vram.n_syncs++;
    }
    vram.publish();  // both copies of the tables change together
    vram.schedule(); // into free slots, which no table entry points at; copied while the next graph runs
}

//
// C API: settings that belong to the owner
//

int32_t llama_model_moe_cache_set_max_batch(llama_model * model, int32_t n_tokens) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (mc == nullptr || mc->vram.enabled() || mc->trace.on() || n_tokens < 1 || n_tokens > LLAMA_MOE_CACHE_MAX_BATCH_LIMIT) {
        LLAMA_LOG_ERROR("%s: moe-cache: max batch %d refused: it must be 1 .. %d, set on a GGUF-loaded model before the "
                "cache or the trace is opened\n", __func__, n_tokens, LLAMA_MOE_CACHE_MAX_BATCH_LIMIT);
        return -1;
    }
    mc->max_batch = n_tokens;
    return n_tokens;
}

bool llama_model_moe_cache_reserve(llama_model * model, ggml_backend_dev_t dev, size_t nbytes) {
    if (model == nullptr || model->moe_cache == nullptr || model->moe_cache->vram.enabled() || dev == nullptr) {
        return false;
    }
    model->moe_cache->reserve[dev] = nbytes;
    return true;
}
