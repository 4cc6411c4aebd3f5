// pybmoe-bw: the bandwidths of the expert cache's bandwidth model, measured on the spot.
//
//   pybmoe-bw [--host-mib N] [--dev-mib N] [--threads T] [--reps R]
//
// - host_read: T threads summing disjoint slices of an N MiB host buffer (what the host chain
//   does with the missed experts: stream their weights from RAM), bytes read / time;
// - h2d_pinned, h2d_pageable: one cudaMemcpy of N MiB from pinned (cudaMallocHost) and from
//   ordinary (malloc) host memory to the device (the expert uploads; an mmap-ed model is pageable);
// - d2d: cudaMemcpy device to device of N MiB, counted as bytes read + written (2 N / time):
//   the device's memory (HBM) bandwidth, as the device chain reads resident experts.
// Each figure is the best of R repetitions after one untimed pass. Without CUDA (a build without
// GGML_CUDA) the three device figures are nan.
//
// stdout gets one line:
//   pybmoe-bw: host_read_gbs=X h2d_pinned_gbs=Y h2d_pageable_gbs=Z d2d_gbs=W threads=T device=NAME
// in GB/s (1e9 bytes per second).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#ifdef PYBMOE_BW_CUDA
#include <cuda_runtime.h>
#endif

namespace {

double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double host_read(size_t bytes, int threads, int reps) {
    const size_t n = bytes / sizeof(uint64_t);
    std::vector<uint64_t> buf(n);
    // touch every page first (a VM pays for first touches)
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t]() {
            const size_t a = n * t / threads, b = n * (t + 1) / threads;
            for (size_t i = a; i < b; ++i) buf[i] = i * 0x9e3779b97f4a7c15ULL;
        });
    }
    for (auto & th : pool) th.join();
    double best = 0.0;
    volatile uint64_t sink = 0;
    for (int r = 0; r <= reps; ++r) {
        std::vector<uint64_t> part(threads * 8, 0);
        pool.clear();
        const double t0 = now();
        for (int t = 0; t < threads; ++t) {
            pool.emplace_back([&, t]() {
                const size_t a = n * t / threads, b = n * (t + 1) / threads;
                uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
                size_t i = a;
                for (; i + 4 <= b; i += 4) {
                    s0 += buf[i]; s1 += buf[i + 1]; s2 += buf[i + 2]; s3 += buf[i + 3];
                }
                for (; i < b; ++i) s0 += buf[i];
                part[t * 8] = s0 + s1 + s2 + s3;
            });
        }
        for (auto & th : pool) th.join();
        const double dt = now() - t0;
        for (int t = 0; t < threads; ++t) sink = sink + part[t * 8];
        if (r > 0) best = std::max(best, (double) (n * sizeof(uint64_t)) / dt / 1e9);
    }
    (void) sink;
    return best;
}

#ifdef PYBMOE_BW_CUDA
bool ok(cudaError_t e, const char * what) {
    if (e != cudaSuccess) {
        fprintf(stderr, "pybmoe-bw: %s: %s\n", what, cudaGetErrorString(e));
        return false;
    }
    return true;
}

double copy_gbs(void * dst, const void * src, size_t bytes, cudaMemcpyKind kind, int reps, double factor) {
    double best = 0.0;
    for (int r = 0; r <= reps; ++r) {
        cudaDeviceSynchronize();
        const double t0 = now();
        if (!ok(cudaMemcpy(dst, src, bytes, kind), "cudaMemcpy")) return NAN;
        cudaDeviceSynchronize();
        const double dt = now() - t0;
        if (r > 0) best = std::max(best, factor * (double) bytes / dt / 1e9);
    }
    return best;
}
#endif

}  // namespace

int main(int argc, char ** argv) {
    size_t host_mib = 2048, dev_mib = 2048;
    int threads = (int) std::max(1u, std::thread::hardware_concurrency()), reps = 3;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        if (i + 1 >= argc) {
            fprintf(stderr, "usage: pybmoe-bw [--host-mib N] [--dev-mib N] [--threads T] [--reps R]\n");
            return 2;
        }
        const long v = strtol(argv[++i], nullptr, 10);
        if (v < 1) {
            fprintf(stderr, "pybmoe-bw: %s needs an integer >= 1\n", k.c_str());
            return 2;
        }
        if (k == "--host-mib") host_mib = (size_t) v;
        else if (k == "--dev-mib") dev_mib = (size_t) v;
        else if (k == "--threads") threads = (int) v;
        else if (k == "--reps") reps = (int) v;
        else {
            fprintf(stderr, "pybmoe-bw: unknown argument '%s'\n", k.c_str());
            return 2;
        }
    }
    const double hr = host_read(host_mib << 20, threads, reps);
    double pinned = NAN, pageable = NAN, d2d = NAN;
    std::string device = "none";
#ifdef PYBMOE_BW_CUDA
    cudaDeviceProp prop;
    if (ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties")) {
        device = prop.name;
        std::replace(device.begin(), device.end(), ' ', '_');
        const size_t bytes = dev_mib << 20;
        void * d0 = nullptr, * d1 = nullptr, * hp = nullptr;
        if (ok(cudaMalloc(&d0, bytes), "cudaMalloc") && ok(cudaMalloc(&d1, bytes), "cudaMalloc")) {
            cudaMemset(d0, 1, bytes);
            d2d = copy_gbs(d1, d0, bytes, cudaMemcpyDeviceToDevice, reps, 2.0);
            if (ok(cudaMallocHost(&hp, bytes), "cudaMallocHost")) {
                memset(hp, 1, bytes);
                pinned = copy_gbs(d0, hp, bytes, cudaMemcpyHostToDevice, reps, 1.0);
                cudaFreeHost(hp);
            }
            std::vector<uint8_t> pg(bytes, 1);
            pageable = copy_gbs(d0, pg.data(), bytes, cudaMemcpyHostToDevice, reps, 1.0);
        }
        cudaFree(d0);
        cudaFree(d1);
    }
#else
    (void) dev_mib;
#endif
    printf("pybmoe-bw: host_read_gbs=%.2f h2d_pinned_gbs=%.2f h2d_pageable_gbs=%.2f d2d_gbs=%.2f threads=%d device=%s\n",
           hr, pinned, pageable, d2d, threads, device.c_str());
    return 0;
}
