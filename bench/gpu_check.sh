#!/bin/sh
# gpu_check.sh — on a machine with an NVIDIA GPU: run the cuda backend tests
# (which must run, not skip), the daemon end to end on the cuda backend
# against the host backend and the Python binding's cuda tests
# (tests/python/test_cuda.py, with torch), then print the achieved bandwidth
# of gather / scatter / step against a device-to-device cudaMemcpy measured
# in the same run (bench/gpu_bench.c). Bounded to 8 minutes at worst (build
# 2.5 when the packed binaries do not load, tests 2 + 1 + python 1.5, bench
# 1); a run with the pack and nothing stuck takes a small part of that.
#
# The binaries come from .gpu/ when bench/gpu_pack.sh made it on a
# development machine (a GPU machine without this project's Debian
# libraries, and no way to fetch them, needs that); otherwise, or when they
# do not load there, they are built here with -arch=sm_90, from .gpu/'s
# headers and libraries where the system has none.
#
#   sh bench/gpu_check.sh            (from the repository root or anywhere)
#   GPU_REBUILD=1 sh bench/gpu_check.sh       ignore .gpu/bin, build here
#   BUILD=build/gpu GPU_BENCH_MIB=256 GPU_BENCH_WORLD=4 sh bench/gpu_check.sh
# Full logs go to $GPU_LOGS (default: $OUT when set, else $BUILD).
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/gpu}
ARCH=${CUDA_ARCH:--arch=sm_90}
PACK=.gpu
JOBS=$(nproc 2>/dev/null || echo 4)
mkdir -p "$BUILD"
LOGS=${GPU_LOGS:-${OUT:-$BUILD}}
mkdir -p "$LOGS"

echo "== gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
[ -f "$PACK/PACKED" ] && sed 's/^/pack: /' "$PACK/PACKED"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
else
  echo "gpu_check: nvidia-smi not found (is an NVIDIA driver installed?)"
fi

# NCCL: the system's, else the one a Python wheel (nvidia-nccl-*) carries.
nccl_lib=""
for d in ${NCCL_HOME:+"$NCCL_HOME/lib" "$NCCL_HOME/lib64"} \
         /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
  if [ -e "$d/libnccl.so.2" ]; then nccl_lib=$d; break; fi
done
if [ -z "$nccl_lib" ]; then
  for py in python3 /opt/torch/.venv/bin/python3; do
    d=$("$py" -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null) || continue
    if [ -e "$d/libnccl.so.2" ]; then nccl_lib=$d; break; fi
  done
fi
if [ -z "$nccl_lib" ]; then
  f=$(find /opt /usr/local /usr/lib -name libnccl.so.2 2>/dev/null | head -n 1)
  [ -n "$f" ] && nccl_lib=$(dirname "$f")
fi
echo "nccl: ${nccl_lib:-not found}"
LD_LIBRARY_PATH="$PWD/$PACK/lib${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH

loads() { # every binary in $1 resolves all its libraries
  for f in "$1"/shardd "$1"/test_backend_cuda "$1"/test_server_cuda "$1"/gpu_bench; do
    [ -x "$f" ] || return 1
    if ldd "$f" | grep -q 'not found'; then
      ldd "$f" | grep 'not found' | sed "s|^|$f: |"
      return 1
    fi
  done
}

BIN=""
if [ -z "${GPU_REBUILD:-}" ] && [ -d "$PACK/bin" ]; then
  if loads "$PACK/bin"; then
    BIN=$PACK/bin
    echo "== using the packed binaries in $BIN"
  else
    echo "gpu_check: the packed binaries do not load here; building"
  fi
fi

