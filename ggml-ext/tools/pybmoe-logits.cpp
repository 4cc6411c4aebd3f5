// pybmoe-logits: greedy generation that records the raw logits of every decode step.
//
// It is the oracle for the expert cache: with the same CPU kernels on both sides of the split
// (a loopback ggml-rpc-server as the device), cache-on logits must be bit-identical to cache-off.
//
//   pybmoe-logits --logits-out FILE [common llama.cpp flags: -m, -p, -n, --rpc, -ngl, --cpu-moe,
//                 --moe-expert-cache, ...]
//
// FILE gets, for each decode step (one token each), n_vocab float32 values in native byte order.
// stdout gets the generated token ids, one per line ("token ID"). The prompt is decoded as one batch (prefill).
// After the last step, "decode-tok-s RATE" (the single-token decodes per second, a device check's figure);
// after the context is freed, stdout gets one line per cached layer: "moe-cache-layer IL HITS MISSES".
// --moe-resize-at STEP:SLOTS calls llama_model_moe_cache_set_slots(SLOTS) after STEP decode steps
// (between two llama_decode calls) and prints "moe-cache-resize RC".
// --moe-resize-in-graph SLOTS calls it once from inside the first decode graph (an eval callback,
// while the graph is being computed), which the cache must refuse, and prints
// "moe-cache-resize-in-graph RC SLOTS_AFTER".
// --moe-stream-resize-at STEP:MIB calls llama_model_moe_stream_set_budget_mib(MIB) after STEP decode
// steps and prints "moe-stream-resize RC RESIDENT_BYTES".
// With the stream tier on, stdout also gets "moe-stream-layer IL HITS MISSES" per streamed layer.
// --abi (alone) prints sizeof and field offsets of struct llama_moe_cache_stats, --abi-stream those of
// struct llama_moe_stream_stats.

#include "arg.h"
#include "common.h"
#include "llama.h"
#include "llama-moe.h"
#include "ggml.h"

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// --moe-resize-in-graph: one resize attempt from inside a graph being computed
struct resize_in_graph {
    llama_model * model = nullptr;
    int32_t       slots = -1;   // < 0: off
    bool          armed = false; // set after the prefill: the attempt is made in a decode graph
    bool          done  = false;
};

static bool resize_in_graph_cb(struct ggml_tensor * /*t*/, bool ask, void * user_data) {
    auto * r = (resize_in_graph *) user_data;
    if (ask && r->armed && !r->done) {
        r->done = true;
        const int32_t rc = llama_model_moe_cache_set_slots(r->model, r->slots);
        llama_moe_cache_stats st = {};
        llama_model_moe_cache_get_stats(r->model, &st);
        printf("moe-cache-resize-in-graph %d %d\n", rc, st.n_slots);
        fflush(stdout);
    }
    return false; // observe no tensor: the graph runs as it would without the callback
}

