#!/bin/sh
# gpu_check.sh — on a machine with an NVIDIA GPU: build shardd with the cuda
# backend for sm_90, run the cuda backend tests (which must run, not skip),
# then print the achieved bandwidth of gather / scatter / step against a
# device-to-device cudaMemcpy measured in the same run (bench/gpu_bench.c).
# Whole run bounded to under 8 minutes (build 4, tests 2.5, bench 1.25);
# the tests include the NCCL allgather / reduce_scatter against the host
# backend, the bench their NCCL rows next to the per-rank copies.
#
#   sh bench/gpu_check.sh            (from the repository root or anywhere)
#   BUILD=build/gpu GPU_BENCH_MIB=256 GPU_BENCH_WORLD=4 sh bench/gpu_check.sh
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/gpu}
ARCH=${CUDA_ARCH:--arch=sm_90}
JOBS=$(nproc 2>/dev/null || echo 4)

echo "== gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
else
  echo "gpu_check: nvidia-smi not found (is an NVIDIA driver installed?)"
fi

mkdir -p "$BUILD"
echo "== build: make CUDA=1 CUDA_ARCH=$ARCH BUILD=$BUILD"
timeout 240 make -j"$JOBS" --no-print-directory CUDA=1 CUDA_ARCH="$ARCH" \
  BUILD="$BUILD" all "$BUILD/tests/test_backend_cuda" "$BUILD/bench/gpu_bench" \
  >"$BUILD.make.log" 2>&1 || {
  tail -n 40 "$BUILD.make.log"
  echo "gpu_check: FAILED: build (full log: $BUILD.make.log)"
  exit 1
}
echo "built $BUILD/shardd, $BUILD/tests/test_backend_cuda, $BUILD/bench/gpu_bench"

echo "== tests: $BUILD/tests/test_backend_cuda"
log=$(mktemp)
rc=0
timeout 150 "$BUILD/tests/test_backend_cuda" --jobs 1 --verbose >"$log" 2>&1 || rc=$?
grep -av '^\[RUN \]' "$log" || true
skips=$(grep -ac '\[SKIP\]' "$log" || true)
synth=$(grep -a 'Synthesis:' "$log" | tail -n 1 || true)
rm -f "$log"
if [ "$rc" != 0 ] || [ -z "$synth" ]; then
  echo "gpu_check: FAILED: cuda tests (exit $rc)"
  exit 1
fi
if [ "${skips:-0}" != 0 ]; then
  echo "gpu_check: FAILED: $skips cuda tests skipped on a machine meant to have a GPU"
  exit 1
fi

echo "== bench: $BUILD/bench/gpu_bench"
timeout 75 "$BUILD/bench/gpu_bench" || {
  echo "gpu_check: FAILED: gpu_bench"
  exit 1
}
echo "gpu_check: OK"
