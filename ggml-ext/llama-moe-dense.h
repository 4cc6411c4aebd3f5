#pragma once

// pybmoe: the policy for the non-expert ("dense") weights in host memory (--dense-weights
// mmap|warm|anon, the BigMoeOnEdge seed's). With the stream tier on, the experts leave the page
// cache; the dense weights are touched by every token and must not be what a memory limit reclaims.
//
// Holds: the anonymous buffers the dense tensors are rebound to under `anon`, and the warm-up read.
// Must not hold: the experts (llama-moe-stream.h) or read mechanics (llama-moe-source.h).

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

struct llama_moe_dense {
    int32_t mode = 0; // LLAMA_MOE_DENSE_*
    std::vector<std::pair<void *, size_t>> regions; // anon: the reservations the tensors read from

    ~llama_moe_dense();
};
