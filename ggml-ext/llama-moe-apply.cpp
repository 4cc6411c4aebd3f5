// pybmoe: the one apply entry (llama_model_moe_apply, llama-moe.h): the after-load sequence of every
// tier, in its order, for common (llama-server, llama-cli), llama-bench and the bindings alike.
//
// Holds: the order of the steps and the one line that names the flag of a step that refused or did not
// engage. Must not hold: a tier's own logic (each step is a C API call of llama-moe.h), a caller's
// flag parsing, or a measure of the caller's contexts (the fit's probe comes in as a callback).

#include "llama-moe.h"

#include "llama-impl.h"

#include <string>

llama_moe_params llama_moe_default_params(void) {
    llama_moe_params p = {};
    p.cache_floor_mib   = LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT;
    p.stream_floor_mib  = LLAMA_MOE_STREAM_FLOOR_AUTO;
    p.stream_io_threads = LLAMA_MOE_STREAM_IO_THREADS_DEFAULT;
    p.dense_weights     = LLAMA_MOE_DENSE_AUTO;
    p.n_ubatch          = 512;  // llama_context_default_params().n_ubatch
    p.fit_n_seq         = 1;
    p.fit_n_ctx_min     = LLAMA_MOE_FIT_CTX_MIN;
    return p;
}

static std::string llama_moe_apply_count(int32_t n, int32_t auto_value) {
    return n == auto_value ? "auto" : std::to_string(n);
}

// a tier asked for that did not engage (`what`: the flag and its value; `tier`, `tag`: its name and its log
// lines' tag): an ERROR and `err` under strict (the bindings), else a WARN and OK (the tools run without it)
static int32_t llama_moe_apply_off(const char * fn, const llama_moe_params & p, const std::string & what, const char * tier,
                                   const char * tag, int32_t err) {
    const std::string line = format("%s: %s was requested but the %s is OFF (see the %s lines above)\n", fn, what.c_str(),
            tier, tag);
    if (p.strict) {
        LLAMA_LOG_ERROR("%s", line.c_str());
        return err;
    }
    LLAMA_LOG_WARN("%s", line.c_str());
    return LLAMA_MOE_APPLY_OK;
}

// the expert cache: max batch, slots, then its settings (each needs the cache on)
static int32_t llama_moe_apply_cache(llama_model * model, const llama_moe_params & p, llama_moe_apply_report & rep) {
    if (p.cache_slots == 0 && p.cache_mib == 0) {
        return LLAMA_MOE_APPLY_OK;
    }
    if (p.cache_slots != 0 && p.cache_mib != 0) {
        LLAMA_LOG_ERROR("%s: --moe-expert-cache %s and --moe-expert-cache-mb %d (--moe-cache-mib) are mutually exclusive: "
                "give one\n", __func__, llama_moe_apply_count(p.cache_slots, LLAMA_MOE_CACHE_AUTO).c_str(), p.cache_mib);
        return LLAMA_MOE_APPLY_ERR_PARAMS;
    }
    if (p.cache_max_batch > 0 && llama_model_moe_cache_set_max_batch(model, p.cache_max_batch) < 0) {
        if (p.cache_max_batch > LLAMA_MOE_CACHE_MAX_BATCH_LIMIT) {
            LLAMA_LOG_ERROR("%s: --moe-expert-cache-max-batch %d is out of range (1 .. %d)\n", __func__,
                    p.cache_max_batch, LLAMA_MOE_CACHE_MAX_BATCH_LIMIT);
        }
        return LLAMA_MOE_APPLY_ERR_CACHE_MAX_BATCH;
    }
    // the flag as the user gave it: slots per layer, or MiB per device
    const std::string slots = p.cache_mib > 0 ? "--moe-expert-cache-mb " + std::to_string(p.cache_mib)
                                              : "--moe-expert-cache " + llama_moe_apply_count(p.cache_slots, LLAMA_MOE_CACHE_AUTO);
    rep.cache = p.cache_mib > 0 ? llama_model_moe_cache_init_mib(model, p.cache_mib, p.cache_inserts, p.cache_floor_mib)
                                : llama_model_moe_cache_init_budget(model, p.cache_slots, p.cache_inserts, p.cache_floor_mib,
                                                                    p.cache_ceil_mib);
    if (rep.cache == LLAMA_MOE_CACHE_ERR_NO_ROOM) {
        LLAMA_LOG_ERROR("%s: %s does not fit device memory (see the moe-cache line above)\n", __func__, slots.c_str());
        return LLAMA_MOE_APPLY_ERR_CACHE_NO_ROOM;
    }
    if (rep.cache < 0) {
        return llama_moe_apply_off(__func__, p, slots, "expert cache", "moe-cache", LLAMA_MOE_APPLY_ERR_CACHE_OFF);
    }
    if (rep.cache == 0) {
        return LLAMA_MOE_APPLY_OK;
    }
    if (p.cache_sync) {
        llama_model_moe_cache_set_sync(model, true);
    }
    if (p.cache_admit_window > 0 && llama_model_moe_cache_set_admit_window(model, p.cache_admit_window) < 0) {
        LLAMA_LOG_ERROR("%s: --moe-expert-cache-admit second-miss:%d was refused (see the moe-cache line above)\n", __func__,
                p.cache_admit_window);
        return LLAMA_MOE_APPLY_ERR_CACHE_ADMIT;
    }
    if (p.cache_warmup > 0) {
        llama_model_moe_cache_set_warmup(model, p.cache_warmup);
    }
    if (p.cache_upload_mib > 0 && llama_model_moe_cache_set_upload_budget_mib(model, p.cache_upload_mib) < 0) {
        LLAMA_LOG_ERROR("%s: --moe-expert-cache-upload-mb %d is under one expert (see the moe-cache line above)\n", __func__,
                p.cache_upload_mib);
        return LLAMA_MOE_APPLY_ERR_CACHE_UPLOAD;
    }
    return LLAMA_MOE_APPLY_OK;
}

