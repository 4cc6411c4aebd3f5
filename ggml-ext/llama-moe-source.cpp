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
        if (name.find("_exps.weight") != std::string::npos) {
            tensors[name] = { w.idx, w.offs, ggml_nbytes(w.tensor) };
        }
    }
}

llama_moe_uploader::~llama_moe_uploader() {
    stop();
    for (FILE * f : files) {
        if (f) {
            fclose(f);
        }
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

void llama_moe_uploader::enqueue(const llama_moe_copy & c) {
    {
        std::lock_guard<std::mutex> lock(q_mutex);
        queue.push_back(c);
    }
    q_cv.notify_one();
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
        copy(c);
        {
            std::lock_guard<std::mutex> lock(q_mutex);
            q_busy--;
        }
        q_done_cv.notify_all();
    }
}

void llama_moe_uploader::copy(const llama_moe_copy & c) {
    staging.resize(c.nbytes);
    FILE * f = files[c.file];
    if (llama_moe_fseek(f, (long long) c.offs, SEEK_SET) != 0 || fread(staging.data(), 1, c.nbytes, f) != c.nbytes) {
        // note: the slot stays zero, so the output would be wrong; this is unrecoverable
        GGML_ABORT("moe-cache: cannot read %zu bytes at offset %zu of %s", c.nbytes, c.offs, paths[c.file].c_str());
    }
    ggml_backend_tensor_set(c.dst, staging.data(), c.dst_offs, c.nbytes);
}
