#pragma once

// pybmoe: the memory the process may still use, as the kernel and the process's cgroup report it
// (what the stream tier's `auto` and the dense policy's `auto` size from).
//
// Holds: reading /proc/meminfo and the process's cgroup (v1 or v2), under a root that the
// environment variable PYBMOE_MEM_ROOT can move (a fake /proc and /sys/fs/cgroup tree, for tests
// that need no root and no real limit). Must not hold: any sizing rule (llama-moe-stream-init.cpp,
// llama-moe-dense.cpp).

#include <cstdint>
#include <string>

struct llama_moe_mem_avail {
    uint64_t meminfo        = 0; // /proc/meminfo MemAvailable, bytes (0: not known)
    uint64_t memtotal       = 0; // /proc/meminfo MemTotal, bytes
    uint64_t cgroup_limit   = 0; // the process's cgroup (v2 memory.max, v1 memory.limit_in_bytes); 0: none
    uint64_t cgroup_usage   = 0;
    uint64_t cgroup_file    = 0; // page cache charged to the cgroup: reclaimable (the dense weights are counted apart)
    uint64_t cgroup_mapped  = 0; // of it, pages mapped by a process (v1 total_mapped_file, v2 file_mapped)
    std::string cgroup;          // the cgroup folder the limit came from
    std::string root;            // PYBMOE_MEM_ROOT when set, else empty

    // what the process may still use, bytes: MemAvailable, or the cgroup's limit minus its usage less its
    // page cache when that is smaller (in a container MemAvailable is the host's)
    uint64_t avail() const;

    // what may still be committed now, bytes, with this process running: MemAvailable, or the cgroup's limit
    // less its usage, where page cache counts as free unless it is mapped (the dense weights in their map are
    // in use), when that is smaller (0: not known). The stream tier's governor reads it at run time; avail()
    // is the figure at load, before the dense weights are counted apart.
    uint64_t free_now() const;

    // the memory this process lives in, bytes: the cgroup's limit, else MemTotal (0: not known)
    uint64_t limit() const;

    // "MemAvailable A MiB[, cgroup C limit L MiB, usage U MiB of which F MiB page cache]"
    std::string describe() const;
};

// reads /proc/meminfo and /proc/self/cgroup (and the cgroup's files) under PYBMOE_MEM_ROOT when set
llama_moe_mem_avail llama_moe_read_mem_avail();
