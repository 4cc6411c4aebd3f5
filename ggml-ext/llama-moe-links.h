#pragma once

// pybmoe: what one tier lends another, as interfaces the owner (llama_moe_tiers, llama-moe-model.h)
// wires together. No tier includes another tier's header or calls another tier's methods: the stream
// tier asks `llama_moe_device_residents` which experts a device computes; the VRAM tier's uploads ask
// `llama_moe_ram_copies` for the bytes the stream tier holds in RAM.
//
// Holds: the two interfaces. Must not hold: any tier's state or rules.

#include "llama-moe-base.h"

#include <cstdint>

// one layer's device residents: expert e is computed on the device when slot[e] < n_phys (slot: I32
// [n_expert], the published id -> slot table; a value of n_phys or more is not resident)
struct llama_moe_device_slots {
    const int32_t * slot   = nullptr; // nullptr: no device holds the layer's experts
    int32_t         n_phys = 0;
};

// the VRAM tier's residents, as the stream tier sees them in a layer step the VRAM tier serves
struct llama_moe_device_residents {
    virtual ~llama_moe_device_residents() = default;

    // model layer il's residents; valid while a graph of that step runs
    virtual llama_moe_device_slots device_slots(int32_t il) const = 0;
};

// the RAM copies of streamed experts, as the VRAM tier's uploads read them instead of the file
struct llama_moe_ram_copies {
    virtual ~llama_moe_ram_copies() = default;

    // whether model layer il's experts are streamed: then its host tensors do not hold their bytes (read
    // them from a pinned copy or the file)
    virtual bool streams(int32_t il) const = 0;

    // when expert e of model layer il is resident in RAM: pins it, sets mem[p] to its bytes per
    // projection and returns its entry; else -1 (read it from the file)
    virtual int32_t pin(int32_t il, int32_t e, const void * mem[LLAMA_MOE_N_PROJ]) = 0;

    // the upload that pinned `entry` has read it
    virtual void unpin(int32_t entry) = 0;
};
