// The moved frames' bug (docs/stream-tier.md, "Not done yet"): a frame moved out of the park with
// mremap(MREMAP_FIXED) leaves a hole there, and the process's next mmap-served allocations land in it (glibc
// serves a malloc of 128 KiB or more with mmap). Printed here: "mallocs placed in the park's hole: 2".
#define _GNU_SOURCE
#include <stdio.h>
#include <stdint.h>
#include <sys/mman.h>
#include <stdlib.h>
int main(void) {
    size_t fb = 432 * 1024 / 4096 * 4096, n = 64;
    uint8_t * park = mmap(NULL, fb * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    uint8_t * dst  = mmap(NULL, fb * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    // move frame 5 out: a hole in park
    mremap(park + 5 * fb, fb, fb, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
    int inside = 0;
    for (int i = 0; i < 200; ++i) {
        void * p = malloc(200 * 1024); // glibc serves >= 128 KiB with mmap
        if ((uint8_t *) p >= park && (uint8_t *) p < park + fb * n) inside++;
    }
    void * q = mmap(NULL, 256 * 1024, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    printf("mallocs placed in the park's hole: %d; a 256 KiB mmap in it: %d\n", inside,
           (uint8_t *) q >= park && (uint8_t *) q < park + fb * n);
    return 0;
}
