#pragma once

// pybmoe: where an expert's bytes come from, and the thread that moves them.
//
// Holds: the expert tensors' places in the GGUF file(s) (recorded at load), the uploader (a worker
// thread that reads expert slices from a file and copies them into a tensor, for the VRAM tier), and
// the reader (read lanes with O_DIRECT, for the stream tier).
// Must not hold: any policy (which expert, which slot, when: llama-moe-residency.h) or graph code.

#include "ggml-backend.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct ggml_tensor;
struct llama_model_loader;

// a tensor's bytes in one of the model's GGUF files
struct llama_moe_source {
    uint16_t file;    // index into llama_moe_sources::paths
    size_t   offs;    // tensor data offset in that file
    size_t   nbytes;  // whole tensor
};

// every weight's source (the experts', and the dense weights' for --dense-weights), recorded once after load
struct llama_moe_sources {
    std::vector<std::string> paths;                 // the GGUF file and its splits
    std::map<std::string, llama_moe_source> tensors; // every weight's name -> source

    void record(const llama_model_loader & ml, const std::vector<std::string> & paths);

    bool empty() const {
        return paths.empty();
    }
};

// one slice to move into dst at dst_offs: from memory when `mem` is set (a host tensor that holds the
// GGUF layout: the memory map, a CPU buffer, a pinned host buffer, or the stream tier's RAM copy),
// else nbytes at offs of file `file`
struct llama_moe_copy {
    uint16_t      file;
    size_t        offs;
    size_t        nbytes;
    ggml_tensor * dst;
    size_t        dst_offs;
    const void *  mem = nullptr;
    std::vector<int32_t> pins; // handed to on_done once the copy is done (the stream tier's entries read)
};

// A worker thread that writes slices into tensors (ggml_backend_tensor_set: a device tensor's slice,
// while other graphs may run), in the order they were enqueued. A slice read from a file goes
// through a staging buffer of the destination device's host buffer type (pinned memory on CUDA),
// or a plain one where the device has none (RPC).
struct llama_moe_uploader {
    ~llama_moe_uploader();

    // opens every source file and starts the worker; false (and err set) when a file cannot be opened
    bool start(const std::vector<std::string> & paths, std::string & err);

    // queues a copy; returns its ticket (1, 2, ...): the copy is done once done() >= the ticket
    uint64_t enqueue(const llama_moe_copy & c);

    // copies finished so far (they finish in ticket order)
    uint64_t done() const {
        return n_done.load();
    }

    // blocks until every enqueued copy is done
    void wait();

    void stop();

    // called on the worker for each of a copy's pins once it is done (set before the first enqueue)
    std::function<void(int32_t)> on_done;

    // counters (bytes and calls since start)
    std::atomic<uint64_t> file_bytes { 0 }; // read from the GGUF file(s)
    std::atomic<uint64_t> mem_bytes  { 0 }; // copied from memory (no file read)
    std::atomic<uint64_t> n_h2d      { 0 }; // ggml_backend_tensor_set calls
    std::atomic<uint64_t> busy_us    { 0 }; // time spent copying

private:
    void worker_main();
    void copy(const llama_moe_copy & c);

    std::vector<std::string> paths;
    std::vector<FILE *>      files;
    std::vector<uint8_t>     staging;
    ggml_backend_buffer_t    pinned = nullptr; // staging in the destination's host buffer type
    ggml_backend_buffer_type_t pinned_buft = nullptr;

    std::thread             worker;
    std::mutex              q_mutex;
    std::condition_variable q_cv;
    std::condition_variable q_done_cv;
    std::deque<llama_moe_copy> queue;
    std::atomic<uint64_t>   n_done { 0 };
    uint64_t n_enqueued = 0;
    int32_t q_busy = 0;
    bool    q_stop = false;
};

