// pybmoe: the stream tier's page frames. See llama-moe-frames.h.

#include "llama-moe-frames.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
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

bool llama_moe_frames::init(int64_t n_entries, size_t frame_pages, int64_t max_frames, std::string & err) {
    close();
#if defined(__linux__) && defined(MFD_CLOEXEC)
    if (frame_pages == 0 || max_frames <= 0) {
        err = "no whole page inside an expert, or no mapping to spare";
        return false;
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
        if (fd < 0 || frame_of[entry] >= 0) {
            return fd >= 0;
        }
        if (len == 0) {
            return true;
        }
        if (!free_list.empty()) {
            f = free_list.back();
            free_list.pop_back();
        } else if (n_made < max_n) {
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
        if (fd < 0 || frame_of[entry] < 0) {
            return false;
        }
        f = frame_of[entry];
        frame_of[entry] = -1;
        n_used--;
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
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t) f * (off_t) frame_bytes, (off_t) frame_bytes);
    }
#endif
}

void llama_moe_frames::close() {
#if defined(__linux__)
    if (fd >= 0) {
        ::close(fd);
    }
#endif
    fd = -1;
    frame_of.clear();
    free_list.clear();
    n_made = n_used = 0;
}
