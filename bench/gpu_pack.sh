#!/bin/sh
# gpu_pack.sh — prepares, on a development machine, what bench/gpu_check.sh
# needs on a GPU machine that has CUDA but none of this project's Debian
# libraries and cannot fetch any: the cuda build (sm_90) of the daemon, its
# cuda tests and gpu_bench, plus the shared libraries they load that are not
# part of every Linux system or of CUDA (libuv, protobuf-c, Criterion and
# what Criterion pulls in), all under .gpu/ (ignored by git):
#
#   .gpu/bin/     shardd shardctl test_backend_cuda test_server_cuda gpu_bench
#   .gpu/lib/     the libraries, with libfoo.so links for building there
#   .gpu/include/ their headers and the generated protobuf-c sources, so
#                 gpu_check.sh can rebuild there if the binaries do not load
#
# libcudart and libnccl are not packed: gpu_check.sh finds the GPU
# machine's own (NCCL is 200+ MB). Then, from the repository root:
#
#   sh bench/gpu_pack.sh
#   device run, carry [".gpu"], command: sh bench/gpu_check.sh
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/gpu}
ARCH=${CUDA_ARCH:--arch=sm_90}
PACK=.gpu
JOBS=$(nproc 2>/dev/null || echo 2)

# Gloo is left out (not on the GPU machine, and gpu_check runs one node);
# benches get a baseline x86-64 target, not this CPU's.
make -j"$JOBS" --no-print-directory CUDA=1 GLOO=0 CUDA_ARCH="$ARCH" \
  BENCH_MARCH=-march=x86-64-v2 BUILD="$BUILD" all \
  "$BUILD/tests/test_backend_cuda" "$BUILD/tests/test_server_cuda" \
  "$BUILD/bench/gpu_bench"

rm -rf "$PACK"
mkdir -p "$PACK/bin" "$PACK/lib" "$PACK/include"
for f in shardd shardctl libshardd.so tests/test_backend_cuda \
         tests/test_server_cuda bench/gpu_bench; do
  cp "$BUILD/$f" "$PACK/bin/"
done

# Every library the binaries load except the C library's own, the compiler
# runtime and CUDA's: those the GPU machine has (newer, if anything).
skip='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libresolv|libutil|libstdc\+\+|libgcc_s|libcudart|libnccl|libcuda)\.'
for f in "$PACK"/bin/*; do
  ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r name path; do
  if echo "$name" | grep -Eq "$skip"; then continue; fi
  cp -L "$path" "$PACK/lib/$name"
done
# libfoo.so for -lfoo, should gpu_check.sh have to link there
for l in libuv libprotobuf-c libcriterion; do
  so=$(ls "$PACK/lib/$l.so."* 2>/dev/null | head -n 1)
  [ -n "$so" ] && ln -sf "$(basename "$so")" "$PACK/lib/$l.so"
done

cp -r /usr/include/uv.h /usr/include/uv /usr/include/protobuf-c \
  /usr/include/criterion "$PACK/include/"
mkdir -p "$PACK/include/gen"
cp -r "$BUILD/gen/proto" "$PACK/include/gen/"

{
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) with $ARCH on $(uname -m)"
} >"$PACK/PACKED"
du -sh "$PACK"
echo "gpu_pack: $PACK ready; carry it and run: sh bench/gpu_check.sh"
