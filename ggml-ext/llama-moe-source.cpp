// pybmoe: expert sources and the uploader thread. See llama-moe-source.h.
//
// Holds: file offsets, file reads and the copy thread. Must not hold: policy or graph code.

#include "llama-moe-source.h"

#include "llama-impl.h"
#include "llama-model-loader.h"

#include "ggml.h"

#if defined(_WIN32)
#define llama_moe_fseek _fseeki64
#else
#define llama_moe_fseek fseeko
#endif

void llama_moe_sources::record(const llama_model_loader & ml, const std::vector<std::string> & paths_in) {
    paths = paths_in;
    for (const auto & [name, w] : ml.weights_map) {
        tensors[name] = { w.idx, w.offs, ggml_nbytes(w.tensor) };
    }
}

llama_moe_uploader::~llama_moe_uploader() {
    stop();
    for (FILE * f : files) {
        if (f) {
            fclose(f);
        }
    }
    if (pinned) {
        ggml_backend_buffer_free(pinned);
    }
}

bool llama_moe_uploader::start(const std::vector<std::string> & paths_in, std::string & err) {
    paths = paths_in;
    for (const auto & p : paths) {
        FILE * f = fopen(p.c_str(), "rb");
        if (f == nullptr) {
            err = p;
            return false;
        }
        files.push_back(f);
    }
    worker = std::thread([this] { worker_main(); });
    return true;
}

uint64_t llama_moe_uploader::enqueue(const llama_moe_copy & c) {
    uint64_t ticket;
    {
        std::lock_guard<std::mutex> lock(q_mutex);
        queue.push_back(c);
        ticket = ++n_enqueued;
    }
    q_cv.notify_one();
    return ticket;
}

void llama_moe_uploader::wait() {
    std::unique_lock<std::mutex> lock(q_mutex);
    q_done_cv.wait(lock, [&] { return queue.empty() && q_busy == 0; });
}

void llama_moe_uploader::stop() {
    if (!worker.joinable()) {
        return;
    }
    {
        std::lock_guard<std::mutex> lock(q_mutex);
        q_stop = true;
    }
    q_cv.notify_all();
    worker.join();
}

void llama_moe_uploader::worker_main() {
    for (;;) {
        llama_moe_copy c;
        {
            std::unique_lock<std::mutex> lock(q_mutex);
            q_cv.wait(lock, [&] { return q_stop || !queue.empty(); });
            if (q_stop) {
                return;
            }
            c = queue.front();
            queue.pop_front();
            q_busy++;
        }
        const int64_t t0 = ggml_time_us();
        copy(c);
        busy_us += (uint64_t) (ggml_time_us() - t0);
        for (int32_t e : c.pins) {
            on_done(e);
        }
        {
            std::lock_guard<std::mutex> lock(q_mutex);
            q_busy--;
            n_done++;
        }
        q_done_cv.notify_all();
    }
}

void llama_moe_uploader::copy(const llama_moe_copy & c) {
    n_h2d++;
    if (c.mem != nullptr) {
        mem_bytes += c.nbytes;
        ggml_backend_tensor_set(c.dst, c.mem, c.dst_offs, c.nbytes);
        return;
    }
    // a file read: into pinned staging where the destination's device has a host buffer type
    uint8_t * buf = nullptr;
    ggml_backend_dev_t dev = c.dst->buffer ? ggml_backend_buft_get_device(ggml_backend_buffer_get_type(c.dst->buffer)) : nullptr;
    ggml_backend_buffer_type_t hbuft = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    if (hbuft != nullptr) {
        if (pinned == nullptr || pinned_buft != hbuft || ggml_backend_buffer_get_size(pinned) < c.nbytes) {
            if (pinned) {
                ggml_backend_buffer_free(pinned);
            }
            pinned      = ggml_backend_buft_alloc_buffer(hbuft, c.nbytes);
            pinned_buft = hbuft;
        }
        buf = pinned ? (uint8_t *) ggml_backend_buffer_get_base(pinned) : nullptr;
    }
    if (buf == nullptr) {
        staging.resize(c.nbytes);
        buf = staging.data();
    }
    FILE * f = files[c.file];
    if (llama_moe_fseek(f, (long long) c.offs, SEEK_SET) != 0 || fread(buf, 1, c.nbytes, f) != c.nbytes) {
        // note: the slot stays zero, so the output would be wrong; this is unrecoverable
        llama_moe_read_failed(format("moe-cache: cannot read %zu bytes at offset %zu of %s (truncated or changed on "
                "disk?)", c.nbytes, c.offs, paths[c.file].c_str()));
    }
    file_bytes += c.nbytes;
    ggml_backend_tensor_set(c.dst, buf, c.dst_offs, c.nbytes);
}

//
// llama_moe_reader
//

#if !defined(_WIN32)
#include <fcntl.h>
#include <unistd.h>
#endif
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

