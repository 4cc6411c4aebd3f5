#!/usr/bin/env bash
# GPU checks for a lent device machine (one NVIDIA GPU), <= 10 minutes.
# Builds the CUDA backend (sm_90 by default) into build/cuda and runs:
#   1. test-backend-ops on CUDA0 for MUL_MAT_ID (the cache's device chain op);
#   2. the cache on a real GPU: greedy tokens with the cache on match cache off for the
#      embedded model (experts on the host, every layer on CUDA0).
# Results go to $OUT (or build/device-out) as text files.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device-out}; mkdir -p "$OUT"
ARCH=${CUDA_ARCH:-90}
python3 -m pip install -q gguf numpy >/dev/null 2>&1 || true
t0=$(date +%s)
cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_NATIVE=OFF > "$OUT/configure.log" 2>&1
cmake --build build/cuda -j"$(nproc)" --target test-backend-ops pybmoe-logits llama-server > "$OUT/build.log" 2>&1
echo "build: $(( $(date +%s) - t0 )) s" | tee "$OUT/summary.txt"
BIN=build/cuda/bin
timeout 240 "$BIN/test-backend-ops" -b CUDA0 -o MUL_MAT_ID > "$OUT/test-backend-ops.txt" 2>&1 || true
tail -3 "$OUT/test-backend-ops.txt" | tee -a "$OUT/summary.txt"
MODEL=$(PYTHONPATH=. python3 -c "from pybmoe import models; print(models.default_model_path('Q8_0'))")
for slots in 0 8; do
    "$BIN/pybmoe-logits" --logits-out "$OUT/logits-$slots.bin" -m "$MODEL" -p "The quick brown fox" -n 32 \
        -ngl 99 --cpu-moe --fit off --moe-expert-cache $slots > "$OUT/tokens-$slots.txt" 2> "$OUT/logits-$slots.log"
done
if cmp -s <(grep -v moe-cache "$OUT/tokens-0.txt") <(grep -v moe-cache "$OUT/tokens-8.txt"); then
    echo "cuda cache: greedy tokens identical" | tee -a "$OUT/summary.txt"
else
    echo "cuda cache: greedy tokens DIFFER" | tee -a "$OUT/summary.txt"
fi
grep "moe-cache:" "$OUT/logits-8.log" | tail -2 | tee -a "$OUT/summary.txt"