// the stream tier (before the fit, the dense policy and the trace, whose rows carry its hits)
static int32_t llama_moe_apply_stream(llama_model * model, const llama_moe_params & p, llama_moe_apply_report & rep) {
    if (p.stream_mib == 0) {
        // a companion flag given without the tier does nothing: say so rather than run as if it did
        std::string given;
        if (p.stream_floor_mib != LLAMA_MOE_STREAM_FLOOR_AUTO) {
            given += format(" --moe-stream-floor-mb %d", p.stream_floor_mib);
        }
        if (p.stream_ceil_mib != 0) {
            given += format(" --moe-stream-ceil-mb %d", p.stream_ceil_mib);
        }
        if (p.stream_io_threads != LLAMA_MOE_STREAM_IO_THREADS_DEFAULT) {
            given += format(" --moe-stream-io-threads %d", p.stream_io_threads);
        }
        if (!given.empty()) {
            LLAMA_LOG_WARN("%s: WARNING%s %s no effect without the stream tier (--moe-stream-cache-mb N|auto)\n", __func__,
                    given.c_str(), given.find(" --", 1) == std::string::npos ? "has" : "have");
        }
        return LLAMA_MOE_APPLY_OK;
    }
    const std::string budget = llama_moe_apply_count(p.stream_mib, LLAMA_MOE_STREAM_AUTO);
    rep.stream = llama_model_moe_stream_init(model, p.stream_mib, p.stream_floor_mib, p.stream_ceil_mib,
            p.stream_io_threads, p.n_ubatch);
    if (rep.stream == LLAMA_MOE_STREAM_ERR_BUDGET) {
        LLAMA_LOG_ERROR("%s: --moe-stream-cache-mb %s cannot hold one layer step (see the moe-stream line above)\n", __func__,
                budget.c_str());
        return LLAMA_MOE_APPLY_ERR_STREAM_BUDGET;
    }
    if (rep.stream < 0) {
        return llama_moe_apply_off(__func__, p, "--moe-stream-cache-mb " + budget, "stream tier", "moe-stream",
                                   LLAMA_MOE_APPLY_ERR_STREAM_OFF);
    }
    if (p.fit_measure == nullptr) {
        return LLAMA_MOE_APPLY_OK;
    }
    // the contexts and the budget fitted together, before any context is allocated (and before the dense
    // policy, whose auto pick counts them)
    rep.fit = llama_model_moe_stream_fit(model, &rep.n_ctx, &rep.n_seq, p.fit_unified, p.fit_user_sized, p.fit_n_ctx_min,
            p.fit_measure, p.fit_user_data);
    if (rep.fit == LLAMA_MOE_FIT_ERR_REFUSED) {
        LLAMA_LOG_ERROR("%s: the context (-c %u -np %u) and --moe-stream-cache-mb %s do not fit in memory together (see the "
                "moe-stream fit line above)\n", __func__, p.fit_n_ctx, p.fit_n_seq, budget.c_str());
        return LLAMA_MOE_APPLY_ERR_FIT_REFUSED;
    }
    return LLAMA_MOE_APPLY_OK;
}

int32_t llama_model_moe_apply(llama_model * model, const llama_moe_params * params, llama_moe_apply_report * report) {
    llama_moe_apply_report rep = {};
    if (model == nullptr || params == nullptr) {
        LLAMA_LOG_ERROR("%s: no model or no params\n", __func__);
        return LLAMA_MOE_APPLY_ERR_PARAMS;
    }
    const llama_moe_params & p = *params;
    rep.n_ctx = p.fit_n_ctx;
    rep.n_seq = p.fit_n_seq;
    int32_t rc = llama_moe_apply_cache(model, p, rep);
    if (rc == LLAMA_MOE_APPLY_OK) {
        rc = llama_moe_apply_stream(model, p, rep);
    }
    // the dense weights' policy, after the stream tier (whose sizing leaves room for them); auto picks one
    // only when the stream tier was asked for
    const bool dense = p.dense_weights == LLAMA_MOE_DENSE_AUTO ? p.stream_mib != 0 : p.dense_weights != LLAMA_MOE_DENSE_MMAP;
    if (rc == LLAMA_MOE_APPLY_OK && dense && llama_model_moe_dense_weights(model, p.dense_weights) < 0) {
        LLAMA_LOG_ERROR("%s: --dense-weights could not be applied (see the line above)\n", __func__);
        rc = LLAMA_MOE_APPLY_ERR_DENSE;
    }
    // the routing trace and route replay, after the tiers; each sizes its buffers for the ubatch
    if (rc == LLAMA_MOE_APPLY_OK && p.trace_path != nullptr && p.trace_path[0] != '\0' &&
            llama_model_moe_trace_open(model, p.trace_path, p.n_ubatch) < 0) {
        LLAMA_LOG_ERROR("%s: cannot write the routing trace to %s\n", __func__, p.trace_path);
        rc = LLAMA_MOE_APPLY_ERR_TRACE;
    }
    if (rc == LLAMA_MOE_APPLY_OK && p.route_replay_path != nullptr && p.route_replay_path[0] != '\0' &&
            llama_model_moe_route_replay_open(model, p.route_replay_path, p.n_ubatch) < 0) {
        LLAMA_LOG_ERROR("%s: cannot replay the routing trace %s (see above)\n", __func__, p.route_replay_path);
        rc = LLAMA_MOE_APPLY_ERR_REPLAY;
    }
    if (report != nullptr) {
        *report = rep;
    }
    return rc;
}