if [ -z "$BIN" ]; then
  set -- CUDA=1 GLOO=0 CUDA_ARCH="$ARCH" BUILD="$BUILD"
  if [ -d "$PACK/include" ] && [ ! -f /usr/include/uv.h ]; then
    # this project's libraries from the pack; protobuf-c's generated
    # sources too (no protoc-c here), newer than the .proto so kept
    mkdir -p "$BUILD/gen"
    cp -r "$PACK/include/gen/proto" "$BUILD/gen/"
    touch "$BUILD/gen/proto/"*
    set -- "$@" PKG_CFLAGS="-I$PWD/$PACK/include" \
      PKG_LIBS="-L$PWD/$PACK/lib -Wl,-rpath,$PWD/$PACK/lib -luv -lprotobuf-c" \
      CLIENT_LIBS="-L$PWD/$PACK/lib -lprotobuf-c -lpthread -ldl"
  fi
  if [ -n "$nccl_lib" ]; then
    inc=$(dirname "$nccl_lib")/include
    mkdir -p "$BUILD/nccl"
    ln -sf "$nccl_lib/libnccl.so.2" "$BUILD/nccl/libnccl.so"
    set -- "$@" CFLAGS="-I$inc" LDFLAGS="-L$PWD/$BUILD/nccl -L$PWD/$PACK/lib"
  fi
  echo "== build: make $*"
  timeout 150 make -j"$JOBS" --no-print-directory "$@" all \
    "$BUILD/tests/test_backend_cuda" "$BUILD/tests/test_server_cuda" \
    "$BUILD/bench/gpu_bench" >"$LOGS/gpu_make.log" 2>&1 || {
    tail -n 40 "$LOGS/gpu_make.log"
    echo "gpu_check: FAILED: build (full log: $LOGS/gpu_make.log)"
    exit 1
  }
  mkdir -p "$BUILD/bin"
  for f in shardd shardctl tests/test_backend_cuda tests/test_server_cuda bench/gpu_bench; do
    cp "$BUILD/$f" "$BUILD/bin/"
  done
  BIN=$BUILD/bin
  loads "$BIN" || { echo "gpu_check: FAILED: built binaries do not load"; exit 1; }
fi
export SHARDD_BIN="$BIN/shardd" SHARDCTL_BIN="$BIN/shardctl"

status=0
run_tests() { # name, seconds
  log="$LOGS/$1.log"
  rc=0
  timeout "$2" "$BIN/$1" --jobs 1 --verbose >"$log" 2>&1 || rc=$?
  grep -av '^\[RUN \]' "$log" || true
  skips=$(grep -ac '\[SKIP\]' "$log" || true)
  synth=$(grep -a 'Synthesis:' "$log" | tail -n 1 || true)
  if [ "$rc" != 0 ] || [ -z "$synth" ]; then
    echo "gpu_check: FAILED: $1 (exit $rc; log $log)"
    status=1
  elif [ "$1" = test_backend_cuda ] && [ "${skips:-0}" != 0 ]; then
    echo "gpu_check: FAILED: $skips cuda tests skipped on a machine meant to have a GPU"
    status=1
  fi
}
echo "== tests: $BIN/test_backend_cuda"
run_tests test_backend_cuda 120
echo "== tests: $BIN/test_server_cuda (daemon --backend cuda vs host)"
run_tests test_server_cuda 60

# The Python binding and shardd.nn on the cuda daemon (tests/python/test_cuda.py)
# with the python3 that holds torch here ($GPU_PYTHON to name another). Its
# CudaTest must run, not skip; ArrayInterfaceTest runs anywhere. libshardd.so
# is in $BIN when packed, else in $BUILD.
py=${GPU_PYTHON:-python3}
pylib=$BIN/libshardd.so
[ -f "$pylib" ] || pylib=$BUILD/libshardd.so
pylog="$LOGS/python_cuda.log"
echo "== tests: tests/python/test_cuda.py ($py, $pylib)"
rc=0
SHARDD_LIB="$pylib" PYTHONUNBUFFERED=1 timeout 90 "$py" tests/python/run.py -v \
  test_cuda.CudaTest. test_cuda.ArrayInterfaceTest. >"$pylog" 2>&1 || rc=$?
tail -n 40 "$pylog"
line=$(grep -a '^python: ' "$pylog" | tail -n 1)
p=$(echo "$line" | sed -n 's/.* \([0-9]*\) passed.*/\1/p')
s=$(echo "$line" | sed -n 's/.* \([0-9]*\) skipped.*/\1/p')
if [ "$rc" != 0 ] || [ -z "$line" ]; then
  echo "gpu_check: FAILED: python cuda tests (exit $rc; log $pylog)"
  status=1
elif [ "${p:-0}" = 0 ] || [ "${s:-1}" != 0 ]; then
  echo "gpu_check: FAILED: python cuda tests: ${s:-?} skipped, ${p:-0} passed on a machine meant to have a GPU (log $pylog)"
  status=1
fi

echo "== bench: $BIN/gpu_bench"
rc=0
timeout 60 "$BIN/gpu_bench" >"$LOGS/gpu_bench.log" 2>&1 || rc=$?
cat "$LOGS/gpu_bench.log"
if [ "$rc" != 0 ]; then
  echo "gpu_check: FAILED: gpu_bench (exit $rc)"
  status=1
fi
[ "$status" = 0 ] && echo "gpu_check: OK" || echo "gpu_check: FAILED"
exit "$status"
