// O_DIRECT read rate of a file by lanes (threads) and read size: each configuration reads its own
// TOTAL_MIB of distinct consecutive bytes of the file (so nothing is cached for O_DIRECT, and nothing
// read twice), the lanes taking reads of SIZE from a shared cursor, as the stream tier's lanes take its
// runs of consecutive experts. Rotating order, ROUNDS rounds; prints CSV: round,lanes,size_kib,mib_s.
//   cc -O2 -pthread rate.c -o rate && ./rate FILE TOTAL_MIB ROUNDS
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static int fd;
static size_t rsz, lo, hi;
static atomic_size_t cursor;

static void * lane(void * arg) {
    (void) arg;
    void * buf;
    if (posix_memalign(&buf, 4096, rsz)) return NULL;
    for (;;) {
        size_t off = atomic_fetch_add(&cursor, rsz);
        if (off >= hi) break;
        if (pread(fd, buf, rsz, (off_t) off) < 0) { perror("pread"); exit(1); }
    }
    free(buf);
    return NULL;
}

int main(int argc, char ** argv) {
    fd = open(argv[1], O_RDONLY | O_DIRECT);
    size_t total = (size_t) atol(argv[2]) << 20, fsize = (size_t) lseek(fd, 0, SEEK_END) & ~(size_t) 0xfffff;
    int rounds = atoi(argv[3]);
    const int lanes[] = {1, 2, 4, 8, 16};
    const size_t sizes[] = {256 << 10, 1 << 20, 4 << 20, 8 << 20, 32 << 20};
    const int nc = 25;
    size_t pos = 0;
    printf("round,lanes,size_kib,mib_s\n");
    for (int r = 0; r < rounds; ++r) {
        for (int i = 0; i < nc; ++i) {
            int c = (i + r * 7) % nc;
            int nl = lanes[c / 5];
            rsz = sizes[c % 5];
            if (pos + total > fsize) pos = 0;  // wraps only when the file is smaller than the whole run
            lo = pos; hi = pos + total; pos += total;
            atomic_store(&cursor, lo);
            struct timespec a, b;
            clock_gettime(CLOCK_MONOTONIC, &a);
            pthread_t t[16];
            for (int k = 0; k < nl; ++k) pthread_create(&t[k], NULL, lane, NULL);
            for (int k = 0; k < nl; ++k) pthread_join(t[k], NULL);
            clock_gettime(CLOCK_MONOTONIC, &b);
            double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
            printf("%d,%d,%zu,%.0f\n", r, nl, rsz >> 10, total / 1048576.0 / s);
            fflush(stdout);
        }
    }
    return 0;
}
