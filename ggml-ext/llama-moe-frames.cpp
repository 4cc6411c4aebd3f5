// pybmoe: the stream tier's page frames. See llama-moe-frames.h.

#include "llama-moe-frames.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

// prctl's anonymous VMA names (Linux 5.17)
static constexpr int LLAMA_MOE_PR_SET_VMA           = 0x53564d41;
static constexpr int LLAMA_MOE_PR_SET_VMA_ANON_NAME = 0;
#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4 // Linux 5.7; older headers lack it
#endif

// a move leaves its source mapped (empty), so that no hole ever opens in the park or in an expert's range:
// a hole there may be taken by any other mapping of the process (a malloc of 128 KiB or more, a thread
// stack), which the move back with MREMAP_FIXED, or the park's munmap, would then silently unmap
// (docs/benchmarks/page-placement-2026-12-05/hole.c shows 2 of 200 mallocs landing in such a hole)
static constexpr int LLAMA_MOE_FRAMES_MOVE = MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP;
#endif

#if defined(__linux__)
// maps [addr, addr + len) back to uncommitted anonymous memory; a reservation with a hole would fault when
// read, so a failure stops here with what was being done
static void llama_moe_frames_to_anon(uint8_t * addr, size_t len, const char * what) {
    if (len != 0 && mmap(addr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED) {
        fprintf(stderr, "llama_moe_frames: cannot %s: %s\n", what, strerror(errno));
        abort();
    }
}
#endif

bool llama_moe_frames::init(int64_t n_entries, size_t frame_pages, int64_t max_frames, bool use_memfd, std::string & err) {
    close();
#if defined(__linux__) && defined(MFD_CLOEXEC)
    if (frame_pages == 0 || max_frames <= 0) {
        err = "no whole page inside an expert, or no mapping to spare";
        return false;
    }
    if (!use_memfd) {
        frame_bytes = frame_pages * (size_t) sysconf(_SC_PAGESIZE);
        park_bytes  = frame_bytes * (size_t) max_frames;
        void * p = mmap(nullptr, park_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            err = std::string("cannot reserve the frames' park: ") + strerror(errno);
            park_bytes = 0;
            return false;
        }
        park = (uint8_t *) p;
        // a kernel before 5.7 refuses MREMAP_DONTUNMAP: then the memfd way (a move without it opens holes)
        // (probed as it is used, onto a page of our own: this kernel refuses it without MREMAP_FIXED)
        const size_t pg = (size_t) sysconf(_SC_PAGESIZE);
        void * probe = mmap(nullptr, pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        const bool moves = probe != MAP_FAILED && mremap(park, pg, pg, LLAMA_MOE_FRAMES_MOVE, probe) != MAP_FAILED;
        if (probe != MAP_FAILED) {
            munmap(probe, pg);
        }
        if (!moves) {
            munmap(park, park_bytes);
            park = nullptr;
            park_bytes = 0;
            return init(n_entries, frame_pages, max_frames, true, err);
        }
        // the park's mappings carry a name, which moves with the pages: /proc/PID/smaps shows every frame page,
        // parked or at an expert, as [anon:pybmoe-moe-frames] (kernels without anonymous VMA names: unnamed)
        prctl(LLAMA_MOE_PR_SET_VMA, LLAMA_MOE_PR_SET_VMA_ANON_NAME, (unsigned long) park, park_bytes,
              (unsigned long) "pybmoe-moe-frames");
        max_n = max_frames;
        parked.assign((size_t) max_frames, frame_bytes);
        moved.assign((size_t) n_entries, 0);
        frame_of.assign((size_t) n_entries, -1);
        return true;
    }
    fd = memfd_create("pybmoe-moe-frames", MFD_CLOEXEC);
    if (fd < 0) {
        err = std::string("memfd_create: ") + strerror(errno);
        return false;
    }
    frame_bytes = frame_pages * (size_t) sysconf(_SC_PAGESIZE);
    max_n = max_frames;
    frame_of.assign((size_t) n_entries, -1);
    return true;
#else
    (void) n_entries; (void) frame_pages; (void) max_frames;
    err = "not Linux";
    return false;
#endif
}

bool llama_moe_frames::map(int32_t entry, uint8_t * addr, size_t len) {
#if defined(__linux__)
    int32_t f = -1;
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (!on() || frame_of[entry] >= 0) {
            return on();
        }
        if (len == 0) {
            return true;
        }
        if (!free_list.empty()) {
            f = free_list.back();
            free_list.pop_back();
        } else if (park != nullptr && n_made < max_n) {
            f = (int32_t) n_made++; // a new frame: its pages are faulted in by the first read into them
        } else if (park == nullptr && n_made < max_n) {
            // a new frame: the file grows (sparse); its pages are allocated when first mapped
            if (ftruncate(fd, (off_t) ((n_made + 1) * (int64_t) frame_bytes)) != 0) {
                return false;
            }
            f = (int32_t) n_made++;
        } else {
            return false;
        }
        frame_of[entry] = f;
        n_used++;
    }
    if (park != nullptr) {
        // the frame's parked pages (one mapping) move to the interior, its place in the park stays mapped
        // (empty); an interior longer than them gets its last page faulted in by the read, a shorter one
        // leaves the rest parked
        const size_t n = std::min(len, parked[f]);
        if (n == 0 || mremap(park + (size_t) f * frame_bytes, n, n, LLAMA_MOE_FRAMES_MOVE, addr) == MAP_FAILED) {
            std::lock_guard<std::mutex> lock(mutex);
            frame_of[entry] = -1; // a failed mremap moves nothing: the interior keeps its anonymous memory
            n_used--;
            free_list.push_back(f);
            return false;
        }
        moved[entry] = n;
        return true;
    }
    if (mmap(addr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, (off_t) f * (off_t) frame_bytes) == MAP_FAILED) {
        // back to anonymous memory (a failed MAP_FIXED may have unmapped the range); the entry then faults
        // its pages in as without frames
        llama_moe_frames_to_anon(addr, len, "restore an expert's anonymous memory");
        std::lock_guard<std::mutex> lock(mutex);
        frame_of[entry] = -1;
        n_used--;
        free_list.push_back(f);
        return false;
    }
    return true;
#else
    (void) entry; (void) addr; (void) len;
    return false;
#endif
}

bool llama_moe_frames::unmap(int32_t entry, uint8_t * addr, size_t len) {
#if defined(__linux__)
    int32_t f = -1;
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (!on() || frame_of[entry] < 0) {
            return false;
        }
        f = frame_of[entry];
        frame_of[entry] = -1;
        n_used--;
    }
    if (park != nullptr) {
        // the pages move back to the frame's place in park (one mapping again); the interior stays mapped
        // (empty), and is then replaced, in one mmap, by uncommitted anonymous memory like the rest of its
        // reservation, with which it merges (else each interior ever used would keep up to 2 mappings of
        // its own); its pages past the moved ones were its own: dropped
        const size_t n = moved[entry];
        if (mremap(addr, n, n, LLAMA_MOE_FRAMES_MOVE, park + (size_t) f * frame_bytes) == MAP_FAILED) {
            fprintf(stderr, "llama_moe_frames: cannot move an expert's pages back to its frame: %s\n", strerror(errno));
            abort();
        }
        llama_moe_frames_to_anon(addr, n, "give an expert's range its anonymous memory back");
        if (len > n) {
            madvise(addr + n, len - n, MADV_DONTNEED);
        }
        std::lock_guard<std::mutex> lock(mutex);
        parked[f] = n;
        free_list.push_back(f);
        return true;
    }
    llama_moe_frames_to_anon(addr, len, "give an expert's frame back");
    std::lock_guard<std::mutex> lock(mutex);
    free_list.push_back(f);
    return true;
#else
    (void) entry; (void) addr; (void) len;
    return false;
#endif
}

void llama_moe_frames::trim() {
#if defined(__linux__)
    std::lock_guard<std::mutex> lock(mutex);
    for (int32_t f : free_list) {
        if (park != nullptr) {
            madvise(park + (size_t) f * frame_bytes, frame_bytes, MADV_DONTNEED); // the parked pages and any left over
        } else {
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t) f * (off_t) frame_bytes, (off_t) frame_bytes);
        }
    }
#endif
}

void llama_moe_frames::close() {
#if defined(__linux__)
    if (fd >= 0) {
        ::close(fd);
    }
    if (park != nullptr) {
        munmap(park, park_bytes);
    }
#endif
    fd = -1;
    park = nullptr;
    park_bytes = 0;
    parked.clear();
    moved.clear();
    frame_of.clear();
    free_list.clear();
    n_made = n_used = 0;
}
