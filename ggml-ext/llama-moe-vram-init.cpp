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

// the device companions built so far: handed to the model once start-up has succeeded, freed with
// the start-up otherwise (a cache that turns itself off keeps no device memory)
using llama_moe_held_buffers = std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>>;

// the device companions of the layers `ils` in buft, one context + buffer (into `held`); the layers
// are appended to vram.layers. Returns false (logged) when the buffer cannot be allocated.
static bool llama_moe_vram_alloc(llama_model & model, llama_moe_tiers & mc, ggml_backend_buffer_type_t buft,
                                 const std::vector<int> & ils, int32_t dev_slots, int32_t n_stage, std::string & budgets,
                                 llama_moe_held_buffers & held) {
    auto & vram = mc.vram;
    const int32_t n_expert = (int32_t) model.hparams.n_expert;
    const int32_t n_used   = (int32_t) model.hparams.n_expert_used();
    ggml_init_params params = {
        /*.mem_size   =*/ (ils.size() * (LLAMA_MOE_N_PROJ + LLAMA_MOE_N_BIAS + 1) + 1) * ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr ctx { ggml_init(params) };
    // one id->slot table for all the device's layers: one copy publishes a step's changes
    llama_moe_vram::device_table tb;
    tb.t = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, (int64_t) n_expert * (int64_t) ils.size());
    ggml_format_name(tb.t, "ffn_exps.cache_tables");
    tb.host.assign((size_t) ggml_nelements(tb.t), 0);
    const int32_t itb = (int32_t) vram.tables.size();
    for (const int & il : ils) { // by reference: its index in ils places its table
        const auto & layer = model.layers[il];
        llama_moe_vram_layer l;
        l.il = il; l.n_expert = n_expert; l.n_used = n_used; l.n_phys = dev_slots + n_stage; l.log = &mc.log;
        l.ir = vram.res.add_layer(n_expert, dev_slots, n_stage);
        const char * names[LLAMA_MOE_N_PROJ] = {};
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        l.n_proj = llama_moe_layer_exps(layer, exps, names);
        for (int p = 0; p < l.n_proj; ++p) {
            const ggml_tensor * t = exps[p];
            l.exps[p] = t;
            l.src[p]  = mc.sources.tensors.at(ggml_get_name(t));
            l.expert_nbytes[p] = t->nb[2];
            GGML_ASSERT(l.src[p].nbytes == t->nb[2] * (size_t) n_expert && "expert layout differs from the GGUF");
            l.slots[p] = ggml_new_tensor_3d(ctx.get(), t->type, t->ne[0], t->ne[1], l.n_phys + 1);
            // the ".cache" suffix is a contract: backends that transform weights in place on first
            // use (SYCL's reorder, patch 0011) skip tensors named so, since their slices are rewritten
            ggml_format_name(l.slots[p], "blk.%d.ffn_%s_exps.cache", il, names[p]);
        }
        l.n_bias = llama_moe_bias_list(layer, l.bias_host);
        for (int b = 0; b < l.n_bias; ++b) {
            l.bias_dev[b] = ggml_dup_tensor(ctx.get(), l.bias_host[b]);
            ggml_format_name(l.bias_dev[b], "%s.cache_copy", ggml_get_name(l.bias_host[b])); // not ".cache": written once, SYCL may reorder it
        }
        l.tb      = itb;
        l.tb_offs = (size_t) n_expert * (size_t) (&il - ils.data());
        l.dev_table = ggml_view_2d(ctx.get(), tb.t, 1, n_expert, sizeof(int32_t), l.tb_offs * sizeof(int32_t));
        ggml_format_name(l.dev_table, "blk.%d.ffn_exps.cache_table", il);
        vram.layer_of_il[il] = (int32_t) vram.layers.size();
        vram.layers.push_back(std::move(l));
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
    if (buf == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-cache: cannot allocate %d slots per layer in %s; the cache is OFF\n",
                __func__, dev_slots, ggml_backend_buft_name(buft));
        return false;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(buf, 0); // every slot, including the dummy slot, computes exact zeros
    vram.tables.push_back(std::move(tb));
    std::vector<uint8_t> bias_bytes;   // the bias copies: the model's values, once
    for (size_t li = vram.layers.size() - ils.size(); li < vram.layers.size(); ++li) {
        const auto & l = vram.layers[li];
        for (int b = 0; b < l.n_bias; ++b) {
            bias_bytes.resize(ggml_nbytes(l.bias_host[b]));
            ggml_backend_tensor_get(l.bias_host[b], bias_bytes.data(), 0, bias_bytes.size());
            ggml_backend_tensor_set(l.bias_dev[b], bias_bytes.data(), 0, bias_bytes.size());
        }
    }
    const size_t size = ggml_backend_buffer_get_size(buf);
    vram.alloc_bytes += size;
    budgets += format("%s%s:%.2f", budgets.empty() ? "" : ",", ggml_backend_buft_name(buft), size/1024.0/1024.0);
    vram.devices.push_back({ ggml_backend_buft_name(buft), (int64_t) dev_slots * (int64_t) ils.size(), size });
    // what the bytes are: resident slots, staging slots (uploads land there), the zero slot, and the rest
    // (the id->slot table and the bias copies, plus alignment)
    double slots_b = 0.0, stage_b = 0.0, zero_b = 0.0;
    for (size_t li = vram.layers.size() - ils.size(); li < vram.layers.size(); ++li) {
        const double e = (double) vram.layers[li].expert_bytes();
        slots_b += e * dev_slots;
        stage_b += e * n_stage;
        zero_b  += e;
    }
    const double mib = 1024.0 * 1024.0;
    LLAMA_LOG_INFO("%s: moe-cache: %8.2f MiB of expert slots for %zu layers in %s: %.2f MiB resident slots (%d/layer), "
            "%.2f MiB staging (%d/layer), %.2f MiB zero slot, %.2f MiB tables and bias copies\n", __func__,
            size/mib, ils.size(), ggml_backend_buft_name(buft), slots_b/mib, dev_slots, stage_b/mib, n_stage, zero_b/mib,
            std::max(0.0, size - slots_b - stage_b - zero_b)/mib);
    held.emplace_back(std::move(ctx), ggml_backend_buffer_ptr(buf));
    return true;
}

// host companions: the table the CPU MUL_MAT_ID reads (src[3]) and the observed routing
static void llama_moe_vram_alloc_host(llama_moe_tiers & mc) {
    auto & vram = mc.vram;
    ggml_init_params params = {
        /*.mem_size   =*/ vram.layers.size() * 2 * ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    vram.host_ctx.reset(ggml_init(params));
    for (auto & l : vram.layers) {
        l.host_table = ggml_new_tensor_1d(vram.host_ctx.get(), GGML_TYPE_I32, l.n_expert);
        ggml_format_name(l.host_table, "blk.%d.ffn_exps.cache_table_host", l.il);
        l.observed = ggml_new_tensor_1d(vram.host_ctx.get(), GGML_TYPE_I32, (int64_t) l.n_used * mc.max_batch);
        ggml_format_name(l.observed, "blk.%d.ffn_exps.cache_observed", l.il);
    }
    vram.host_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(vram.host_ctx.get(), ggml_backend_cpu_buffer_type()));
    GGML_ASSERT(vram.host_buf);
    vram.alloc_bytes += ggml_backend_buffer_get_size(vram.host_buf.get());
    for (auto & l : vram.layers) {
        std::fill((int32_t *) l.observed->data, (int32_t *) l.observed->data + ggml_nelements(l.observed), -1);
    }
    vram.publish(); // every layer is dirty since add_layer
}

// the tier's start line, its metrics preamble (one line, key=value, parsed by pybmoe.engine.parse_cache_preamble)
// and the cliff guard's WARN
static void llama_moe_vram_log_start(const llama_moe_vram & vram, const llama_moe_tiers & owner, int n_moe, int32_t n_expert,
                                     int32_t n_used, int32_t n_slots, int32_t n_slots_min, int32_t n_inserts,
                                     const std::string & budgets) {
    const char * fn = "llama_moe_vram_init";
    const auto & l0 = vram.layers[0];
    const int32_t n_stage = vram.res.layers[l0.ir].n_stage;
    LLAMA_LOG("%s: moe-cache: %zu of %d MoE layers cached, %d slots/layer (+%d staging, +1 zero) of %d experts, "
            "top-k %d, expert %.3f MiB, inserts/step %s\n", fn, vram.layers.size(), n_moe, n_slots, n_stage,
            n_expert, n_used, l0.expert_bytes()/1024.0/1024.0, n_inserts > 0 ? std::to_string(n_inserts).c_str() : "unlimited");

    // the metrics preamble: one line, key=value, parsed by pybmoe.engine.parse_cache_preamble
    // cache_cycle_mb: the worst-case bytes one token needs, every cached layer's experts x min(top-k, n_expert)
    double cycle_mib = 0.0;
    for (const auto & l : vram.layers) {
        cycle_mib += (double) l.expert_bytes() * std::min(l.n_used, l.n_expert) / 1024.0 / 1024.0;
    }
    // slots, staging and the zero slot per layer, separately: staging and zero never hold residents
    LLAMA_LOG("moe-cache-preamble: layers=%zu n_expert=%d top_k=%d slots=%d staging=%d zero=1 inserts=%d max_batch=%d "
            "slot_mib=%.4f budget_mib=%s cache_cycle_mb=%.2f layer_cycle_slots=%d\n", vram.layers.size(), n_expert, n_used,
            n_slots, n_stage, n_inserts, owner.max_batch, l0.expert_bytes()/1024.0/1024.0, budgets.c_str(), cycle_mib, n_used);
    if (n_slots_min < n_used) {
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
    if (is_auto || budget_mib > 0) {
        n_slots = n_expert; // the most any device can get; each device is sized below
    } else if (n_slots > n_expert) {
        LLAMA_LOG_INFO("%s: moe-cache: %d slots > %d experts per layer, clamped to %d\n", __func__, n_slots, n_expert, n_expert);
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
    n_slots = 0;
    int32_t n_slots_min = n_expert;
    for (const auto & [buft, s] : slots_of) {
        n_slots     = std::max(n_slots, s);
        n_slots_min = std::min(n_slots_min, s);
    }

    vram.n_slots       = n_slots;
    vram.res.n_inserts = n_inserts;
    vram.layer_of_il.assign(model->layers.size(), -1);
    size_t n_layers = 0;
    for (const auto & [buft, ils] : by_buft) {
        n_layers += ils.size();
    }
    vram.layers.reserve(n_layers);
    std::string budgets; // "<buft>:<MiB>,..." for the preamble
    llama_moe_held_buffers held;
    for (const auto & [buft, ils] : by_buft) {
        const int32_t dev_slots = slots_of.at(buft);
        if (!llama_moe_vram_alloc(*model, *mc, buft, ils, dev_slots, stage_for(dev_slots), budgets, held)) {
            vram.disable(); // before `held` frees the tensors its layers point at
            return -1;
        }
    }
    llama_moe_vram_alloc_host(*mc);

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
