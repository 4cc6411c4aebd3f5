#!/usr/bin/env bash
# GPU benchmark of the expert cache against the bandwidth limit, on one NVIDIA GPU with no network,
# in under 10 minutes (docs/benchmarks.md, "GPU benchmark script").
#
#   tools/device-pack.sh                 here: the patched tree, the vocab and the replay trace
#   tools/device-bench.sh                on the device machine, with build/device carried along
#   tools/device-bench.sh --cpu-smoke    the same plumbing on a CPU machine: build/dev, a tiny shape,
#                                        a loopback ggml-rpc-server as the device (seconds)
#   tools/device-bench.sh --shape        print the benchmark shape (device-pack.sh reads it)
#
# 1. builds llama-bench with CUDA (sm_90, FlashAttention kernels off) from the carried patched tree
#    into build/cuda, plus pybmoe-make-synth and pybmoe-bw (those two first: they need no backend);
# 2. writes a synthetic qwen3moe model of Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8,
#    2048 / 768 wide; pybmoe/models/shapes.py, preset qwen3-30b-a3b) in Q4_0: 17.0 GB, while llama-bench
#    builds (to /dev/shm when it has room, else build/);
# 3. measures the host's RAM read, host->device and device (HBM) bandwidths (pybmoe-bw);
# 4. runs llama-bench (-r 3, pp and tg as separate runs) under --moe-route-replay with a trace of
#    the model's shape (the granite trace mapped onto 48 x 128 by `pybmoe trace synth`):
#      host      -ngl 99 -ncmoe 99 (every expert in host memory, the stock --cpu-moe), cache off
#      cache-S   the same with --moe-expert-cache S, for 3 sizes S
#      pool-S    the MiB cache-S took on the device (its budget_mib), as one pool: --moe-expert-cache-mb
#      vram      -ngl 99 (every expert on the device: the ceiling)
#    all with --repack 0 (the cache's host chain needs the plain layout; host-repack, the stock
#    default, runs last if time is left). Runs go in priority order and stop at the deadline;
# 5. python3 -m pybmoe.cli.devbench: the bandwidth model per point (pybmoe/bench/devbench.py), the CSV and
#    the PNGs.
# Output: $OUT (default build/device-bench-out; --cpu-smoke: build/device-bench-smoke):
#   summary.txt (phase timings and results), device-bench.csv, device-bench-tg.png,
#   device-bench-pp.png, runs.tsv, runs/*.csv|log, bw.txt, synth.txt, build logs (on the GPU machine
#   all but the first five and table.txt are packed into logs.tar.gz at exit).
# Knobs (environment): BENCH_BIN_DIR (prebuilt binaries: skip the builds), BENCH_DEADLINE_S (default 560: the whole run), BENCH_SLOTS, BENCH_TYPE,
# BENCH_LAYERS, BENCH_N_PROMPT, BENCH_N_GEN, BENCH_REPS, BENCH_KEEP_MODEL=1, CUDA_ARCH (90).
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
case "${1:-}" in
    --cpu-smoke) MODE=smoke ;;
    --shape) ;;
    "") ;;
    *) echo "usage: tools/device-bench.sh [--cpu-smoke|--shape]" >&2; exit 2 ;;
esac

if [ "$MODE" = gpu ]; then
    # qwen3-30b-a3b as in pybmoe/models/shapes.py (https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json);
    # tests/bench/test_device_bench.py checks that these numbers are the preset's
    L=${BENCH_LAYERS:-48}; E=128; K=8; D=2048; F=768; H=32; HKV=4; HD=128
    TYPE=${BENCH_TYPE:-q4_0}; SLOTS=${BENCH_SLOTS:-"32 64 96"}
    NP=${BENCH_N_PROMPT:-512}; NG=${BENCH_N_GEN:-128}; REPS=${BENCH_REPS:-3}; TRACE_STEPS=4096
    OUT=${OUT:-build/device-bench-out}; BIN=build/cuda/bin
else
    L=${BENCH_LAYERS:-6}; E=32; K=8; D=256; F=128; H=4; HKV=2; HD=64
    TYPE=${BENCH_TYPE:-q4_0}; SLOTS=${BENCH_SLOTS:-"8 16 24"}
    NP=${BENCH_N_PROMPT:-64}; NG=${BENCH_N_GEN:-32}; REPS=${BENCH_REPS:-3}; TRACE_STEPS=1024
    OUT=${OUT:-build/device-bench-smoke}; BIN=build/dev/bin
fi
if [ "${1:-}" = --shape ]; then
    echo "BENCH_LAYERS=$L BENCH_EXPERTS=$E BENCH_TOP_K=$K BENCH_TRACE_STEPS=$TRACE_STEPS"
    exit 0
