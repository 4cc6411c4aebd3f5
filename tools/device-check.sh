#!/usr/bin/env bash
# GPU checks on a machine with one NVIDIA GPU and no network, in 10 minutes or less.
# Prepare here first:  tools/device-pack.sh      (writes build/device/, about 37 MB)
# Then, on the GPU machine with build/device copied along: tools/device-check.sh
#
# 1. builds the CUDA backend (sm_90, FlashAttention kernels off to save build time) from the
#    carried patched tree, with pybmoe's ggml-ext;
#    patches/candidates/*.patch are applied on top (the CUDA duplicate-id fixes, unverified until
#    this runs; PYBMOE_CANDIDATES=0 leaves them out);
# 2. test-backend-ops on CUDA0 for MUL_MAT_ID (the op of the cache's device chain) including the
#    duplicate-expert-id cases (-p dup=, a table per type), and the
#    skip-table guard (CUDA0 must refuse a MUL_MAT_ID with a skip table);
# 3. the cache on the GPU, for qwen3moe, gemma4 (fused gate_up, down scale) and gpt-oss (biases):
#    every layer on CUDA0, experts on the host (--cpu-moe); with the cache at 8 slots the greedy
#    tokens must equal cache off and the logits' NMSE against cache off be <= 1e-6 (different
#    kernels on the two sides, so not bit-identical), and the summary line must show hits; the same
#    again with GGML_CUDA_DISABLE_FUSION=1 (slots "8-nofusion"), since b11434's CUDA backend fuses a
#    routed MUL_MAT_ID + GLU with a shared expert of the same shape (qwen35moe), and reorders the
#    graph's nodes for it, which the cache's device chain can now match; and the pool (slots "pool":
#    --moe-expert-cache-mb at the MiB the 8 slots per layer took, one bank of P + S + 1 slots per
#    projection that every layer's MUL_MAT_ID reads), under the same limits; each run also gives its
#    decode tok/s (pybmoe-logits' decode-tok-s), so the pool stands beside 8 slots per layer at one MiB.
# Results: $OUT (or build/device-out) / summary.txt, e2e.csv and logs.tar.gz (every log and table;
# the device tool brings back at most 8 files). Bulky files (models, logits) stay in $WORK.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device-out}; mkdir -p "$OUT"
WORK=${WORK:-build/device-work}; rm -rf "$WORK"; mkdir -p "$WORK"
pack() { tar -C "$WORK" -czf "$OUT/logs.tar.gz" --exclude='*.bin' --exclude='*.gguf' . ; cp "$WORK/summary.txt" "$OUT/" 2>/dev/null; cp "$WORK/e2e.csv" "$OUT/" 2>/dev/null; true; }
trap pack EXIT
ARCH=${CUDA_ARCH:-90}
SRC=/tmp/pybmoe-llama-src
t0=$(date +%s)
rm -rf "$SRC" && mkdir -p "$SRC" && tar -C "$SRC" -xJf build/device/llama-src.tar.xz
: > "$WORK/summary.txt"
# candidate patches not yet in the series (verified here first): CUDA MUL_MAT_ID with duplicate ids.
# PYBMOE_CANDIDATES=0 builds the series alone (the dup-id cases are then expected to fail on CUDA).
for c in patches/candidates/*.patch; do
    [ "${PYBMOE_CANDIDATES:-1}" = 1 ] && [ -f "$c" ] || continue
    if (cd "$SRC/llama.cpp" && git apply "$OLDPWD/$c"); then
        echo "candidate applied: $(basename "$c")" | tee -a "$WORK/summary.txt"
    else
        echo "candidate does NOT apply: $(basename "$c")" | tee -a "$WORK/summary.txt"
    fi
done
cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DPYBMOE_LLAMA_CPP_DIR="$SRC/llama.cpp" \
      -DGGML_CUDA=ON -DGGML_CUDA_FA=OFF -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_NATIVE=OFF \
      > "$WORK/configure.log" 2>&1 || { tail -40 "$WORK/configure.log"; exit 1; }
cmake --build build/cuda -j"$(nproc)" --target test-backend-ops pybmoe-logits pybmoe-test-skip \
      > "$WORK/build.log" 2>&1 || { tail -60 "$WORK/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$WORK/summary.txt"
BIN=build/cuda/bin

timeout 200 "$BIN/test-backend-ops" -b CUDA0 -o MUL_MAT_ID > "$WORK/test-backend-ops.txt" 2>&1
echo "test-backend-ops MUL_MAT_ID rc=$?: $(grep -E 'tests passed|Backend' "$WORK/test-backend-ops.txt" | tail -2 | tr '\n' ' ')" | tee -a "$WORK/summary.txt"
# the duplicate-expert-id cases (patch 0010), with a table per type (python3 is there; pybmoe needs no deps for this)
timeout 200 "$BIN/test-backend-ops" -b CUDA0 -o MUL_MAT_ID -p dup= > "$WORK/test-backend-ops-dup.txt" 2>&1
echo "dup-id cases rc=$?: $(grep -E 'tests passed' "$WORK/test-backend-ops-dup.txt" | tail -1)" | tee -a "$WORK/summary.txt"
PYTHONPATH=. python3 -c "import sys; from pybmoe.engine import backend_ops as b; r=b.parse(open(sys.argv[1]).read()); print(b.table(r))" \
    "$WORK/test-backend-ops-dup.txt" | tee -a "$WORK/summary.txt"
timeout 60 "$BIN/pybmoe-test-skip" > "$WORK/test-skip.txt" 2>&1
echo "skip-table test rc=$?: $(tail -1 "$WORK/test-skip.txt") ($(grep 'devices checked' "$WORK/test-skip.txt"))" | tee -a "$WORK/summary.txt"

# per architecture: greedy tokens equal and the logits' NMSE vs cache off <= 1e-6 (CSV: e2e.csv)
nmse() {  # NMSE of float32 file $2 against $1, in pure python (no numpy needed)
    python3 - "$1" "$2" <<'PY'
import array, sys
a, b = array.array("f"), array.array("f")
a.frombytes(open(sys.argv[1], "rb").read()); b.frombytes(open(sys.argv[2], "rb").read())
if len(a) != len(b) or not a:
    print("nan"); sys.exit()
num = sum((x - y) ** 2 for x, y in zip(a, b)); den = sum(x * x for x in a)
print(f"{num / den:.3e}" if den else "nan")
PY
}
# the tiny models, written here from pybmoe's generator (the gguf package from the carried tree's gguf-py;
# numpy is on the device image): separate experts; fused gate_up + down scale; biases + swiglu_oai; a
# shared expert of the experts' own size and type (qwen35moe), which b11434's CUDA fusion can match
for arch in qwen3moe gemma4 gpt-oss qwen35moe; do
    small=(); [ "$arch" = qwen35moe ] && small=(--embd 128 --ff 128)
    PYTHONPATH="$SRC/llama.cpp/gguf-py:." python3 -m pybmoe.cli make-model "$WORK/tiny-$arch.gguf" --arch "$arch" \
        --ftype Q8_0 --vocab build/device/ggml-vocab-gpt-2.gguf "${small[@]}" >> "$WORK/models.log" 2>&1 \
        || echo "model $arch: not written ($(tail -1 "$WORK/models.log"))" | tee -a "$WORK/summary.txt"
done
echo "arch,slots,rc,tokens_equal,nmse,hit_pct,decode_tok_s" > "$WORK/e2e.csv"
for M in "$WORK"/tiny-*.gguf; do
    arch=$(basename "$M" .gguf); arch=${arch#tiny-}
    for slots in 0 8 8-nofusion pool; do
        fuse=(); [ "$slots" = 8-nofusion ] && fuse=(GGML_CUDA_DISABLE_FUSION=1)
        cache=(--moe-expert-cache "${slots%%-*}")
        if [ "$slots" = pool ]; then  # the MiB the 8 slots per layer took on CUDA0 (the preamble's budget_mib), as a pool
            mib=$(grep -ho "budget_mib=[^ ]*" "$WORK/run-$arch-8.log" "$WORK/tokens-$arch-8.txt" | head -1 | sed 's/.*://; s/\..*//')
            cache=(--moe-expert-cache-mb $(( ${mib:-0} + 1 )))
        fi
        env "${fuse[@]}" timeout 120 "$BIN/pybmoe-logits" --logits-out "$WORK/logits-$arch-$slots.bin" -m "$M" -p "The quick brown fox" -n 48 \
            -ngl 99 --cpu-moe --fit off "${cache[@]}" > "$WORK/tokens-$arch-$slots.txt" 2> "$WORK/run-$arch-$slots.log"
        rc=$?
        [ "$slots" = 0 ] && continue
        same=no; cmp -s <(grep '^token' "$WORK/tokens-$arch-0.txt") <(grep '^token' "$WORK/tokens-$arch-$slots.txt") && same=yes
        e=$(nmse "$WORK/logits-$arch-0.bin" "$WORK/logits-$arch-$slots.bin")
        hit=$(grep -ho "moe-cache: [0-9.]*% hit" "$WORK/run-$arch-$slots.log" "$WORK/tokens-$arch-$slots.txt" | tail -1 | grep -o "[0-9.]*%" | tr -d %)
        tps=$(grep -ho "^decode-tok-s [0-9.]*" "$WORK/tokens-$arch-$slots.txt" | awk '{print $2}')
        echo "$arch,$slots,$rc,$same,$e,${hit:-},${tps:-}" >> "$WORK/e2e.csv"
        echo "cuda cache $arch ($slots): rc=$rc tokens identical=$same nmse=$e (limit 1e-6) hit=${hit:-none}% decode ${tps:-?} tok/s (off: $(grep -ho "^decode-tok-s [0-9.]*" "$WORK/tokens-$arch-0.txt" | awk '{print $2}'))" | tee -a "$WORK/summary.txt"
    done
done
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$WORK/summary.txt"
