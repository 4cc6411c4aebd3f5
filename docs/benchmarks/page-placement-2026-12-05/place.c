// What it costs to give an admitted expert its pages, three ways (docs/stream-tier.md, "Page frames";
// the lead of issue 23's prefill goal). Each round places `len` bytes of pages at an expert's address
// in a reservation and takes them away again, the way an admission and an eviction do:
//   frames:  mmap(MAP_SHARED | MAP_FIXED | MAP_POPULATE) of a memfd frame, then an anonymous mmap over it
//            (the tier today);
//   mremap:  the pages of a parked anonymous range moved to the expert's address with
//            mremap(MREMAP_MAYMOVE | MREMAP_FIXED) and moved back (the pages are kept, never zeroed;
//            the expert's address is refilled with an anonymous NORESERVE mapping);
//   fresh:   madvise(MADV_DONTNEED), then one write per page (fault in and zero: the tier without
//            frames).
// Only the placement is timed (and one write to its first page), not a read into it.
// Usage: place LEN_KIB ROUNDS   (prints one line per way: ms per GiB placed)
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

int main(int argc, char ** argv) {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    const size_t len = ((argc > 1 ? (size_t) atol(argv[1]) : 1296) * 1024) / page * page;
    const int rounds = argc > 2 ? atoi(argv[2]) : 2000;
    const int slots = 64; // expert addresses the rounds rotate over
    uint8_t * res = mmap(NULL, len * slots, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    // frames: one memfd frame, allocated once (its pages kept, as the pool keeps them)
    int fd = memfd_create("place", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t) len) != 0) { perror("memfd"); return 1; }
    { uint8_t * f = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); memset(f, 1, len); munmap(f, len); }
    double t0 = now();
    for (int r = 0; r < rounds; ++r) {
        uint8_t * a = res + (size_t) (r % slots) * len;
        if (mmap(a, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0) == MAP_FAILED) { perror("map"); return 1; }
        a[0] = 1;
        if (mmap(a, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED) { perror("anon"); return 1; }
    }
    const double gib = (double) len * rounds / (1u << 30);
    printf("frames  %8.1f ms per GiB placed\n", (now() - t0) * 1e3 / gib);
    // mremap: a parked range of committed anonymous pages, moved in and out
    uint8_t * park = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memset(park, 1, len);
    t0 = now();
    for (int r = 0; r < rounds; ++r) {
        uint8_t * a = res + (size_t) (r % slots) * len;
        if (mremap(park, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, a) == MAP_FAILED) { perror("mremap in"); return 1; }
        a[0] = 1;
        if (mremap(a, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, park) == MAP_FAILED) { perror("mremap out"); return 1; }
        if (mmap(a, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED) { perror("refill"); return 1; }
    }
    printf("mremap  %8.1f ms per GiB placed\n", (now() - t0) * 1e3 / gib);
    // fresh: fault in zeroed pages, give them back
    t0 = now();
    for (int r = 0; r < rounds; ++r) {
        uint8_t * a = res + (size_t) (r % slots) * len;
        for (size_t o = 0; o < len; o += page) { a[o] = 1; }
        madvise(a, len, MADV_DONTNEED);
    }
    printf("fresh   %8.1f ms per GiB placed\n", (now() - t0) * 1e3 / gib);
    return 0;
}
