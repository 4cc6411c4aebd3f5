#!/usr/bin/env bash
# Prepares what tools/device-check.sh needs on the device machine, which cannot reach any network:
#   build/device/llama-src.tar.xz   the patched llama.cpp tree (no model files)
#   build/device/tiny-moe.gguf      a tiny qwen3moe (GPT-2 vocab, to stay small)
# Then run it there with carry ["build/device"] (64 MiB in all), e.g.
#   run(command="tools/device-check.sh", carry=["build/device"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA=$(python3 -m pybmoe.vendor | tail -n 1)
mkdir -p build/device
tar -C "$(dirname "$LLAMA")" -cJf build/device/llama-src.tar.xz \
    --exclude='llama.cpp/models/*.gguf*' --exclude='llama.cpp/docs' --exclude='llama.cpp/media' \
    --exclude='llama.cpp/tools/ui/*.gz' "$(basename "$LLAMA")"
python3 -m pybmoe.cli make-model build/device/tiny-moe.gguf --ftype Q8_0 \
    --vocab "$LLAMA/models/ggml-vocab-gpt-2.gguf"
du -sh build/device/*
