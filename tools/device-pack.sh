#!/usr/bin/env bash
# Prepares what tools/device-check.sh and tools/device-bench.sh need on the device machine, which
# cannot reach any network:
#   build/device/llama-src.tar.xz        the patched llama.cpp tree (no model files)
#   build/device/ggml-vocab-gpt-2.gguf   the vocab of device-check.sh's tiny models (written there)
#   build/device/ggml-vocab-qwen2.gguf   the vocab device-bench.sh's synthetic model embeds
#   build/device/bench-trace.csv.xz      device-bench.sh's route-replay trace: the granite trace mapped
#                                        onto the benchmark shape (pybmoe trace synth)
# Then copy build/device (about 21 MB; the device tool's carry limit is 64 MiB) to the GPU machine with the checkout and run
#   tools/device-check.sh   (or tools/device-bench.sh) there, from the checkout's root
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA=$(python3 -m pybmoe.cli vendor | tail -n 1)
mkdir -p build/device
tar -C "$(dirname "$LLAMA")" -cJf build/device/llama-src.tar.xz \
    --exclude='llama.cpp/models/*.gguf*' --exclude='llama.cpp/docs' --exclude='llama.cpp/media' \
    --exclude='llama.cpp/tools/ui/*.gz' "$(basename "$LLAMA")"
# the tiny models are written on the device machine by device-check.sh (random weights do not
# compress, and four of them would not fit the 64 MiB that travels): only their vocab goes along
rm -f build/device/tiny-*.gguf
cp "$LLAMA/models/ggml-vocab-gpt-2.gguf" build/device/
cp "$LLAMA/models/ggml-vocab-qwen2.gguf" build/device/
eval "$(tools/device-bench.sh --shape)"
python3 -m pybmoe.cli trace synth --from pybmoe/data/granite-3.0-1b-a400m-routing.json --steps "$BENCH_TRACE_STEPS" \
    --seed 0 --n-layer "$BENCH_LAYERS" --n-expert "$BENCH_EXPERTS" --top-k "$BENCH_TOP_K" --out build/device/bench-trace.csv
xz -1 -f -T0 build/device/bench-trace.csv   # about 5 MB; the carry limit is 64 MiB in all
du -sh build/device/*
du -sh build/device
