// pybmoe: the VRAM tier's start-up: which layers it caches, how many slots each device gets (fixed
// or auto, floor, ceiling, --fit), the companion tensors' allocation and the preamble line.
// See llama-moe-vram.h.
//
// Holds: load-time decisions and their log lines. Must not hold: anything that runs per step
// (llama-moe-vram.cpp) or graph code (llama-moe-graph.cpp).

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>

// the --fit request of this thread: its probe loads of the main model count the slots (the probes
// load the model themselves, on the thread that asked; a draft model's probes, another file, count nothing)
struct llama_moe_fit_request {
    std::string path;
    int32_t     slots   = 0;
    int32_t     inserts = 0;
};
static thread_local llama_moe_fit_request g_llama_moe_fit;

// the CUDA backend family, by the backend that owns the device (its registry name is GGML_CUDA_NAME:
// "CUDA", "ROCm" when built for AMD GPUs with HIP, "MUSA" for Moore Threads GPUs), not by a buffer
// type name prefix, which a MUSA device does not share
static bool llama_moe_is_cuda(ggml_backend_buffer_type_t buft) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    const char * name = reg ? ggml_backend_reg_name(reg) : "";
    return strcmp(name, "CUDA") == 0 || strcmp(name, "ROCm") == 0 || strcmp(name, "MUSA") == 0;
}

// a buffer type that spreads one tensor over several devices: SYCL's row split (-sm row, named
// "<backend>_Split") or the meta backend's ("Meta(CUDA0,CUDA1)"). Slots are written per expert at an
// offset, which such a buffer cannot take (ggml-sycl asserts offset 0 on its first upload)
static bool llama_moe_buft_is_split(ggml_backend_buffer_type_t buft) {
    const char * name = ggml_backend_buft_name(buft);
    return strncmp(name, "Meta(", 5) == 0 || strstr(name, "_Split") != nullptr;
}

static bool llama_moe_buft_is_host(ggml_backend_buffer_type_t buft) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    return dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU || ggml_backend_buft_is_host(buft);
}

static std::string llama_moe_list_of(const std::vector<int> & ils) {
    std::string list;
    for (int il : ils) {
        list += (list.empty() ? "" : ",") + std::to_string(il);
    }
    return list;
}

