#!/usr/bin/env bash
# tests/gpu/check.sh — the GPU check, in one go: build with CUDA, run the GPU tests (every kernel against its CPU
# twin, whole models against the CPU path, quantized files against their dequantized logits, greedy ids, batch
# invariance), a CLI smoke test, then measure the card (copy bandwidth, cuBLAS bf16 matmul rate) and benchmark a
# Llama-3.2-1B-shaped model in bf16 (decode at batch 1, 8, 64; prefill of 2048 tokens), then the same weights
# quantized to Q8_0 and Q4_K (decode at batch 1 and 8, prefill of 512). Prints a short table last. About 8 minutes on
# an H200 with 16 cores, the build included.
#
#   tests/gpu/check.sh        (from anywhere; INFER_SHARED=PATH if the test data is not in ../shared, shared/ or
#                              .gpu-carry/shared; writes its logs to $OUT, else /tmp/infer-gpu-check;
#                              INFER_GPU_BUILD=DIR runs the infer, test_cuda and 07_hardware_gpu already built in DIR
#                              (with -Dcuda=enabled, against the same CUDA version) instead of building them)
#
# A device machine has nvcc, meson and ninja but neither doctest nor ../shared. Carry them in an ignored folder:
#   mkdir -p .gpu-carry/include .gpu-carry/shared/models .gpu-carry/shared/fixtures
#   cp -r /usr/include/doctest .gpu-carry/include/
#   cp -r ../shared/models/stories260K .gpu-carry/shared/models/ && cp -r ../shared/fixtures/arch .gpu-carry/shared/fixtures/
#   echo /.gpu-carry/ >> .git/info/exclude
# then run `tests/gpu/check.sh` there with .gpu-carry carried (about 12 MB).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PATH="/usr/local/cuda/bin:$PATH"
out=${OUT:-/tmp/infer-gpu-check}
mkdir -p "$out"
log() { echo "== $(date +%T) $*"; }

shared=${INFER_SHARED:-}
for candidate in ../shared shared .gpu-carry/shared; do
  if [ -z "$shared" ] && [ -f "$candidate/models/stories260K/stories260K.gguf" ]; then shared=$(cd "$candidate" && pwd); fi
done
[ -n "$shared" ] || { shared=$(pwd)/../shared; echo "note: no test data found: the model tests will say SKIPPED"; }

# doctest from .gpu-carry when the system has none (meson's header check and the build both see CXXFLAGS).
if [ -d .gpu-carry/include/doctest ] && [ ! -f /usr/include/doctest/doctest.h ]; then
  export CXXFLAGS="-I$(pwd)/.gpu-carry/include ${CXXFLAGS:-}"
fi
work=/tmp/infer-gpu-work
mkdir -p "$work"

log "device"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader || true

bin=${INFER_GPU_BUILD:-}
if [ -n "$bin" ] && ! "$bin/07_hardware_gpu" --help > "$out/prebuilt.log" 2>&1; then
  echo "the programs in $bin do not run here (see prebuilt.log): building them"; bin=""
fi
if [ -z "$bin" ]; then
  log "build (only the targets this script runs)"
  bin=build-gpu
  meson setup build-gpu --wipe -Dcuda=enabled -Dshared_dir="$shared" > "$out/build.log" 2>&1 \
    || meson setup build-gpu -Dcuda=enabled -Dshared_dir="$shared" >> "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
  grep -E "CUDA|doctest" "$out/build.log"
  targets="infer 07_hardware_gpu"
  if grep -q 'Has header "doctest/doctest.h" : YES' "$out/build.log"; then targets="$targets test_cuda"; fi
  meson compile -C build-gpu $targets >> "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
fi

log "GPU tests ($bin/test_cuda)"
if [ -x $bin/test_cuda ]; then
  INFER_SHARED="$shared" INFER_BIN=$bin/infer timeout 240 $bin/test_cuda 2>&1 | tee "$out/test_cuda.log" | tail -60
  tests_status=${PIPESTATUS[0]}
else
  echo "test_cuda not built: no doctest (see the top of this script)" | tee "$out/test_cuda.log"
  tests_status=missing
fi

log "CLI: greedy ids on stories260K, --device cpu and --device cuda"
cli_status="skipped (no stories260K)"
if [ -f "$shared/models/stories260K/stories260K.gguf" ]; then
  for device in cpu cuda; do
    $bin/infer generate -m "$shared/models/stories260K/stories260K.gguf" -p "Once upon a time" -n 48 --temp 0 --ids \
      --device $device > "$work/generate_$device.json" 2> "$work/generate_$device.err"
    { echo "--device $device:"; cat "$work/generate_$device.json"; tail -3 "$work/generate_$device.err"; } | tee -a "$out/cli.log"
  done
  if cmp -s "$work/generate_cpu.json" "$work/generate_cuda.json"; then cli_status="identical ids"; else cli_status="IDS DIFFER"; fi
  echo "$cli_status" | tee -a "$out/cli.log"
fi

log "make-model: Llama-3.2-1B shape, bf16, tied"
model="$work/llama-1b-bf16.gguf"
if [ ! -f "$model" ]; then
  $bin/infer make-model -o "$model" --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 \
    --context 4096 --dtype bf16 --tied || exit 1
fi

log "benchmark (07_hardware_gpu), bf16"
timeout 300 $bin/07_hardware_gpu -m "$model" --batches 1,8,64 --context 512 --steps 32 --prefill-tokens 2048 \
  2>&1 | tee "$out/bench.log"
bench_status=${PIPESTATUS[0]}

# The same weights in the two block formats the GPU decodes in registers (--pure: every matrix in that type, so no
# matrix is widened to f32 and the bytes per step are the format's).
for type in Q8_0 Q4_K; do
  log "benchmark (07_hardware_gpu), $type"
  quantized="$work/llama-1b-$type.gguf"
  [ -f "$quantized" ] || $bin/infer quantize -m "$model" -o "$quantized" --type $type --pure -t "$(nproc)" 2> "$out/quantize_$type.log" \
    || { tail -3 "$out/quantize_$type.log"; continue; }
  timeout 200 $bin/07_hardware_gpu -m "$quantized" --batches 1,8 --context 512 --steps 32 --prefill-tokens 512 \
    2>&1 | tee "$out/bench_$type.log"
done

{
echo
echo "================================ summary ================================"
echo "GPU tests:        $( [ "$tests_status" = 0 ] && echo passed || echo "FAILED ($tests_status)" ) — $(grep -E '^\[doctest\] (test cases|assertions)' "$out/test_cuda.log" | tr '\n' ' ')"
echo "                  $(grep -c 'SKIPPED' "$out/test_cuda.log") cases skipped (a skipped case passes: read why in test_cuda.log)"
echo "CLI greedy ids:   $cli_status"
echo "benchmark:        $( [ "$bench_status" = 0 ] && echo done || echo "FAILED (rc $bench_status)" )"
sed -n '/^regime/,$p' "$out/bench.log"
for type in Q8_0 Q4_K; do
  [ -f "$out/bench_$type.log" ] && { echo "$type:"; sed -n '/^model:/p;/^decode\|^prefill/p' "$out/bench_$type.log"; }
done
} | tee "$out/summary.txt"