fi

T0=$(date +%s)
DEADLINE=$((T0 + ${BENCH_DEADLINE_S:-560}))
mkdir -p "$OUT/runs"
# the device tool brings back at most 8 files from $OUT: on the GPU machine, at exit (also an early one),
# everything but the results goes into $OUT/logs.tar.gz
pack_out() {
    local keep=" summary.txt table.txt runs.tsv device-bench.csv device-bench-tg.png device-bench-pp.png logs.tar.gz " rest=() f
    ( cd "$OUT" || exit 0
      for f in *; do [[ $keep == *" $f "* ]] || rest+=("$f"); done
      [ ${#rest[@]} -eq 0 ] || { tar -czf logs.tar.gz "${rest[@]}" && rm -rf "${rest[@]}"; } )
}
[ "$MODE" = gpu ] && trap pack_out EXIT
: > "$OUT/summary.txt"
: > "$OUT/runs.tsv"
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
TMP=$(mktemp -d /tmp/pybmoe-bench.XXXXXX)
RPC_PID=""
MODEL=""
cleanup() {
    if [ -n "$RPC_PID" ]; then kill "$RPC_PID" 2>/dev/null; wait "$RPC_PID" 2>/dev/null; fi
    if [ -n "$MODEL" ] && [ "${BENCH_KEEP_MODEL:-0}" != 1 ]; then rm -f "$MODEL" "$MODEL.tmp"; fi
    rm -rf "$TMP"
}
trap cleanup EXIT
log "device-bench ($MODE): L$L E$E top-$K D$D F$F $TYPE, slots $SLOTS, pp$NP / tg$NG x $REPS, deadline $(left) s"

# --- 1. build ------------------------------------------------------------------------------
t=$(date +%s)
BUILD_DIR=build/$( [ "$MODE" = gpu ] && echo cuda || echo dev )
if [ "$MODE" = gpu ]; then
    VOCAB=build/device/ggml-vocab-qwen2.gguf
else
    VOCAB=$(python3 -c "from pybmoe import models; print(models.default_vocab_path())") || exit 1
fi
if [ -n "${BENCH_BIN_DIR:-}" ]; then
    BIN=$BENCH_BIN_DIR
    log "binaries: $BIN (prebuilt)"
elif [ "$MODE" = gpu ]; then
    SRC=/tmp/pybmoe-llama-src
    rm -rf "$SRC" && mkdir -p "$SRC" && tar -C "$SRC" -xJf build/device/llama-src.tar.xz || { log "no build/device/llama-src.tar.xz: run tools/device-pack.sh"; exit 1; }
    cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DPYBMOE_LLAMA_CPP_DIR="$SRC/llama.cpp" \
          -DGGML_CUDA=ON -DGGML_CUDA_FA=OFF -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_NATIVE=OFF \
          > "$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; log "configure failed"; exit 1; }
fi
if [ -z "${BENCH_BIN_DIR:-}" ]; then
    cmake --build "$BUILD_DIR" -j"$(nproc)" --target pybmoe-make-synth pybmoe-bw \
          > "$OUT/build-tools.log" 2>&1 || { tail -40 "$OUT/build-tools.log"; log "building pybmoe-make-synth/pybmoe-bw failed"; exit 1; }
    log "build of pybmoe-make-synth, pybmoe-bw: $(( $(date +%s) - t )) s"
fi

# --- 2. the model, written while llama-bench builds ----------------------------------------------
SIZE=$("$BIN/pybmoe-make-synth" x --vocab "$VOCAB" --n-layer $L --n-expert $E --top-k $K --n-embd $D --n-ff-exp $F \
       --n-head $H --n-head-kv $HKV --head-dim $HD --type $TYPE --dry-run 2>/dev/null | sed -n 's/.* bytes=\([0-9]*\) .*/\1/p')
SHM_FREE=$(( $(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}' || echo 0) * 1024 ))
if [ "$MODE" = gpu ] && [ "${SHM_FREE:-0}" -gt $(( ${SIZE:-0} + (4 << 30) )) ]; then
    MODEL=/dev/shm/pybmoe-bench.gguf
elif [ "$MODE" = gpu ]; then
    MODEL=$PWD/build/pybmoe-bench.gguf
else
    MODEL=$TMP/model.gguf
fi
WRITE_THREADS=$(( $(nproc) > 4 ? 4 : $(nproc) ))
t_model=$(date +%s)
REUSE=""
# BENCH_KEEP_MODEL=1 keeps the model for a second run on the same machine, which then reuses it
[ "${BENCH_KEEP_MODEL:-0}" = 1 ] && [ -f "$MODEL" ] && [ "$(stat -c %s "$MODEL")" = "${SIZE:-x}" ] && REUSE=--dry-run
( "$BIN/pybmoe-make-synth" "$MODEL" $REUSE --vocab "$VOCAB" --n-layer $L --n-expert $E --top-k $K --n-embd $D \
      --n-ff-exp $F --n-head $H --n-head-kv $HKV --head-dim $HD --type $TYPE --threads $WRITE_THREADS \
      > "$OUT/synth.txt" 2> "$OUT/synth.log"
  echo "shape: n_layer=$L n_expert=$E top_k=$K n_embd=$D n_ff_exp=$F type=$TYPE" >> "$OUT/synth.txt" ) &
WRITER=$!

t=$(date +%s)
TARGETS="llama-bench"
[ "$MODE" = smoke ] && TARGETS="llama-bench ggml-rpc-server"
if [ -z "${BENCH_BIN_DIR:-}" ]; then
    cmake --build "$BUILD_DIR" -j"$(nproc)" --target $TARGETS \
          > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; log "building $TARGETS failed"; exit 1; }
    log "build of $TARGETS: $(( $(date +%s) - t )) s"
fi
wait $WRITER || { cat "$OUT/synth.log"; log "writing the model failed"; exit 1; }
log "model: $(tail -1 "$OUT/synth.log" | sed 's/^pybmoe-make-synth: //') (done $(( $(date +%s) - t_model )) s after its start)"

# --- the replay trace --------------------------------------------------------------------------
TRACE=$TMP/trace.csv
if [ "$MODE" = gpu ] && [ -f build/device/bench-trace.csv.xz ]; then
    xz -dc build/device/bench-trace.csv.xz > "$TRACE"
else
    python3 -m pybmoe.cli trace synth --from pybmoe/data/granite-3.0-1b-a400m-routing.json --steps $TRACE_STEPS --seed 0 \
        --n-layer $L --n-expert $E --top-k $K --out "$TRACE" > "$OUT/trace.log" 2>&1 \
        || { cat "$OUT/trace.log"; log "no trace: run tools/device-pack.sh (or install numpy and pandas)"; exit 1; }
fi
HEAD=$(head -1 "$TRACE")
case "$HEAD" in
    *"n_layer=$L n_expert=$E n_expert_used=$K"*) log "trace: $HEAD" ;;
    *) log "the trace is of another shape ($HEAD); expected n_layer=$L n_expert=$E n_expert_used=$K"; exit 1 ;;
esac

# --- 3. bandwidths ---------------------------------------------------------------------------------
t=$(date +%s)
if [ "$MODE" = gpu ]; then
    "$BIN/pybmoe-bw" --host-mib 4096 --dev-mib 2048 > "$OUT/bw.txt" 2> "$OUT/bw.log"
    if grep -q "d2d_gbs=nan" "$OUT/bw.txt" && python3 -c "import torch" 2>/dev/null; then
        # the probe got no device figures: measure them with PyTorch instead
        HR=$(sed -n 's/.*host_read_gbs=\([^ ]*\).*/\1/p' "$OUT/bw.txt")
        python3 - "$HR" > "$OUT/bw.txt" 2>> "$OUT/bw.log" <<'EOF'
import sys, time, torch
n = 2 << 30
def best(f, k):
    f(); torch.cuda.synchronize(); r = 0.0
    for _ in range(3):
        t = time.perf_counter(); f(); torch.cuda.synchronize(); r = max(r, k * n / (time.perf_counter() - t) / 1e9)
    return r
d0 = torch.empty(n, dtype=torch.uint8, device="cuda"); d1 = torch.empty_like(d0)
hp = torch.ones(n, dtype=torch.uint8).pin_memory(); hg = torch.ones(n, dtype=torch.uint8)
print(f"pybmoe-bw: host_read_gbs={sys.argv[1]} h2d_pinned_gbs={best(lambda: d0.copy_(hp), 1):.2f} "
      f"h2d_pageable_gbs={best(lambda: d0.copy_(hg), 1):.2f} d2d_gbs={best(lambda: d1.copy_(d0), 2):.2f} "
      f"threads=0 device=torch:{torch.cuda.get_device_name(0).replace(' ', '_')}")
EOF
    fi
else
    "$BIN/pybmoe-bw" --host-mib 256 --reps 2 > "$OUT/bw.txt" 2> "$OUT/bw.log"
fi
log "bandwidths ($(( $(date +%s) - t )) s): $(sed 's/^pybmoe-bw: //' "$OUT/bw.txt")"

# --- the device -------------------------------------------------------------------------------------
DEV_ARGS=()
if [ "$MODE" = smoke ]; then
    PORT=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    "$BIN/ggml-rpc-server" -H 127.0.0.1 -p "$PORT" -t 1 > "$OUT/rpc.log" 2>&1 &
    RPC_PID=$!
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null && break; sleep 0.1; done
    DEV_ARGS=(--rpc "127.0.0.1:$PORT" -t 1)
    log "device: loopback ggml-rpc-server on port $PORT (pid $RPC_PID)"
else
    DEV_ARGS=(-fa off)
    log "device: $(nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null | head -1)"
fi

# --- 4. the points ---------------------------------------------------------------------------------
printf 'point\tmode\tslots\tplacement\trepack\trc\twall_s\n' > "$OUT/runs.tsv"
RUN_MAX=${BENCH_RUN_MAX_S:-150}
RESERVE=25      # the analysis and the copies after the last run
run() {         # run POINT MODE SLOTS PLACEMENT REPACK
    local point=$1 mode=$2 slots=$3 place=$4 repack=$5
    local budget=$(( $(left) - RESERVE ))
    [ $budget -gt $RUN_MAX ] && budget=$RUN_MAX
    if [ $budget -lt 20 ]; then log "skip ${point} ${mode}: $(left) s left"; return; fi
    local pn=(-p 0 -n "$NG"); [ "$mode" = pp ] && pn=(-p "$NP" -n 0)
    local place_args=(-ngl 99 -ncmoe 99 --moe-expert-cache "$slots")
    [ "$place" = vram ] && place_args=(-ngl 99)
    if [ "$place" = pool ]; then  # the MiB cache-$slots took (its preamble's budget_mib, rounded up), as a pool
        local mib; mib=$(grep -ho "budget_mib=[^ ]*" "$OUT/runs/cache-${slots}_tg.log" 2>/dev/null | head -1 | sed 's/.*://; s/\..*//')
        if [ -z "$mib" ]; then log "skip ${point} ${mode}: cache-${slots} printed no budget"; return; fi
        place_args=(-ngl 99 -ncmoe 99 --moe-expert-cache-mb $(( mib + 1 )))
    fi
    local t=$(date +%s)
    timeout "$budget" "$BIN/llama-bench" -m "$MODEL" "${pn[@]}" -r "$REPS" -o csv -v --repack "$repack" \
        "${place_args[@]}" "${DEV_ARGS[@]}" --moe-route-replay "$TRACE" \
        > "$OUT/runs/${point}_${mode}.csv" 2> "$OUT/runs/${point}_${mode}.log"
    local rc=$? wall=$(( $(date +%s) - t ))
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$point" "$mode" "$slots" "$place" "$repack" "$rc" "$wall" >> "$OUT/runs.tsv"
    local ts
    ts=$(python3 -c "import csv,sys; r=list(csv.DictReader(l for l in open(sys.argv[1]) if l.strip())); print(r[-1]['avg_ts'] if r else 'nan')" \
         "$OUT/runs/${point}_${mode}.csv" 2>/dev/null)
    log "${point} ${mode}: rc=$rc ${wall} s, ${ts:-nan} tok/s $(grep -h 'moe-cache: [0-9.]*% hit' "$OUT/runs/${point}_${mode}.log" | tail -1 | sed 's/.*moe-cache: //')"
}
set -- $SLOTS
S_MID=${2:-$1}
run host tg 0 host 0
run "cache-$S_MID" tg "$S_MID" cache 0
run "pool-$S_MID" tg "$S_MID" pool 0
run vram tg 0 vram 0
for s in $SLOTS; do [ "$s" != "$S_MID" ] && run "cache-$s" tg "$s" cache 0; done
run host pp 0 host 0
run vram pp 0 vram 0
run "cache-$S_MID" pp "$S_MID" cache 0
run host-repack tg 0 host 1
for s in $SLOTS; do [ "$s" != "$S_MID" ] && run "cache-$s" pp "$s" cache 0; done

# --- 5. the model and the plots ------------------------------------------------------------------------
STAND_IN=(); [ "$MODE" = smoke ] && STAND_IN=(--stand-in)
python3 -m pybmoe.cli.devbench "$OUT" "${STAND_IN[@]}" > "$OUT/table.txt" 2> "$OUT/analysis.log" \
    || { cat "$OUT/analysis.log"; log "analysis failed (the runs are in $OUT/runs)"; }
cat "$OUT/table.txt" | tee -a "$OUT/summary.txt"
log "files: $(cd "$OUT" && ls device-bench* 2>/dev/null | tr '\n' ' ')"
log "total: $(( $(date +%s) - T0 )) s"
