#!/bin/sh
# bench/run.sh — every shardd benchmark, with the ratios that matter, in one
# run: `make bench` (short: a few minutes, most of it the end-to-end
# comparison with torch DDP) or `make bench FULL=1`.
#
# Each program prints a table and writes bench/results/<name>.json
# (BENCH_RESULTS overrides the folder); bench/summary.py then checks the
# targets (bench/summary.py) against the figures of this very run. Benchmarks are
# not tests: nothing here fails on a slow figure, only on a broken program.
# Run from the repository root after `make` (make bench builds first).
set -e
BUILD=${BUILD:-build}
case "${FULL:-0}" in ""|0) FULL=0 ;; *) FULL=1 ;; esac
BENCH_RESULTS=${BENCH_RESULTS:-bench/results}
export BUILD FULL BENCH_RESULTS
mkdir -p "$BENCH_RESULTS"
PY=${PYTHON:-/usr/bin/python3}
[ -x "$PY" ] || PY=$(command -v python3 || true)

if [ "$FULL" = 1 ]; then
  OPT_SIZES=262144,4194304,16777216,67108864
else
  OPT_SIZES=262144,16777216
fi

start=$(date +%s)
echo "shardd benchmarks ($( [ "$FULL" = 1 ] && echo full || echo short)) — $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) CPUs, $(date -u '+%Y-%m-%d %H:%M UTC')"
for b in rpc_bench coll_bench prefetch_bench optim_bench memory_bench ckpt_bench; do
  [ -x "$BUILD/bench/$b" ] || { echo "bench/run.sh: $BUILD/bench/$b is not built (run make bench)" >&2; exit 1; }
  "$BUILD/bench/$b"
done
# The peer, right after the kernel it is compared with.
if [ -n "$PY" ] && "$PY" -c 'import torch' 2>/dev/null; then
  "$PY" bench/torch_optim.py --sizes "$OPT_SIZES" --out "$BENCH_RESULTS/torch_optim.json"
else
  echo "(torch is not importable by ${PY:-python3}: no peer comparison; Debian: apt-get install python3-torch)"
  rm -f "$BENCH_RESULTS/torch_optim.json"
fi
"$BUILD/bench/registry_bench"
if [ -n "$PY" ] && "$PY" -c 'import torch' 2>/dev/null; then
  SHARDD_BIN="$BUILD/shardd" SHARDD_LIB="$BUILD/libshardd.so" "$PY" bench/fsdp_bench.py \
    $( [ "$FULL" = 1 ] && echo --repeat 3 )
  SHARDD_BIN="$BUILD/shardd" SHARDD_LIB="$BUILD/libshardd.so" "$PY" bench/model_memory_bench.py
  # end to end against torch DDP (gloo) and DDP + ZeroRedundancyOptimizer
  if "$PY" -c 'import torch.distributed as d; assert d.is_available() and d.is_gloo_available()' 2>/dev/null; then
    SHARDD_BIN="$BUILD/shardd" SHARDD_LIB="$BUILD/libshardd.so" "$PY" bench/ddp_bench.py \
      $( [ "$FULL" = 1 ] && echo --steps 10 --repeat 3 || echo --steps 4 )
  else
    echo "(torch.distributed with gloo is not available to $PY: no DDP comparison)"
    rm -f "$BENCH_RESULTS/ddp.json"
  fi
else
  rm -f "$BENCH_RESULTS/fsdp.json" "$BENCH_RESULTS/model_memory.json" "$BENCH_RESULTS/ddp.json"
fi
if [ -n "$PY" ]; then
  "$PY" bench/summary.py "$BENCH_RESULTS"
fi
echo "(all benchmarks: $(( $(date +%s) - start )) s)"
