// pybmoe: the model's owner and the hooks around it: load, teardown and the step around each
// ubatch's graph, which drives the tiers, the trace and route replay in order. See llama-moe-model.h.
//
// Holds: the order of the per-step protocol and the owner's lifetime. Must not hold: a concern's
// own logic (each is a call into its file).

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-batch.h"

#include <cstdarg>
#include <cstring>

bool llama_moe_is_moe_layer(const llama_layer & layer) {
    return layer.ffn_gate_inp && (layer.ffn_up_exps || layer.ffn_gate_up_exps);
}

void llama_moe_log::once(const char * key, const char * fmt, ...) const {
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (!seen.insert(key).second) {
            return;
        }
    }
    char buf[512];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    if (strncmp(buf, "WARNING", 7) == 0) {
        LLAMA_LOG_WARN("moe-cache: %s\n", buf); // the cache is not serving something it was asked to
    } else {
        LLAMA_LOG_INFO("moe-cache: %s\n", buf);
    }
}

//
// load and teardown
//

void llama_moe_cache_record_sources(llama_model & model, const llama_model_loader & ml, const std::vector<std::string> & paths) {
    if (paths.empty() || paths[0].empty()) {
        return; // loaded from a FILE * or from metadata: no source; init reports it
    }
    auto * mc = model.moe_cache ? model.moe_cache : new llama_moe_cache();
    model.moe_cache = mc;
    mc->sources.record(ml, paths);
    llama_moe_vram_fit_probe(model, paths[0]);
}

void llama_moe_cache_free(llama_moe_cache * mc) {
    delete mc;
}

void llama_moe_cache_on_context_free(const llama_model & model) {
    llama_moe_cache * mc = model.moe_cache;
    if (mc == nullptr) {
        return;
    }
    std::lock_guard<std::mutex> lock(mc->mutex);
    if (mc->vram.enabled()) {
        mc->vram.uploader.wait(); // the copies already queued count in the line, whatever the timing
        mc->vram.print_summary();
    }
    if (mc->stream.on()) {
        mc->stream.print_summary();
    }
}

//
// graph building
//

const llama_moe_cache * llama_moe_cache_active(const llama_model & model) {
    const llama_moe_cache * mc = model.moe_cache;
    return mc && mc->active() ? mc : nullptr;
}

bool llama_moe_cache::busy(const char * fn, const char * tier, const char * what) const {
    if (n_busy.load() == 0) {
        return false;
    }
    LLAMA_LOG_ERROR("%s: %s: a graph is being computed; %s between generations\n", fn, tier, what);
    return true;
}

//
// the step around each ubatch's graph
//

void llama_moe_cache_before_ubatch(const llama_model & model) {
    llama_moe_cache * mc = model.moe_cache;
    if (mc == nullptr) {
        return;
    }
    if (mc->active()) {
        mc->graph_mutex.lock(); // released at the end of llama_moe_cache_after_ubatch
    }
    mc->n_busy++;
}

static void llama_moe_cache_step(llama_moe_cache * mc, ggml_backend_sched_t sched, const llama_ubatch * ubatch);

void llama_moe_cache_after_ubatch(const llama_model & model, ggml_backend_sched_t sched, const llama_ubatch * ubatch) {
    llama_moe_cache * mc = model.moe_cache;
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

static void llama_moe_cache_step(llama_moe_cache * mc, ggml_backend_sched_t sched, const llama_ubatch * ubatch) {
    std::lock_guard<std::mutex> lock(mc->mutex);
    // note: no scheduler synchronize here. What this step reads (the observed routing, the trace's
    // rows, the stream tier's hits) was written by CPU nodes, which have all run once the graph
    // compute returns; only a table publish must wait for the device graph (it reads the tables)

    if (mc->replay.on()) {
        mc->replay.advance(ubatch->n_tokens);
    }

    auto & vram = mc->vram;
    if (vram.enabled()) {
        vram.account();
    }
    if (mc->trace.on()) {
        const auto & stream = mc->stream;
        mc->trace.rows(*ubatch, [&vram](int il) -> const llama_moe_residency_layer * {
            const llama_moe_cache_layer * l = vram.enabled() ? vram.layer(il) : nullptr;
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
    vram.schedule(&mc->stream); // into free slots, which no table entry points at; copied while the next graph runs
}

//
// C API: settings that belong to the owner
//

int32_t llama_model_moe_cache_set_max_batch(llama_model * model, int32_t n_tokens) {
    llama_moe_cache * mc = model ? model->moe_cache : nullptr;
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
