#pragma once

// pybmoe: where an expert's bytes come from, and the thread that moves them.
//
// Holds: the expert tensors' places in the GGUF file(s) (recorded at load), the open files, and the
// uploader: a worker thread that reads expert slices from a file and copies them into a tensor.
// Must not hold: any policy (which expert, which slot, when: llama-moe-residency.h) or graph code.

#include "ggml-backend.h"

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
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

// every expert tensor's source, recorded once after load
struct llama_moe_sources {
    std::vector<std::string> paths;                 // the GGUF file and its splits
    std::map<std::string, llama_moe_source> tensors; // expert tensor name ("*_exps.weight") -> source

    void record(const llama_model_loader & ml, const std::vector<std::string> & paths);

    bool empty() const {
        return paths.empty();
    }
};

// one slice to move: nbytes at offs of file `file` into dst at dst_offs
struct llama_moe_copy {
    uint16_t      file;
    size_t        offs;
    size_t        nbytes;
    ggml_tensor * dst;
    size_t        dst_offs;
};

// a worker thread that reads slices from the source files and writes them into tensors
// (ggml_backend_tensor_set: a device tensor's slice, while other graphs may run)
struct llama_moe_uploader {
    ~llama_moe_uploader();

    // opens every source file and starts the worker; false (and err set) when a file cannot be opened
    bool start(const std::vector<std::string> & paths, std::string & err);

    void enqueue(const llama_moe_copy & c);

    // blocks until every enqueued copy is done
    void wait();

    void stop();

private:
    void worker_main();
    void copy(const llama_moe_copy & c);

    std::vector<std::string> paths;
    std::vector<FILE *>      files;
    std::vector<uint8_t>     staging;

    std::thread             worker;
    std::mutex              q_mutex;
    std::condition_variable q_cv;
    std::condition_variable q_done_cv;
    std::deque<llama_moe_copy> queue;
    int32_t q_busy = 0;
    bool    q_stop = false;
};
