// The moved page frames (ggml-ext/llama-moe-frames.h) against the hole they once left: built and run by
// tests/engine/test_stream_frames.py::test_moved_frames_leave_no_hole_in_the_park_or_an_experts_range.
//
// Sets up a park of 16 frames of 8 pages, moves frames out to 12 experts and back, and after each step
// asks the kernel for every page of the park and of the experts' reservation with
// mmap(MAP_FIXED_NOREPLACE): it succeeds only on an unmapped page, a hole that any other mapping of the
// process could have taken. Also checks that the pages moved, not copied or zeroed: an expert that gets
// a frame back sees the bytes its last holder wrote.
// Prints "holes N" per step and "ok" at the end; exits 1 on any hole or wrong byte, 3 when this kernel
// gives no moved frames (no MREMAP_DONTUNMAP: the frames fall back to memfd).

#include "llama-moe-frames.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

static const size_t PG = (size_t) sysconf(_SC_PAGESIZE);

// pages of [lo, hi) that nothing maps
static int holes(unsigned long lo, unsigned long hi) {
    int n = 0;
    for (unsigned long a = lo; a < hi; a += PG) {
        void * p = mmap((void *) a, PG, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
        if (p != MAP_FAILED) {
            n++;
            munmap(p, PG);
        }
    }
    return n;
}

int main() {
    const int    n_entries = 64, frame_pages = 8, n_frames = 16;
    const size_t fb = frame_pages * PG;
    llama_moe_frames fr;
    std::string err;
    if (!fr.init(n_entries, frame_pages, n_frames, false, err) || !fr.moves()) {
        printf("no moved frames: %s\n", err.c_str());
        return 3;
    }
    const unsigned long park_lo = (unsigned long) fr.park_addr(), park_hi = park_lo + fr.park_size();
    if (fr.park_size() != n_frames * fb) {
        printf("park of %zu bytes, not %zu\n", fr.park_size(), n_frames * fb);
        return 2;
    }
    // the experts' reservation: entry e at res + e * (fb + 2 pages) + 1 page, so that its ends are its own
    const size_t stride = fb + 2 * PG;
    uint8_t * res = (uint8_t *) mmap(nullptr, n_entries * stride, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    auto at = [&](int e) { return res + e * stride + PG; };
    int bad = 0;
    auto step = [&](const char * what) {
        const int h = holes(park_lo, park_hi) + holes((unsigned long) res, (unsigned long) (res + n_entries * stride));
        printf("%s: holes %d\n", what, h);
        bad += h;
    };
    for (int e = 0; e < 12; ++e) {
        if (!fr.map(e, at(e), fb)) {
            printf("map %d failed\n", e);
            return 1;
        }
        memset(at(e), 100 + e, fb);
    }
    step("12 frames out");
    for (int e = 0; e < 6; ++e) {
        fr.unmap(e, at(e), fb);
        if (at(e)[0] != 0 || at(e)[fb - 1] != 0) {
            printf("entry %d keeps bytes after its frame left\n", e);
            bad++;
        }
    }
    step("6 frames back");
    for (int e = 40; e < 46; ++e) {
        fr.map(e, at(e), fb);
    }
    step("6 frames out again");
    // the free list is a stack: entry 40 got the frame entry 5 gave back, 45 that of entry 0
    for (int e = 40; e < 46; ++e) {
        const uint8_t want = (uint8_t) (100 + 45 - e);
        if (at(e)[0] != want || at(e)[fb - 1] != want) {
            printf("entry %d sees %d, not the moved bytes %d\n", e, at(e)[0], want);
            bad++;
        }
    }
    for (int e = 6; e < 12; ++e) {
        fr.unmap(e, at(e), fb);
    }
    for (int e = 40; e < 46; ++e) {
        fr.unmap(e, at(e), fb);
    }
    step("all frames back");
    fr.close();
    printf(bad ? "FAILED\n" : "ok\n");
    return bad ? 1 : 0;
}