// the layers the tier can cache, by the buffer type of their router; every reason a MoE layer with
// host experts is not cached is one WARN line (not for a --fit estimate). n_moe: the MoE layers.
static std::map<ggml_backend_buffer_type_t, std::vector<int>> llama_moe_vram_select(
        const llama_model & model, const llama_moe_sources & sources, bool estimate, int & n_moe) {
    const int32_t n_expert = (int32_t) model.hparams.n_expert;
    std::map<ggml_backend_buffer_type_t, std::vector<int>> by_buft;
    std::map<std::string, std::vector<int>> not_cached; // reason -> layers
    std::map<std::string, std::vector<int>> pinned;     // experts in another device's host buffer -> layers
    n_moe = 0;
    for (int il = 0; il < (int) model.layers.size(); ++il) {
        const auto & layer = model.layers[il];
        if (!llama_moe_is_moe_layer(layer)) {
            continue;
        }
        n_moe++;
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        const int n_proj = llama_moe_layer_exps(layer, exps);
        if (n_proj == 0) {
            not_cached["the layer has no down experts"].push_back(il);
            continue;
        }
        ggml_backend_buffer_type_t ebuft = ggml_backend_buffer_get_type(exps[0]->buffer);
        if (!llama_moe_buft_is_host(ebuft)) {
            continue; // experts already on a device: nothing to cache
        }
        ggml_backend_buffer_type_t rbuft = ggml_backend_buffer_get_type(layer.ffn_gate_inp->buffer);
        if (llama_moe_buft_is_host(rbuft) && model.n_devices() == 0) {
            continue; // no device at all: said once by the caller
        }
        if (llama_moe_buft_is_host(rbuft)) {
            // slots go where the router is; a router that fell back to a host (or pinned host) buffer,
            // for example a type the device does not support, or -ot on the router, leaves no device
            not_cached[format("the router ffn_gate_inp (%s) is in host buffer type %s, so there is no device to "
                    "hold slots; keep it on the device", ggml_type_name(layer.ffn_gate_inp->type),
                    ggml_backend_buft_name(rbuft))].push_back(il);
            continue;
        }
        if (llama_moe_buft_is_split(rbuft)) {
            not_cached[format("the router ffn_gate_inp is in %s, a buffer type split over several devices (-sm row "
                    "or tensor parallelism), and the cache allocates its slots per device; use -sm layer",
                    ggml_backend_buft_name(rbuft))].push_back(il);
            continue;
        }
        if (llama_moe_is_cuda(rbuft)) {
            bool quantized = true;
            for (int p = 0; p < n_proj; ++p) {
                quantized = quantized && ggml_is_quantized(exps[p]->type);
            }
            if (!quantized) {
                not_cached[format("%s experts on %s would run the MMF kernels, which are not exact with duplicate expert "
                        "ids yet (docs/backends.md, CUDA)", ggml_type_name(exps[0]->type),
                        ggml_backend_buft_name(rbuft))].push_back(il);
                continue;
            }
        }
        bool ok = true;
        for (int p = 0; p < n_proj; ++p) {
            ok = ok && sources.tensors.count(ggml_get_name(exps[p])) && exps[p]->ne[2] == n_expert;
        }
        if (!ok) {
            not_cached["expert tensors have no GGUF source"].push_back(il);
            continue;
        }
        by_buft[rbuft].push_back(il);
        ggml_backend_dev_t edev = ggml_backend_buft_get_device(ebuft);
        if (edev != nullptr && ggml_backend_dev_type(edev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            // host memory that belongs to another device: without mmap (--load-mode none), llama.cpp's
            // CPU buffer list puts CPU weights in the first GPU's pinned host buffer (CUDA_Host,
            // Vulkan_Host, ...); the cache serves them all the same (the host chain reads host memory,
            // uploads copy from it), but it is not the plain CPU buffer that --cpu-moe / -ot exps=CPU
            // suggest: say so
            pinned[format("%s, the pinned host memory of %s", ggml_backend_buft_name(ebuft),
                    ggml_backend_dev_name(edev))].push_back(il);
        }
    }
    if (!estimate) {
        for (const auto & [why, ils] : not_cached) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING %zu layer(s) not cached (%s): %s\n", __func__, ils.size(),
                    llama_moe_list_of(ils).c_str(), why.c_str());
        }
        for (const auto & [where, ils] : pinned) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING the experts of %zu MoE layer(s) (%s) are in buffer type %s, "
                    "not a CPU buffer (llama.cpp puts CPU weights there when the model is not memory-mapped); the "
                    "cache serves them, but they hold page-locked RAM: --no-host keeps them in a CPU buffer\n",
                    __func__, ils.size(), llama_moe_list_of(ils).c_str(), where.c_str());
        }
    }
    return by_buft;
}

// the backends' limits on the ubatch the cache serves
static void llama_moe_vram_cap_batch(llama_moe_tiers & mc, const std::map<ggml_backend_buffer_type_t, std::vector<int>> & by_buft) {
    // Vulkan: duplicate expert ids are exact at any batch with patch 0013, but on lavapipe with
    // GGML_VK_DISABLE_FUSION the first decode after a cached ubatch of 32 tokens crashes in the driver
    // (docs/backends.md; cause not found, ubatches of up to 31 tokens run), so the cache serves at most
    // 16 tokens there
    constexpr int32_t vk_max_batch = 16;
    for (const auto & [buft, ils] : by_buft) {
        if (mc.max_batch > vk_max_batch && strncmp(ggml_backend_buft_name(buft), "Vulkan", 6) == 0) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING %s: the cache serves ubatches of at most %d tokens on Vulkan "
                    "(asked: %d; larger cached ubatches are not verified there, docs/backends.md)\n", __func__,
                    ggml_backend_buft_name(buft), vk_max_batch, mc.max_batch);
            mc.max_batch = vk_max_batch;
        }
    }

    // CUDA/HIP: MUL_MAT_ID is exact with duplicate ids only on the mat-vec path (mmvq), which quantized
    // experts take up to 4..8 tokens depending on type and GPU (get_mmvq_mmid_max_batch); MMQ and MMF are
    // not (docs/backends.md; patches/candidates/cuda-mul-mat-id-duplicate-ids.patch awaits a GPU run)
    constexpr int32_t cuda_max_batch = 4;
    for (const auto & [buft, ils] : by_buft) {
        if (mc.max_batch > cuda_max_batch && llama_moe_is_cuda(buft)) {
            LLAMA_LOG_WARN("%s: moe-cache: WARNING %s: the cache serves ubatches of at most %d tokens on CUDA (asked: %d; "
                    "larger ones would run MUL_MAT_ID kernels that are not exact with duplicate expert ids yet, "
                    "docs/backends.md)\n", __func__, ggml_backend_buft_name(buft), cuda_max_batch, mc.max_batch);
            mc.max_batch = cuda_max_batch;
        }
    }
}

