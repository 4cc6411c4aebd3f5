// pybmoe: the governor's turn while the model is idle. See llama-moe-governor-poll.h.

#include "llama-moe-governor-poll.h"

#include <chrono>

void llama_moe_governor_poll::start(std::function<void()> turn, int period_ms) {
    if (thread.joinable() || !turn || period_ms <= 0) {
        return;
    }
    quit   = false;
    thread = std::thread([this, turn = std::move(turn), period_ms]() {
        std::unique_lock<std::mutex> lock(mutex);
        while (!cv.wait_for(lock, std::chrono::milliseconds(period_ms), [this] { return quit; })) {
            lock.unlock();
            turn();
            lock.lock();
        }
    });
}

void llama_moe_governor_poll::stop() {
    if (!thread.joinable()) {
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mutex);
        quit = true;
    }
    cv.notify_all();
    thread.join();
}
