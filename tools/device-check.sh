#!/usr/bin/env bash
# GPU checks on a machine with one NVIDIA GPU and no network, in 10 minutes or less.
# Prepare here first:  tools/device-pack.sh      (writes build/device/, about 37 MB)
# Then, on the GPU machine with build/device copied along: tools/device-check.sh
#
# 1. builds the CUDA backend (sm_90, FlashAttention kernels off to save build time) from the
#    carried patched tree, with pybmoe's ggml-ext;
# 2. test-backend-ops on CUDA0 for MUL_MAT_ID (the op of the cache's device chain) including the
#    duplicate-expert-id cases (-p dup=, a table per type), and the
#    skip-table guard (CUDA0 must refuse a MUL_MAT_ID with a skip table);
# 3. the cache on the GPU: every layer on CUDA0, experts on the host (--cpu-moe); greedy tokens with
#    the cache at 8 slots must equal cache off (different kernels on the two sides, so the check is
#    on tokens, not bit-identical logits), and the summary line must show hits.
# Results: $OUT (or build/device-out) / summary.txt and logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device-out}; mkdir -p "$OUT"
ARCH=${CUDA_ARCH:-90}
SRC=/tmp/pybmoe-llama-src
t0=$(date +%s)
rm -rf "$SRC" && mkdir -p "$SRC" && tar -C "$SRC" -xJf build/device/llama-src.tar.xz
cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DPYBMOE_LLAMA_CPP_DIR="$SRC/llama.cpp" \
      -DGGML_CUDA=ON -DGGML_CUDA_FA=OFF -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_NATIVE=OFF \
      > "$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
cmake --build build/cuda -j"$(nproc)" --target test-backend-ops pybmoe-logits pybmoe-test-skip \
      > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s" | tee "$OUT/summary.txt"
BIN=build/cuda/bin

timeout 200 "$BIN/test-backend-ops" -b CUDA0 -o MUL_MAT_ID > "$OUT/test-backend-ops.txt" 2>&1
echo "test-backend-ops MUL_MAT_ID rc=$?: $(grep -E 'tests passed|Backend' "$OUT/test-backend-ops.txt" | tail -2 | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
# the duplicate-expert-id cases (patch 0010), with a table per type (python3 is there; pybmoe needs no deps for this)
timeout 200 "$BIN/test-backend-ops" -b CUDA0 -o MUL_MAT_ID -p dup= > "$OUT/test-backend-ops-dup.txt" 2>&1
echo "dup-id cases rc=$?: $(grep -E 'tests passed' "$OUT/test-backend-ops-dup.txt" | tail -1)" | tee -a "$OUT/summary.txt"
PYTHONPATH=. python3 -c "import sys; from pybmoe import backend_ops as b; r=b.parse(open(sys.argv[1]).read()); print(b.table(r))" \
    "$OUT/test-backend-ops-dup.txt" | tee -a "$OUT/summary.txt"
timeout 60 "$BIN/pybmoe-test-skip" > "$OUT/test-skip.txt" 2>&1
echo "skip-table test rc=$?: $(tail -1 "$OUT/test-skip.txt") ($(grep 'devices checked' "$OUT/test-skip.txt"))" | tee -a "$OUT/summary.txt"

M=build/device/tiny-moe.gguf
for slots in 0 8; do
    timeout 120 "$BIN/pybmoe-logits" --logits-out "$OUT/logits-$slots.bin" -m "$M" -p "The quick brown fox" -n 48 \
        -ngl 99 --cpu-moe --fit off --moe-expert-cache $slots > "$OUT/tokens-$slots.txt" 2> "$OUT/run-$slots.log"
    echo "cache $slots rc=$?" | tee -a "$OUT/summary.txt"
done
if cmp -s <(grep '^token' "$OUT/tokens-0.txt") <(grep '^token' "$OUT/tokens-8.txt"); then
    echo "cuda cache: greedy tokens identical to cache off" | tee -a "$OUT/summary.txt"
else
    echo "cuda cache: greedy tokens DIFFER from cache off" | tee -a "$OUT/summary.txt"
fi
grep -h "moe-cache" "$OUT/tokens-8.txt" "$OUT/run-8.log" | grep -E "hit|preamble" | tail -3 | tee -a "$OUT/summary.txt"
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