// the --fit probe: the slot tensors of each device, in a dummy buffer that the model's memory
// breakdown sizes from its context (as for the probe's own weights)
static void llama_moe_vram_fit_count(llama_model & model, const std::map<ggml_backend_buffer_type_t, std::vector<int>> & by_buft,
                                     const std::map<ggml_backend_buffer_type_t, int32_t> & slots_of,
                                     const std::function<int32_t(int32_t)> & stage_for) {
    const int32_t n_expert = (int32_t) model.hparams.n_expert;
    for (const auto & [buft, ils] : by_buft) {
        const int32_t dev_slots = slots_of.at(buft);
        ggml_init_params params = { ils.size() * (LLAMA_MOE_N_PROJ + LLAMA_MOE_N_BIAS + 1) * ggml_tensor_overhead(), nullptr, true };
        ggml_context_ptr ctx { ggml_init(params) };
        for (int il : ils) {
            const auto & layer = model.layers[il];
            const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
            const int n_proj = llama_moe_layer_exps(layer, exps);
            for (int p = 0; p < n_proj; ++p) {
                const ggml_tensor * t = exps[p];
                ggml_new_tensor_3d(ctx.get(), t->type, t->ne[0], t->ne[1], dev_slots + stage_for(dev_slots) + 1);
            }
            const ggml_tensor * bias[LLAMA_MOE_N_BIAS] = {};
            for (int b = 0, nb = llama_moe_bias_list(layer, bias); b < nb; ++b) {
                ggml_dup_tensor(ctx.get(), bias[b]);
            }
            ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, 1, n_expert);
        }
        ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, 0);
        if (buf == nullptr) {
            return;
        }
        LLAMA_LOG_INFO("%s: moe-cache: --fit counts %.2f MiB of expert slots in %s\n", __func__,
                ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.get(), buft) / 1024.0 / 1024.0,
                ggml_backend_buft_name(buft));
        model.add_owned_buffer(std::move(ctx), ggml_backend_buffer_ptr(buf));
    }
}

