// pybmoe: the routing trace (--moe-trace FILE). See llama-moe-trace.h.
//
// Holds: the trace's buffers, rows and writer thread, and its C API entry point. Must not hold:
// any tier's state (the hit column comes through a callback) or route replay.

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-batch.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>

int32_t llama_moe_trace::open(const llama_model & model, const char * path, int32_t n_ubatch, const std::string & header) {
    std::vector<int> ils;
    for (int il = 0; il < (int) model.layers.size(); ++il) {
        if (llama_moe_is_moe_layer(model.layers[il])) {
            ils.push_back(il);
        }
    }
    if (ils.empty()) {
        LLAMA_LOG_WARN("%s: moe-trace: WARNING the model has no MoE layers; %s stays empty\n", __func__, path);
    }
    FILE * f = fopen(path, "wb");
    if (f == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-trace: cannot write %s\n", __func__, path);
        return -1;
    }
    const int32_t n_used = (int32_t) model.hparams.n_expert_used();
    fprintf(f, "# pybmoe-trace v1 %s\n", header.c_str());
    fprintf(f, "workload,phase,ubatch,token,layer,rank,expert,hit%s\n", ram_hit ? ",ram_hit" : "");

    ggml_init_params params = { ils.size() * ggml_tensor_overhead() + 1, nullptr, true };
    ctx.reset(ggml_init(params));
    layer_of_il.assign(model.layers.size(), -1);
    for (int il : ils) {
        ggml_tensor * t = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, (int64_t) n_used * n_ubatch);
        ggml_format_name(t, "blk.%d.ffn_moe_trace", il);
        layer_of_il[il] = (int32_t) layers.size();
        layers.push_back({ il, n_used, t });
    }
    if (!ils.empty()) {
        buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), ggml_backend_cpu_buffer_type()));
        GGML_ASSERT(buf);
        for (auto & t : layers) {
            std::fill((int32_t *) t.obs->data, (int32_t *) t.obs->data + ggml_nelements(t.obs), -1);
        }
    }
    cap  = n_ubatch;
    file = f;
    writer = std::thread([this] { writer_main(); });
    LLAMA_LOG_INFO("%s: moe-trace: writing the routing of %zu MoE layers to %s\n", __func__, ils.size(), path);
    return (int32_t) ils.size();
}

void llama_moe_trace::build(const llama_moe_log & log, ggml_context * ctx0, ggml_cgraph * gf, int il, ggml_tensor * selected) const {
    if (il < 0 || il >= (int) layer_of_il.size() || layer_of_il[il] < 0) {
        return;
    }
    const auto & t = layers[layer_of_il[il]];
    const int64_t n = selected->ne[0] * selected->ne[1];
    if (selected->ne[0] != t.n_used || n > ggml_nelements(t.obs)) {
        log.once("trace-cap", "WARNING the routing trace skips graphs of more than %lld tokens (the ubatch "
                "size it was opened with)", (long long) cap);
        return;
    }
    // runs on the CPU: the destination is a host tensor
    ggml_build_forward_expand(gf, ggml_cpy(ctx0, selected, ggml_view_1d(ctx0, t.obs, n, 0)));
}

void llama_moe_trace::rows(const llama_ubatch & ub, const std::function<const llama_moe_residency_layer * (int il)> & served,
                           const std::function<const std::vector<int8_t> * (int il)> & streamed) {
    const bool decode = ub.n_tokens == 1;
    std::string out;
    for (auto & t : layers) {
        int32_t * obs = (int32_t *) t.obs->data;
        const int64_t n = ggml_nelements(t.obs);
        int64_t n_ids = 0;
        while (n_ids < n && obs[n_ids] >= 0) {
            n_ids++;
        }
        if (n_ids == 0) {
            continue;
        }
        const int64_t n_rows = n_ids / t.n_used;
        const llama_moe_residency_layer * cl = served(t.il);
        cl = cl && (int64_t) cl->hits_now.size() == n_ids ? cl : nullptr;
        const std::vector<int8_t> * sl = ram_hit ? streamed(t.il) : nullptr;
        sl = sl && (int64_t) sl->size() == n_ids ? sl : nullptr;
        // note: a layer that computes fewer rows than the ubatch has (the last layer computes only the
        // outputs) maps its rows onto the tokens flagged as outputs, in order
        int64_t tok = -1;
        for (int64_t r = 0; r < n_rows; ++r) {
            if (n_rows == (int64_t) ub.n_tokens) {
                tok = r;
            } else {
                do { tok++; } while (tok < (int64_t) ub.n_tokens && ub.output && !ub.output[tok]);
            }
            for (int32_t k = 0; k < t.n_used; ++k) {
                const int64_t i = r * t.n_used + k;
                char line[128];
                int n = snprintf(line, sizeof(line), "engine,%s,%llu,%llu,%d,%d,%d,%d", decode ? "decode" : "prefill",
                        (unsigned long long) ubatch, (unsigned long long) (token + tok), t.il, k,
                        obs[i], cl ? (int) cl->hits_now[i] : -1);
                if (ram_hit) {
                    n += snprintf(line + n, sizeof(line) - n, ",%d", sl ? (int) (*sl)[i] : -1);
                }
                snprintf(line + n, sizeof(line) - n, "\n");
                out += line;
            }
        }
        std::fill(obs, obs + n, -1);
    }
    if (!out.empty()) {
        push(std::move(out));
    }
    ubatch++;
    token += ub.n_tokens;
}

