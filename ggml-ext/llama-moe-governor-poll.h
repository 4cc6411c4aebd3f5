#pragma once

// pybmoe: the governor's turn while the model is idle.
//
// The stream tier's governor (llama-moe-governor.h) runs before each ubatch. A server that waits for
// its next request runs no ubatch, so memory another process takes meanwhile would meet the cgroup's
// limit (or the kernel's OOM killer) while the tier holds memory it could give, and memory given back
// would wait for a request to be lent again. This thread gives the governor a turn every period: it
// takes the model's graph lock only when no graph holds it (a graph that runs has its own turn, before
// it), then the tier's lock, and calls `turn`. Reading the memory costs one read of a few /proc and
// cgroup files (docs/stream-tier.md, "Serving under a memory limit"), and the governor itself does
// nothing unless the slack crossed a step.
//
// Holds: the thread, its period and its stop. Must not hold: the rule (llama-moe-governor.h), the locks'
// owner (llama-moe-model.h) or reading the memory (llama-moe-memory.h).

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

struct llama_moe_governor_poll {
    // starts the thread (once; a second call is ignored): `turn` every `period_ms` milliseconds
    void start(std::function<void()> turn, int period_ms);
    // stops and joins the thread; no turn runs after it returns
    void stop();

    llama_moe_governor_poll() = default;
    llama_moe_governor_poll(const llama_moe_governor_poll &) = delete;
    llama_moe_governor_poll & operator=(const llama_moe_governor_poll &) = delete;
    ~llama_moe_governor_poll() { stop(); }

private:
    std::thread             thread;
    std::mutex              mutex;
    std::condition_variable cv;
    bool                    quit = false;
};