// the tier's start line, its metrics preamble (one line, key=value, parsed by pybmoe.engine.parse_cache_preamble)
// and the cliff guard's WARN
static void llama_moe_vram_log_start(const llama_moe_vram & vram, const llama_moe_tiers & owner, int n_moe, int32_t n_expert,
                                     int32_t n_used, int32_t n_slots, int32_t n_slots_min, int32_t n_inserts,
                                     const std::string & budgets) {
    const char * fn = "llama_moe_vram_init";
    const auto & l0 = vram.layers[0];
    int32_t n_stage = vram.res.layers[l0.ir].n_stage;
    std::string pool; // the pool's banks: slots, staging and zero slots over all of them
    if (!vram.res.banks.empty()) {
        int64_t P = 0, S = 0;
        for (const auto & bk : vram.res.banks) {
            P += bk.n_slots;
            S += bk.n_stage;
        }
        n_stage = (int32_t) (S / (int64_t) vram.layers.size());
        pool = format(" pool=%lld pool_staging=%lld banks=%zu", (long long) P, (long long) S, vram.res.banks.size());
        LLAMA_LOG("%s: moe-cache: %zu of %d MoE layers cached, one pool per device: %lld slots over (layer, expert) "
                "(%d/layer on average, +%lld staging, +%zu zero) of %d experts, top-k %d, expert %.3f MiB, floor %d/layer, "
                "inserts/step %s\n", fn, vram.layers.size(), n_moe, (long long) P, n_slots, (long long) S,
                vram.res.banks.size(), n_expert, n_used, l0.expert_bytes()/1024.0/1024.0, vram.res.banks[0].floor,
                n_inserts > 0 ? std::to_string(n_inserts).c_str() : "unlimited");
    } else {
        LLAMA_LOG("%s: moe-cache: %zu of %d MoE layers cached, %d slots/layer (+%d staging, +1 zero) of %d experts, "
                "top-k %d, expert %.3f MiB, inserts/step %s\n", fn, vram.layers.size(), n_moe, n_slots, n_stage,
                n_expert, n_used, l0.expert_bytes()/1024.0/1024.0, n_inserts > 0 ? std::to_string(n_inserts).c_str() : "unlimited");
    }

    // the metrics preamble: one line, key=value, parsed by pybmoe.engine.parse_cache_preamble
    // cache_cycle_mb: the worst-case bytes one token needs, every cached layer's experts x min(top-k, n_expert)
    double cycle_mib = 0.0;
    for (const auto & l : vram.layers) {
        cycle_mib += (double) l.expert_bytes() * std::min(l.n_used, l.n_expert) / 1024.0 / 1024.0;
    }
    // slots, staging and the zero slot per layer, separately: staging and zero never hold residents
    LLAMA_LOG("moe-cache-preamble: layers=%zu n_expert=%d top_k=%d slots=%d staging=%d zero=1 inserts=%d max_batch=%d "
            "slot_mib=%.4f budget_mib=%s cache_cycle_mb=%.2f layer_cycle_slots=%d%s\n", vram.layers.size(), n_expert, n_used,
            n_slots, n_stage, n_inserts, owner.max_batch, l0.expert_bytes()/1024.0/1024.0, budgets.c_str(), cycle_mib, n_used,
            pool.c_str());
    if (!vram.res.banks.empty()) {
        // the cliff guard, for each bank of the pool under its token cycle (its layers x top-k)
        for (const auto & bk : vram.res.banks) {
            const int64_t cycle = (int64_t) bk.layers.size() * std::min(n_used, n_expert);
            if (bk.n_slots < cycle) {
                LLAMA_LOG_WARN("%s: moe-cache: WARNING a pool of %d slots over %zu layers is below their token cycle of "
                        "%lld slots at top-k %d: one token's experts cannot all stay resident until the next token (the "
                        "floor keeps %d per layer)\n", fn, bk.n_slots, bk.layers.size(), (long long) cycle, n_used, bk.floor);
            }
        }
    } else if (n_slots_min < n_used) {
        // the cliff guard: state the fact, once, at load
        LLAMA_LOG_WARN("%s: moe-cache: WARNING %d slots/layer is below the per-layer token cycle of %d slots at "
                "top-k %d: one token's experts cannot all stay resident until the next token\n",
                fn, n_slots_min, n_used, n_used);
    }
}