void llama_moe_trace::push(std::string && rows) {
    {
        std::lock_guard<std::mutex> lock(q_mutex);
        queue.push_back(std::move(rows));
    }
    q_cv.notify_one();
}

void llama_moe_trace::writer_main() {
    for (;;) {
        std::string rows;
        {
            std::unique_lock<std::mutex> lock(q_mutex);
            q_cv.wait(lock, [&] { return stop || !queue.empty(); });
            if (queue.empty()) {
                return; // stopped and drained
            }
            rows = std::move(queue.front());
            queue.pop_front();
        }
        fwrite(rows.data(), 1, rows.size(), file);
    }
}

void llama_moe_trace::close() {
    if (writer.joinable()) {
        {
            std::lock_guard<std::mutex> lock(q_mutex);
            stop = true;
        }
        q_cv.notify_all();
        writer.join();
    }
    if (file) {
        fclose(file);
        file = nullptr;
    }
}

int32_t llama_model_moe_trace_open(llama_model * model, const char * path, int32_t n_ubatch) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (path == nullptr || path[0] == '\0') {
        return 0;
    }
    if (mc == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-trace: the model was not loaded from a GGUF path; no trace\n", __func__);
        return -1;
    }
    if (mc->trace.on()) {
        LLAMA_LOG_ERROR("%s: moe-trace: already tracing\n", __func__);
        return -1;
    }
    if (n_ubatch <= 0) {
        LLAMA_LOG_ERROR("%s: moe-trace: n_ubatch must be > 0, got %d\n", __func__, n_ubatch);
        return -1;
    }
    std::string header = format("n_layer=%d n_expert=%d n_expert_used=%d slots=%d inserts=%d max_batch=%d",
            (int) model->layers.size(), (int) model->hparams.n_expert, (int) model->hparams.n_expert_used(),
            mc->vram.n_slots, mc->vram.res.n_inserts, mc->max_batch);
    if (mc->vram.enabled() && !mc->vram.res.banks.empty()) {
        // the pool's banks, "P:il,il,.../P:il,...": each bank's resident slots and model layers
        // (pybmoe.routing.sim.engine_replay replays each bank on its own)
        std::string banks;
        for (const auto & bk : mc->vram.res.banks) {
            banks += format("%s%d:", banks.empty() ? "" : "/", bk.n_slots);
            for (size_t i = 0; i < bk.layers.size(); ++i) {
                banks += format("%s%d", i ? "," : "", mc->vram.layers[mc->vram.layer_of_ir(bk.layers[i])].il);
            }
        }
        header += " pool=" + banks;
    }
    if (mc->vram.res.admit_window > 0) {
        header += format(" admit=%d", mc->vram.res.admit_window); // the admission window, steps (pybmoe.routing.sim)
    }
    if (mc->stream.on()) {
        // the stream tier's budget and policy, in the simulator's terms (budget_entries and lend_entries of
        // global-lru-scan or global-lru)
        header += format(" stream_budget_mb=%.4f stream_entries=%lld stream_lend=%lld stream_entry_mb=%.6f stream_policy=%s",
                mc->stream.budget_bytes / 1024.0 / 1024.0, (long long) mc->stream.lru.capacity, (long long) mc->stream.lru.lend,
                mc->stream.entry_bytes / 1024.0 / 1024.0, mc->stream.lru.scan_guard ? "global-lru-scan" : "global-lru");
        mc->trace.ram_hit = true;
    }
    return mc->trace.open(*model, path, n_ubatch, header);
}
