// pybmoe: the VRAM tier's sizing at load: the MiB of one slot in every layer of a device, and the slots
// each device gets (fixed slots, auto from free memory, floor and ceiling, or MiB per device). See
// llama-moe-vram.h.
//
// Holds: the arithmetic of the slots per device and its lines. Must not hold: the layer pick, the
// allocation (llama-moe-vram-init.cpp) or anything that runs per step.

#include "llama-moe-model.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <cmath>
#include <functional>
#include <map>

// MiB of one slot in every layer of `ils`, and of their bias copies
void llama_moe_vram_layer_mib(const llama_model & model, const std::vector<int> & ils, double & per_slot, double & fixed) {
    per_slot = 0.0;
    fixed    = 0.0;
    for (int il : ils) {
        const auto & layer = model.layers[il];
        const ggml_tensor * bias[LLAMA_MOE_N_BIAS] = {};
        for (int b = 0, nb = llama_moe_bias_list(layer, bias); b < nb; ++b) {
            fixed += ggml_nbytes(bias[b]) / 1024.0 / 1024.0;
        }
        const ggml_tensor * exps[LLAMA_MOE_N_PROJ] = {};
        const int n_proj = llama_moe_layer_exps(layer, exps);
        for (int p = 0; p < n_proj; ++p) {
            per_slot += exps[p]->nb[2] / 1024.0 / 1024.0;
        }
    }
}

// slots per device: fixed, the most that budget_mib holds (MiB per device), or (auto) the most that fit the
// device's free memory minus the floor, capped by the ceiling; chosen once, here, and never resized during
// generation. A device auto leaves at 0 slots is dropped from by_buft. false: a fixed size or a MiB budget
// does not fit a device (its line is logged)
bool llama_moe_vram_size_devices(const llama_model & model, const llama_moe_tiers & mc, llama_moe_vram_by_buft & by_buft,
                                 std::map<ggml_backend_buffer_type_t, int32_t> & slots_of, int32_t n_slots,
                                 int32_t n_expert, bool is_auto, bool estimate, int32_t floor_mib, int32_t ceil_mib,
                                 int32_t budget_mib, const std::function<int32_t(int32_t)> & stage_for) {
    // (a --fit probe sizes fixed slots only: auto takes what is left after fitting, so it reserves nothing there)
    for (auto it = by_buft.begin(); it != by_buft.end(); ) {
        const auto & [buft, ils] = *it;
        int32_t s = n_slots;
        if (estimate && (is_auto || budget_mib > 0)) {
            it = by_buft.erase(it);
            continue;
        }
        double per_slot = 0.0; // MiB of one slot in every layer on this device
        double fixed    = 0.0; // MiB of the bias copies of every layer on this device
        llama_moe_vram_layer_mib(model, ils, per_slot, fixed);
        // MiB of c slots per layer with their staging and the zero slot; the most slots (up to `from`) that fit
        auto need = [&](int32_t c) { return (c + stage_for(c) + 1) * per_slot + fixed; };
        auto most = [&](int32_t from, double budget) -> int32_t {
            for (int32_t c = from; c > 0; --c) {
                if (need(c) <= budget) {
                    return c;
                }
            }
            return 0;
        };
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        const double free_mib    = free / 1024.0 / 1024.0;
        const double reserve_mib = mc.reserve.count(dev) ? mc.reserve.at(dev) / 1024.0 / 1024.0 : 0.0;
        const std::string set_aside = reserve_mib > 0 ? format(" (%.0f MiB set aside for contexts)", reserve_mib) : "";
        double budget = free_mib - reserve_mib - floor_mib;
        if (budget_mib > 0) {
            // MiB per device (--moe-expert-cache-mb, upstream's --moe-cache-mib): the most slots per layer that
            // budget_mib holds; a budget over what the device has free, or under one slot per layer, is a load error
            s = most(n_expert, budget_mib);
            const double need1 = need(1);
            if (budget_mib > budget || s == 0) {
                LLAMA_LOG_ERROR("%s: moe-cache: --moe-expert-cache-mb %d on %s: %s; give %s\n", __func__, budget_mib,
                        ggml_backend_buft_name(buft), s == 0
                            ? format("one slot per layer needs %.1f MiB (%zu layers x (1 slot + %d staging + 1 zero) x "
                                     "%.3f MiB%s)", need1, ils.size(), stage_for(1), per_slot / ils.size(),
                                     fixed > 0 ? " + the expert biases" : "").c_str()
                            : format("it has %.0f MiB free%s and --moe-expert-cache-floor-mb keeps %d MiB free",
                                     free_mib, set_aside.c_str(), floor_mib).c_str(),
                        budget >= need1 ? format("%.0f .. %.0f MiB, or auto", std::ceil(need1), std::floor(budget)).c_str()
                                        : "auto, or more device memory");
                return false;
            }
            LLAMA_LOG("%s: moe-cache: %d MiB on %s -> %d slots/layer for %zu layers (%.2f MiB per slot of every layer)\n",
                    __func__, budget_mib, ggml_backend_buft_name(buft), s, ils.size(), per_slot);
            slots_of[buft] = s;
            ++it;
            continue;
        }
        if (!is_auto && !estimate && need(s) > budget) {
            // a fixed size the device cannot hold is an error at load, not an allocation failure later
            const int32_t fit = most(s - 1, budget);
            LLAMA_LOG_ERROR("%s: moe-cache: %d slots/layer need %.1f MiB on %s (%zu layers x (%d slots + %d staging + 1 zero) "
                    "x %.3f MiB%s), but it has %.0f MiB free%s and --moe-expert-cache-floor-mb keeps %d MiB free; %s\n",
                    __func__, s, need(s), ggml_backend_buft_name(buft), ils.size(), s, stage_for(s), per_slot / ils.size(),
                    fixed > 0 ? format(" + %.2f MiB of expert biases", fixed).c_str() : "", free_mib, set_aside.c_str(),
                    floor_mib, fit > 0 ? format("at most %d slots/layer fit (or use auto)", fit).c_str()
                                       : "the device is too small for even one slot per layer");
            return false;
        }
        if (is_auto) {
            if (ceil_mib > 0) {
                budget = std::min(budget, (double) ceil_mib);
            }
            s = most(n_expert, budget);
            LLAMA_LOG("%s: moe-cache: auto on %s: %.0f MiB free - %.0f MiB reserved for contexts - %d MiB floor%s -> "
                    "%d slots/layer for %zu layers (%.2f MiB per slot of every layer)\n", __func__,
                    ggml_backend_buft_name(buft), free_mib, reserve_mib, floor_mib,
                    ceil_mib > 0 ? format(", ceil %d MiB", ceil_mib).c_str() : "", s, ils.size(), per_slot);
            if (s == 0) {
                LLAMA_LOG_WARN("%s: moe-cache: WARNING auto resolved to 0 slots on %s: %.1f MiB left after the floor "
                        "(and ceiling) cannot hold one slot per layer plus staging and the zero slot (%.1f MiB); "
                        "its %zu layers are not cached\n", __func__, ggml_backend_buft_name(buft), budget,
                        (2 + stage_for(1)) * per_slot, ils.size());
                it = by_buft.erase(it);
                continue;
            }
        }
        slots_of[buft] = s;
        ++it;
    }
    return true;
}