void llama_moe_read_failed(const std::string & err) {
    static std::atomic<bool> said { false };
    if (!said.exchange(true)) {
        // stderr directly: the server's log is written by a thread of its own, which the exit would not wait for
        fprintf(stderr, "llama_moe_read: error: %s; the process stops (status %d: a model file must not change "
                "while it is in use)\n", err.c_str(), LLAMA_MOE_EXIT_READ);
        fflush(stderr);
        std::_Exit(LLAMA_MOE_EXIT_READ);
    }
    for (;;) {
        std::this_thread::sleep_for(std::chrono::seconds(1)); // the first thread writes the line and exits
    }
}

struct llama_moe_reader::lane {
    uint8_t * bounce    = nullptr;
    size_t    bounce_sz = 0;

    ~lane() {
        free(bounce);
    }
};

llama_moe_reader::~llama_moe_reader() {
    {
        std::lock_guard<std::mutex> lock(mutex);
        stop = true;
    }
    cv_work.notify_all();
    for (auto & t : threads) {
        t.join();
    }
    for (lane * ln : lanes) {
        delete ln;
    }
#if !defined(_WIN32)
    for (int fd : fd_direct)   { if (fd >= 0) { close(fd); } }
    for (int fd : fd_buffered) { if (fd >= 0) { close(fd); } }
#endif
}

bool llama_moe_reader::open(const std::vector<std::string> & paths_in, int32_t n_lanes_in, bool want_direct, bool refuse_direct,
                            std::string & err) {
#if defined(_WIN32)
    err = "the stream tier reads with pread, which this build does not have (Windows)";
    return false;
#else
    paths   = paths_in;
    n_lanes = std::max(1, n_lanes_in);
    direct  = want_direct;
    for (const auto & p : paths) {
        const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            err = p + ": " + strerror(errno);
            return false;
        }
        fd_buffered.push_back(fd);
        int fdd = -1;
        if (direct) {
            if (refuse_direct) {
                errno = EINVAL; // injected: as a file system without O_DIRECT answers
            } else {
                fdd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
            }
            if (fdd < 0) {
                fallback_reason = p + " refused O_DIRECT (" + strerror(errno) + ")";
                direct = false;
            }
        }
        fd_direct.push_back(fdd);
    }
    // a direct read of one aligned block must equal a buffered read (some FUSE mounts accept O_DIRECT
    // and return other bytes)
    for (size_t i = 0; direct && i < paths.size(); ++i) {
        const off_t size = lseek(fd_buffered[i], 0, SEEK_END);
        const off_t at   = (off_t) ((size / 2) & ~(off_t) (align - 1));
        void * a = nullptr;
        std::vector<uint8_t> b(align);
        if (posix_memalign(&a, align, align) != 0) {
            err = "out of memory";
            return false;
        }
        const ssize_t nd = pread(fd_direct[i], a, align, at);
        const ssize_t nb = pread(fd_buffered[i], b.data(), align, at);
        if (nd < 0 || nd != nb || memcmp(a, b.data(), (size_t) std::max<ssize_t>(nb, 0)) != 0) {
            fallback_reason = paths[i] + (nd < 0 ? " refused a direct read (" + std::string(strerror(errno)) + ")"
                                                 : " returned other bytes through O_DIRECT than buffered");
            direct = false;
        }
        free(a);
    }
    if (!direct) {
        for (int & fd : fd_direct) {
            if (fd >= 0) { close(fd); fd = -1; }
        }
    }
    for (int32_t i = 0; i < n_lanes; ++i) {
        lanes.push_back(new lane());
    }
    for (int32_t i = 0; i < n_lanes; ++i) {
        threads.emplace_back([this, i] { lane_main(i); });
    }
    return true;
#endif
}

bool llama_moe_reader::read_window(uint16_t file, uint8_t * dst, size_t want, size_t w0, size_t & got, std::string & err) {
#if defined(_WIN32)
    GGML_UNUSED(file); GGML_UNUSED(dst); GGML_UNUSED(want); GGML_UNUSED(w0); GGML_UNUSED(got); GGML_UNUSED(err);
    return false;
#else
    got = 0;
    while (got < want) {
        const ssize_t n = pread(fd_direct[file], dst + got, want - got, (off_t) (w0 + got));
        if (n < 0) {
            err = format("moe-stream: read failed at offset %zu of %s (%s)", w0 + got, paths[file].c_str(), strerror(errno));
            return false;
        }
        if (n == 0) {
            break; // end of file: the window may run past it, the range may not
        }
        got += (size_t) n;
    }
    return true;
#endif
}