int32_t llama_moe_vram_init(llama_model * model, int32_t n_slots, int32_t n_inserts, int32_t floor_mib, int32_t ceil_mib,
                            int32_t budget_mib) {
    const bool is_auto = n_slots == LLAMA_MOE_CACHE_AUTO;
    if (model == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-cache: no model\n", __func__);
        return -1;
    }
    if ((n_slots < 0 && !is_auto) || n_inserts < 0 || floor_mib < 0 || ceil_mib < 0 || budget_mib < 0) {
        LLAMA_LOG_ERROR("%s: moe-cache: slots (%d), inserts (%d), floor (%d MiB), ceil (%d MiB) and budget (%d MiB) must be "
                ">= 0\n", __func__, n_slots, n_inserts, floor_mib, ceil_mib, budget_mib);
        return -1;
    }
    if (n_slots == 0 && budget_mib == 0) {
        return 0;
    }
    const auto & hp = model->hparams;
    if (hp.n_expert == 0) {
        LLAMA_LOG_WARN("%s: moe-cache: model has no MoE layers; --moe-expert-cache is inert\n", __func__);
        return 0;
    }
    // a memory-estimation load (the --fit probe): size the slots and give their tensors a dummy
    // buffer, so that the model's memory breakdown counts them on the right device; nothing runs
    const bool estimate = hp.no_alloc;
    llama_moe_tiers * mc = model->moe_cache;
    if (mc == nullptr || mc->sources.empty()) {
        LLAMA_LOG_ERROR("%s: moe-cache: the cache was requested but the model was not loaded from a GGUF file path, "
                "so expert bytes have no source; the cache is OFF\n", __func__);
        return -1;
    }
    auto & vram = mc->vram;
    if (vram.enabled()) {
        LLAMA_LOG_ERROR("%s: moe-cache: already initialized with %d slots\n", __func__, vram.n_slots);
        return -1;
    }
    const int32_t n_expert = (int32_t) hp.n_expert;
    const int32_t n_used   = (int32_t) hp.n_expert_used();
    const std::string req = is_auto ? "auto" : budget_mib > 0 ? format("%d MiB of", budget_mib) : std::to_string(n_slots);
    // a budget in MiB per device, given or auto (the free memory), is one pool per device and expert shape
    // (docs/expert-cache.md, "The pool": chosen by simulation on every real trace); slots per layer given as a
    // count stay each layer's own
    const bool pool = budget_mib > 0 || is_auto;
    if (is_auto || budget_mib > 0) {
        n_slots = n_expert; // the most any device can get; each device is sized below
    } else if (n_slots > n_expert) {
        LLAMA_LOG_WARN("%s: moe-cache: %d slots > %d experts per layer, clamped to %d\n", __func__, n_slots, n_expert, n_expert);
        n_slots = n_expert;
    }

    int n_moe = 0;
    auto by_buft = llama_moe_vram_select(*model, mc->sources, estimate, n_moe);
    if (n_moe == 0) {
        LLAMA_LOG_WARN("%s: moe-cache: model has no MoE layers; --moe-expert-cache is inert\n", __func__);
        return 0;
    }
    if (by_buft.empty() && model->n_devices() == 0) {
        if (estimate) {
            return 0;
        }
        LLAMA_LOG_WARN("%s: moe-cache: WARNING requested %s slots but there is no device to hold them (this build has no "
                "GPU backend and no --rpc device was given): the cache is OFF; pass --rpc HOST:PORT (a ggml-rpc-server) "
                "or build with a GPU backend (CMAKE_ARGS=-DGGML_CUDA=ON or -DGGML_VULKAN=ON)\n", __func__,
                req.c_str());
        return -1;
    }
    if (by_buft.empty()) {
        if (estimate) {
            return 0;
        }
        LLAMA_LOG_WARN("%s: moe-cache: WARNING requested %s slots but none of the %d MoE layers has host-resident experts "
                "with a device-resident router (offload layers with -ngl and keep experts on the host with --cpu-moe, "
                "--n-cpu-moe or -ot exps=CPU); the cache is OFF\n", __func__,
                req.c_str(), n_moe);
        return -1;
    }
    llama_moe_vram_cap_batch(*mc, by_buft);

    // staging slots: the uploads one step can start (llama-moe-residency.h)
    const std::function<int32_t(int32_t)> stage_for = [&](int32_t slots) {
        return llama_moe_stage_slots(n_expert, n_used, slots, n_inserts, mc->max_batch);
    };

    // slots per device (a --fit probe sizes fixed slots only: auto takes what is left after fitting)
    std::map<ggml_backend_buffer_type_t, int32_t> slots_of;
    if (!llama_moe_vram_size_devices(*model, *mc, by_buft, slots_of, n_slots, n_expert, is_auto, estimate, floor_mib, ceil_mib,
                                     budget_mib, stage_for)) {
        return LLAMA_MOE_CACHE_ERR_NO_ROOM;
    }
    if (by_buft.empty()) {
        if (estimate) {
            return 0;
        }
        LLAMA_LOG_WARN("%s: moe-cache: WARNING auto sizing left no device with room for a slot; the cache is OFF\n", __func__);
        return -1;
    }
    if (estimate) {
        llama_moe_vram_fit_count(*model, by_buft, slots_of, stage_for);
        return 0;
    }
    std::string budgets; // "<buft>:<MiB>,..." for the preamble
    llama_moe_held_buffers held;
    int32_t n_slots_min = n_expert;
    if (!llama_moe_vram_alloc_devices(*model, *mc, by_buft, slots_of, stage_for, pool, n_inserts, budgets, held, n_slots_min)) {
        return -1;
    }
    n_slots = vram.n_slots;

    std::string err;
    // uploads of experts held in RAM (the stream tier's copies) read that copy, pinned until they are done
    llama_moe_ram_copies * ram = vram.ram;
    vram.uploader.on_done = [ram](int32_t entry) {
        if (ram != nullptr) {
            ram->unpin(entry);
        }
    };
    if (!vram.uploader.start(mc->sources.paths, err)) {
        const uint64_t freed = vram.alloc_bytes;
        vram.disable(); // and `held` frees every device buffer on return
        LLAMA_LOG_ERROR("%s: moe-cache: cannot open %s to read expert bytes; the cache is OFF (%.2f MiB it had "
                "allocated are freed)\n", __func__, err.c_str(), freed/1024.0/1024.0);
        return -1;
    }
    for (auto & [ctx, buf] : held) {
        model->add_owned_buffer(std::move(ctx), std::move(buf)); // counted in the model's memory breakdown
    }

    vram.routed.reset(new std::atomic<bool>[vram.layers.size()]);
    for (size_t i = 0; i < vram.layers.size(); ++i) {
        vram.routed[i] = false;
    }
    vram.routed_checked = false;

    llama_moe_vram_log_start(vram, *mc, n_moe, n_expert, n_used, n_slots, n_slots_min, n_inserts, budgets);
    return (int32_t) vram.layers.size();
}