// one range to read: nbytes at offs of file `file` into dst. in_place: dst shares the file offset's
// alignment (dst - offs is a multiple of 4096) and the aligned window around the range may be written
// around dst (the bytes there are the file's own, or free), so an O_DIRECT read lands there directly,
// with no bounce buffer and no copy
struct llama_moe_read {
    uint16_t file;
    size_t   offs;
    size_t   nbytes;
    void *   dst;
    bool     in_place = false;
    // run on the lane before the read (the stream tier maps the destination's page frames there, off the
    // compute thread); may be empty
    std::function<void()> before;
    // run on the lane after the read, with its result (the stream tier marks the range in place there, so
    // that the layer's compute can use it: llama-moe-inflight.h); may be empty
    std::function<void(bool ok, const std::string & err)> after;
};

// The status a process stops with when an expert's bytes cannot be read (a model file truncated or
// changed on disk under it): EX_IOERR of sysexits.h (docs/stream-tier.md, "A model file that changes under a
// running server").
#define LLAMA_MOE_EXIT_READ 74

// Stops the process: `err` (naming the file and the offset) in one line on stderr, then exit status
// LLAMA_MOE_EXIT_READ, without an abort's backtrace. A layer whose expert bytes are not there would give
// wrong output, so nothing goes on. The first thread to fail writes the line; any other waits for the exit.
[[noreturn]] void llama_moe_read_failed(const std::string & err);

// Reads ranges of the source files into memory on n_lanes threads at once. With O_DIRECT (the page
// cache stays out of it) each lane reads the aligned window around a range in place when the job
// allows it (llama_moe_read::in_place), else into its own aligned bounce buffer and copies the range
// out: GGUF tensor offsets are only 32-byte aligned. At open a
// direct read of one block of each file is compared with a buffered read; a file system that
// refuses O_DIRECT, or returns other bytes through it, gets buffered reads (fallback_reason says
// why). refuse_direct (PYBMOE_MOE_STREAM_NO_ODIRECT=1, llama-moe-switches.h) makes the open refuse
// O_DIRECT (the fallback's test: this kernel accepts O_DIRECT even on tmpfs).
struct llama_moe_reader {
    ~llama_moe_reader();

    // opens every file; false (and err set, naming the file) when one cannot be opened for reading
    bool open(const std::vector<std::string> & paths, int32_t n_lanes, bool want_direct, bool refuse_direct, std::string & err);

    // reads every range, the lanes in parallel; false (and err set, naming the file and the offset)
    // on a failed or short read (a file truncated or changed on disk)
    bool read(const std::vector<llama_moe_read> & jobs, std::string & err);

    // starts reading every range (a copy of `jobs`) on the lanes and returns at once; wait() blocks until
    // they are done, with read()'s result. One batch at a time: read() and submit() wait for the last.
    void submit(const std::vector<llama_moe_read> & jobs);
    bool wait(std::string & err);
    // adds jobs to the batch being read (a new batch when none is), without waiting; thread-safe (the
    // stream tier's expert waves read ahead from the compute threads). wait() waits for them too
    void append(const std::vector<llama_moe_read> & jobs);

    bool direct = false;          // O_DIRECT in use
    std::string fallback_reason;  // why not, when it was asked for
    int32_t n_lanes = 0;

    std::atomic<uint64_t> bytes_read { 0 }; // bytes the device delivered (direct: whole aligned windows)

private:
    struct lane;
    void lane_main(int32_t il);
    bool read_one(lane & ln, const llama_moe_read & job, std::string & err);
    // reads [w0, w0 + want) of `file` with O_DIRECT into dst (aligned), stopping at the end of the file;
    // got = the bytes read. false (err set) on a failed read
    bool read_window(uint16_t file, uint8_t * dst, size_t want, size_t w0, size_t & got, std::string & err);

    std::vector<std::string> paths;
    std::vector<int> fd_direct;   // -1 when not direct
    std::vector<int> fd_buffered;
    size_t align = 4096;

    std::vector<lane *>      lanes;
    std::vector<std::thread> threads;
    std::mutex               mutex;
    std::condition_variable  cv_work;
    std::condition_variable  cv_done;
    const std::vector<llama_moe_read> * batch = nullptr;
    std::vector<llama_moe_read> owned; // the submitted batch's jobs
    size_t   next_job  = 0;
    int32_t  n_working = 0;
    uint64_t batch_id  = 0;
    bool     stop      = false;
    std::string batch_err;
};