bool llama_moe_reader::read_one(lane & ln, const llama_moe_read & job, std::string & err) {
#if defined(_WIN32)
    GGML_UNUSED(ln); GGML_UNUSED(job); GGML_UNUSED(err);
    return false;
#else
    if (job.before) {
        job.before();
    }
    if (!direct) {
        size_t done = 0;
        while (done < job.nbytes) {
            const ssize_t n = pread(fd_buffered[job.file], (uint8_t *) job.dst + done, job.nbytes - done, (off_t) (job.offs + done));
            if (n <= 0) {
                err = format("moe-stream: short read: %zu of %zu bytes at offset %zu of %s (%s)", done, job.nbytes,
                        job.offs, paths[job.file].c_str(), n < 0 ? strerror(errno) : "end of file: truncated or changed on disk?");
                return false;
            }
            done += (size_t) n;
        }
        bytes_read += job.nbytes;
        return true;
    }
    if (job.in_place && (((uintptr_t) job.dst - job.offs) & (align - 1)) == 0) {
        // the aligned window around the range, read straight into place: its extra bytes at either end are
        // the neighbours' own bytes from the same file (or the reservation's slack)
        const size_t w0 = job.offs & ~(align - 1);
        const size_t w1 = (job.offs + job.nbytes + align - 1) & ~(align - 1);
        size_t got = 0;
        if (!read_window(job.file, (uint8_t *) job.dst - (job.offs - w0), w1 - w0, w0, got, err)) {
            return false;
        }
        if (got < (job.offs - w0) + job.nbytes) {
            err = format("moe-stream: short read: %zu of %zu bytes at offset %zu of %s (end of file: truncated or "
                    "changed on disk?)", got > job.offs - w0 ? got - (job.offs - w0) : 0, job.nbytes, job.offs,
                    paths[job.file].c_str());
            return false;
        }
        bytes_read += got;
        return true;
    }
    // the aligned window around the range, read in chunks of at most 8 MiB into the lane's bounce buffer
    constexpr size_t chunk = 8u << 20;
    size_t pos = job.offs;                 // next byte of the range to copy
    const size_t end = job.offs + job.nbytes;
    while (pos < end) {
        const size_t w0 = pos & ~(align - 1);
        const size_t w1 = std::min((end + align - 1) & ~(align - 1), w0 + chunk);
        const size_t want = w1 - w0;
        if (ln.bounce_sz < want) {
            free(ln.bounce);
            ln.bounce = nullptr;
            ln.bounce_sz = 0;
            void * p = nullptr;
            if (posix_memalign(&p, align, want) != 0) {
                err = "moe-stream: out of memory for a read buffer";
                return false;
            }
            ln.bounce = (uint8_t *) p;
            ln.bounce_sz = want;
        }
        size_t got = 0;
        if (!read_window(job.file, ln.bounce, want, w0, got, err)) {
            return false;
        }
        const size_t take = std::min(end, w1) - pos;
        if (got < (pos - w0) + take) {
            err = format("moe-stream: short read: %zu of %zu bytes at offset %zu of %s (end of file: truncated or "
                    "changed on disk?)", got > pos - w0 ? got - (pos - w0) : 0, take, pos, paths[job.file].c_str());
            return false;
        }
        memcpy((uint8_t *) job.dst + (pos - job.offs), ln.bounce + (pos - w0), take);
        bytes_read += got;
        pos += take;
    }
    return true;
#endif
}

void llama_moe_reader::lane_main(int32_t il) {
    uint64_t seen = 0;
    for (;;) {
        std::unique_lock<std::mutex> lock(mutex);
        cv_work.wait(lock, [&] { return stop || (batch != nullptr && batch_id != seen); });
        if (stop) {
            return;
        }
        seen = batch_id;
        n_working++;
        while (next_job < batch->size()) {
            const llama_moe_read job = (*batch)[next_job++];
            lock.unlock();
            std::string err;
            const bool ok = read_one(*lanes[il], job, err);
            if (job.after) {
                job.after(ok, err);
            }
            lock.lock();
            if (!ok && batch_err.empty()) {
                batch_err = err;
            }
        }
        if (--n_working == 0) {
            cv_done.notify_all();
        }
    }
}

void llama_moe_reader::submit(const std::vector<llama_moe_read> & jobs) {
    std::string ignored;
    wait(ignored); // one batch at a time (an earlier error was reported by its own wait)
    append(jobs);  // no batch now: a new one (none at all when `jobs` is empty, which wait() takes as done)
}

void llama_moe_reader::append(const std::vector<llama_moe_read> & jobs) {
    if (jobs.empty()) {
        return;
    }
    std::unique_lock<std::mutex> lock(mutex);
    if (batch == nullptr) { // a new batch (submit() comes here too)
        owned    = jobs;
        batch    = &owned;
        next_job = 0;
        batch_err.clear();
        n_working = 0;
    } else {
        owned.insert(owned.end(), jobs.begin(), jobs.end()); // the lanes copy a job under the lock
    }
    batch_id++; // the lanes that finished the batch so far take the new jobs too
    cv_work.notify_all();
}

bool llama_moe_reader::wait(std::string & err) {
    std::unique_lock<std::mutex> lock(mutex);
    if (batch == nullptr) {
        return true;
    }
    // the batch may grow while it is read (append)
    cv_done.wait(lock, [&] { return next_job >= batch->size() && n_working == 0; });
    batch = nullptr;
    if (!batch_err.empty()) {
        err = batch_err;
        batch_err.clear();
        return false;
    }
    return true;
}

bool llama_moe_reader::read(const std::vector<llama_moe_read> & jobs, std::string & err) {
    if (jobs.empty()) {
        return true;
    }
    submit(jobs);
    return wait(err);
}