void llama_moe_vram_fit_probe(llama_model & model, const std::string & path) {
    const auto & fit = g_llama_moe_fit;
    if (model.hparams.no_alloc && fit.slots > 0 && path == fit.path) {
        llama_moe_vram_init(&model, fit.slots, fit.inserts, 0, 0, 0);
    }
}

//
// C API
//

int32_t llama_model_moe_cache_init(llama_model * model, int32_t n_slots, int32_t n_inserts) {
    return llama_moe_vram_init(model, n_slots, n_inserts, LLAMA_MOE_CACHE_FLOOR_MIB_DEFAULT, 0, 0);
}

int32_t llama_model_moe_cache_init_budget(llama_model * model, int32_t n_slots, int32_t n_inserts,
                                          int32_t floor_mib, int32_t ceil_mib) {
    return llama_moe_vram_init(model, n_slots, n_inserts, floor_mib, ceil_mib, 0);
}

int32_t llama_model_moe_cache_init_mib(llama_model * model, int32_t budget_mib, int32_t n_inserts, int32_t floor_mib) {
    if (budget_mib <= 0) {
        LLAMA_LOG_ERROR("%s: moe-cache: --moe-expert-cache-mb %d: give 1 MiB or more (or auto)\n", __func__, budget_mib);
        return -1;
    }
    return llama_moe_vram_init(model, 0, n_inserts, floor_mib, 0, budget_mib);
}

int32_t llama_model_moe_cache_init_auto(llama_model * model, int32_t n_inserts, int32_t floor_mib, int32_t ceil_mib) {
    return llama_moe_vram_init(model, LLAMA_MOE_CACHE_AUTO, n_inserts, floor_mib, ceil_mib, 0);
}

void llama_moe_cache_fit_request(const char * path_model, int32_t n_slots, int32_t n_inserts) {
    g_llama_moe_fit.path    = path_model ? path_model : "";
    g_llama_moe_fit.slots   = path_model ? std::max(n_slots, 0) : 0;
    g_llama_moe_fit.inserts = std::max(n_inserts, 0);
}
