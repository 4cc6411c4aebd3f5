#pragma once

// pybmoe: the stream tier's page frames: the physical pages a resident expert's bytes live in, kept
// and handed from an evicted expert to an admitted one, instead of given back to the kernel at each
// eviction and faulted in again (zero-filled, charged, reclaimed for) at each miss.
//
// Why: an O_DIRECT read into pages the kernel must first allocate and zero costs this machine's
// CPUs about 0.5 s per GiB read (4 lanes, 8 MiB reads; 0.13 s per GiB into reused frames, 0.05 s
// into pages already mapped: docs/stream-tier.md, "Page frames"). A prefill that reads a 4 GiB
// model's experts pays that on every pass, on the 2 cores that also compute.
//
// How: one pool per expert tensor kind (projection). An expert's whole pages inside its bytes in that
// projection ("interior": the pages at its ends may hold a neighbour's bytes too, and stay anonymous,
// as before) get a frame's pages by the read lane, just before it reads them (so the compute thread
// does none of it); at eviction the pages go back to the frame and the interior to the reservation's
// anonymous, uncommitted memory, the frame to the free list, its pages still allocated. Two ways:
//   move (the default): the frames are ranges of one anonymous "park" reservation; a frame's pages
//     are moved to the interior with mremap(MREMAP_FIXED | MREMAP_DONTUNMAP), and back at eviction:
//     the page table entries move, nothing is looked up, faulted or zeroed (19 ms per GiB placed
//     against 132-213 ms for memfd's, docs/benchmarks/page-placement-2026-12-05/). DONTUNMAP leaves
//     the source mapped (empty), so no hole opens that another mapping of the process could take and
//     a later move or munmap would then destroy (hole.c there). An interior one page longer than the
//     frame's parked pages gets its last page faulted in. Kernels before 5.7 (no DONTUNMAP): memfd.
//   memfd: the frames are pages of one memfd (shared memory, charged to the process's cgroup like
//     anonymous memory), mapped onto the interior with mmap(MAP_FIXED | MAP_SHARED | MAP_POPULATE)
//     and replaced by anonymous memory at eviction (the tier before the move; its profile: 20 % of a
//     prefill's samples in that populate).
// So the bytes, the addresses and the policy are those of the anonymous reservation; only where the
// pages come from differs.
//
// Holds: the park (or the memfd), the frame of each entry, the free list and the move/map calls. Must
// not hold: the policy (llama-moe-residency.h) or the reads (llama-moe-source.h). Linux only;
// elsewhere, or when the park (or the memfd) cannot be made, every entry keeps anonymous pages (on()
// is false).

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

struct llama_moe_frames {
    // sets up frames of `frame_pages` pages for `n_entries` entries, at most `max_frames` of them
    // (vm.max_map_count bounds the mappings: see llama-moe-stream-init.cpp); `use_memfd`: the memfd way,
    // else the move. false: why in `err`
    bool init(int64_t n_entries, size_t frame_pages, int64_t max_frames, bool use_memfd, std::string & err);

    bool on() const {
        return fd >= 0 || park != nullptr;
    }

    // the frames move anonymous pages (else, when on(), they map memfd pages)
    bool moves() const {
        return park != nullptr;
    }

    // maps entry's interior (addr, len bytes, page-aligned, at most frame_pages pages) onto a frame;
    // false: no frame (the pool is at its maximum) or the map failed, and the range is anonymous as
    // before. Thread-safe (the read lanes call it)
    bool map(int32_t entry, uint8_t * addr, size_t len);

    // when entry holds a frame: its range goes back to anonymous, uncommitted memory and the frame to
    // the free list (its pages kept); returns false when entry held none (the caller drops its pages)
    bool unmap(int32_t entry, uint8_t * addr, size_t len);

    // gives the pages of every free frame back to the kernel (after the budget shrank, so that the
    // process's memory drops with it); the frames are zero-filled again at their next use
    void trim();

    int64_t n_mapped() const { return n_used; }  // entries holding a frame
    int64_t n_frames() const { return n_made; }  // frames ever used (their pages allocated, unless trimmed)
    int64_t cap()      const { return max_n; }

    // move: the park's address range (nullptr, 0 otherwise): what /proc/PID/maps shows of it
    const uint8_t * park_addr() const { return park; }
    size_t          park_size() const { return park_bytes; }

    void close();

    ~llama_moe_frames() {
        close();
    }

private:
    std::mutex           mutex; // the free list and frame_of (the lanes map, the compute thread unmaps)
    int                  fd = -1;            // memfd: the frames' file
    uint8_t *            park = nullptr;     // move: the frames' reservation, frame f at park + f * frame_bytes
    size_t               park_bytes = 0;
    std::vector<size_t>  parked;             // move: [frames] the bytes of frame f's pages at its place in park
                                             // (one mapping: what the last move back put there)
    std::vector<size_t>  moved;              // move: [n_entries] the bytes the entry's frame moved in
    size_t               frame_bytes = 0;
    int64_t              max_n  = 0;
    int64_t              n_made = 0;
    int64_t              n_used = 0;
    std::vector<int32_t> frame_of; // [n_entries] -1: anonymous pages
    std::vector<int32_t> free_list;
};