int main(int argc, char ** argv) {
    if (argc == 2 && strcmp(argv[1], "--abi-stream") == 0) {
        // the layout the Python bindings mirror (pybmoe.engine.bindings.MoeStreamStatsC)
        printf("llama_moe_stream_stats %zu", sizeof(llama_moe_stream_stats));
#define PYBMOE_OFF(f) printf(" %s=%zu", #f, offsetof(llama_moe_stream_stats, f))
        PYBMOE_OFF(hits); PYBMOE_OFF(misses); PYBMOE_OFF(read_bytes); PYBMOE_OFF(resident_bytes);
        PYBMOE_OFF(budget_bytes); PYBMOE_OFF(min_bytes); PYBMOE_OFF(total_bytes); PYBMOE_OFF(n_tokens);
        PYBMOE_OFF(io_wait_us); PYBMOE_OFF(major_faults); PYBMOE_OFF(n_layers); PYBMOE_OFF(direct_io);
        PYBMOE_OFF(prefetch_bytes); PYBMOE_OFF(prefetch_used); PYBMOE_OFF(kv_committed_bytes);
        PYBMOE_OFF(kv_capacity_bytes); PYBMOE_OFF(kv_released_bytes); PYBMOE_OFF(free_bytes); PYBMOE_OFF(n_yields);
        PYBMOE_OFF(n_grows); PYBMOE_OFF(elastic);
#undef PYBMOE_OFF
        printf("\n");
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "--abi") == 0) {
        // the layout the Python bindings mirror (pybmoe.engine.bindings.MoeCacheStatsC)
        printf("llama_moe_cache_stats %zu", sizeof(llama_moe_cache_stats));
#define PYBMOE_OFF(f) printf(" %s=%zu", #f, offsetof(llama_moe_cache_stats, f))
        PYBMOE_OFF(hits); PYBMOE_OFF(misses); PYBMOE_OFF(uploads); PYBMOE_OFF(upload_bytes);
        PYBMOE_OFF(resident_bytes); PYBMOE_OFF(alloc_bytes); PYBMOE_OFF(n_steps); PYBMOE_OFF(n_layers);
        PYBMOE_OFF(n_slots); PYBMOE_OFF(n_inserts); PYBMOE_OFF(n_expert); PYBMOE_OFF(n_expert_used);
        PYBMOE_OFF(sync); PYBMOE_OFF(upload_wait_us); PYBMOE_OFF(n_h2d); PYBMOE_OFF(n_waits);
        PYBMOE_OFF(upload_file_bytes); PYBMOE_OFF(upload_busy_us); PYBMOE_OFF(n_publish);
        PYBMOE_OFF(warmup_uploads); PYBMOE_OFF(warmup); PYBMOE_OFF(n_syncs); PYBMOE_OFF(n_step_moves);
        PYBMOE_OFF(layer_demand_mib); PYBMOE_OFF(token_demand_mib); PYBMOE_OFF(admit_window); PYBMOE_OFF(n_bypassed);
#undef PYBMOE_OFF
        printf("\n");
        return 0;
    }
    std::string out_path;
    int resize_step = -1, resize_slots = 0;
    int stream_resize_step = -1, stream_resize_mib = 0;
    resize_in_graph rig;
    std::vector<char *> args;
    for (int i = 0; i < argc; ++i) {
        if (strcmp(argv[i], "--logits-out") == 0 && i + 1 < argc) {
            out_path = argv[++i];
            continue;
        }
        if (strcmp(argv[i], "--moe-resize-in-graph") == 0 && i + 1 < argc) {
            rig.slots = atoi(argv[++i]);
            continue;
        }
        if (strcmp(argv[i], "--moe-stream-resize-at") == 0 && i + 1 < argc) {
            if (sscanf(argv[++i], "%d:%d", &stream_resize_step, &stream_resize_mib) != 2) {
                fprintf(stderr, "pybmoe-logits: --moe-stream-resize-at expects STEP:MIB, got '%s'\n", argv[i]);
                return 2;
            }
            continue;
        }
        if (strcmp(argv[i], "--moe-resize-at") == 0 && i + 1 < argc) {
            if (sscanf(argv[++i], "%d:%d", &resize_step, &resize_slots) != 2) {
                fprintf(stderr, "pybmoe-logits: --moe-resize-at expects STEP:SLOTS, got '%s'\n", argv[i]);
                return 2;
            }
            continue;
        }
        args.push_back(argv[i]);
    }
    if (out_path.empty()) {
        fprintf(stderr, "pybmoe-logits: --logits-out FILE is required\n");
        return 2;
    }

    common_params params;
    params.n_predict = 16;
    if (!common_params_parse((int) args.size(), args.data(), params, LLAMA_EXAMPLE_COMPLETION)) {
        return 2;
    }
    common_init();
    llama_backend_init();

    // the model (and its expert cache) from common; the context is ours, so its teardown can be
    // observed before the model goes
    auto init = common_init_from_params(params, /*model_only=*/true);
    llama_model   * model = init->model();
    rig.model = model;
    if (rig.slots >= 0) {
        params.cb_eval           = resize_in_graph_cb;
        params.cb_eval_user_data = &rig;
    }
    llama_context * ctx   = model ? llama_init_from_model(model, common_context_params_to_llama(params)) : nullptr;
    if (model == nullptr || ctx == nullptr) {
        fprintf(stderr, "pybmoe-logits: failed to load the model\n");
        return 1;
    }
    // the context as created (the disk tier's fit may have shrunk a default one: issue 40's tests read it)
    printf("n_ctx %u n_seq %u\n", llama_n_ctx(ctx), llama_n_seq_max(ctx));
    // --lora: common_init_from_params loads adapters only with its own context (not model_only)
    for (auto & la : params.lora_adapters) {
        la.ptr = llama_adapter_lora_init(model, la.path.c_str());
        if (la.ptr == nullptr) {
            fprintf(stderr, "pybmoe-logits: failed to load the LoRA adapter %s\n", la.path.c_str());
            return 1;
        }
    }
    if (!params.lora_adapters.empty()) {
        common_set_adapter_lora(ctx, params.lora_adapters);
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    std::vector<llama_token> prompt = common_tokenize(ctx, params.prompt, true, true);
    if (prompt.empty()) {
        fprintf(stderr, "pybmoe-logits: empty prompt\n");
        return 2;
    }
    FILE * out = fopen(out_path.c_str(), "wb");
    if (out == nullptr) {
        fprintf(stderr, "pybmoe-logits: cannot write %s\n", out_path.c_str());
        return 1;
    }

    if (llama_decode(ctx, llama_batch_get_one(prompt.data(), (int32_t) prompt.size())) != 0) {
        fprintf(stderr, "pybmoe-logits: prefill failed\n");
        return 1;
    }
    rig.armed = true;
    llama_token tok = 0;
    const int64_t t_decode = ggml_time_us();
    for (int i = 0; i < params.n_predict; ++i) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        if (i > 0) {
            fwrite(logits, sizeof(float), n_vocab, out); // step i-1 was a single-token decode
        }
        tok = 0;
        for (int t = 1; t < n_vocab; ++t) {
            if (logits[t] > logits[tok]) {
                tok = t;
            }
        }
        printf("token %d\n", tok);
        fflush(stdout);
        if (i == resize_step) {
            printf("moe-cache-resize %d\n", llama_model_moe_cache_set_slots(model, resize_slots));
        }
        if (i == stream_resize_step) {
            const int32_t rc = llama_model_moe_stream_set_budget_mib(model, stream_resize_mib);
            llama_moe_stream_stats st = {};
            llama_model_moe_stream_get_stats(model, &st);
            printf("moe-stream-resize %d %llu\n", rc, (unsigned long long) st.resident_bytes);
        }
        if (i + 1 < params.n_predict && llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) {
            fprintf(stderr, "pybmoe-logits: decode failed at step %d\n", i);
            return 1;
        }
    }
    fclose(out);
    if (params.n_predict > 1) {
        // the single-token decodes' rate (a device check's figure; the benchmarks use llama-bench and llama-server)
        printf("decode-tok-s %.3f\n", (params.n_predict - 1) * 1e6 / std::max<int64_t>(1, ggml_time_us() - t_decode));
    }
    llama_free(ctx); // accounts the last graph's routing

    for (int32_t il = 0; il < llama_model_n_layer(model); ++il) {
        uint64_t hits = 0, misses = 0;
        if (llama_model_moe_cache_get_layer_stats(model, il, &hits, &misses)) {
            printf("moe-cache-layer %d %llu %llu\n", il, (unsigned long long) hits, (unsigned long long) misses);
        }
        if (llama_model_moe_stream_get_layer_stats(model, il, &hits, &misses)) {
            printf("moe-stream-layer %d %llu %llu\n", il, (unsigned long long) hits, (unsigned long long) misses);
        }
    }
    return 0;
}
