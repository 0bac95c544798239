#!/bin/sh
# Runs every test binary given and the Python tests (beside each other),
# the checks of scripts/, then the fuzzers of FUZZ_BIN, and prints one
# closing line "tests: N passed, N failed, N skipped" summed from
# Criterion's per-binary synthesis lines. Exits non-zero on any failure.
# Run from the repository root (tests find build/ and tests/ from there).
BUILD=${BUILD:-build}
export SHARDD_BIN="$BUILD/shardd" SHARDCTL_BIN="$BUILD/shardctl" SHARDD_LIB="$BUILD/libshardd.so"
pass=0 fail=0 skip=0 bad=""
log=$(mktemp)
logs=$(mktemp -d)
# in_parallel N CMD ARG...: runs CMD ARG (CMD a shell line reading its
# argument as "$1") for each ARG, N at a time, into $logs/ARG.log and its
# exit status into $logs/ARG.rc (ARG's slashes made underscores).
in_parallel() {
  n=$1 cmd=$2
  shift 2
  [ $# -gt 0 ] || return 0
  printf '%s\n' "$@" | xargs -P "$n" -I{} sh -c \
    'f=$2/$(echo "$1" | tr / _); '"$cmd"' >"$f.log" 2>&1; echo $? >"$f.rc"' _ {} "$logs"
}
# took ARG: moves ARG's log (in_parallel) to $log; prints its exit status.
took() {
  f=$logs/$(echo "$1" | tr / _)
  mv "$f.log" "$log" 2>/dev/null || : >"$log"
  cat "$f.rc" 2>/dev/null || echo 127
}
# The Python tests run meanwhile, beside the binaries: both are mostly
# waiting (on rank processes, a peer's grace, a timeout, a daemon), not
# computing. Their output follows the binaries'.
py=""
if [ -d tests/python ] && [ -z "$SHARDD_NO_PYTHON" ]; then
  py=$(mktemp)
  /usr/bin/python3 tests/python/run.py >"$py" 2>&1 &
  pypid=$!
fi
# The binaries run SHARDD_TEST_JOBS at a time (default 3; each with
# Criterion's --jobs 2), the soak first (the longest); each one's log is
# printed whole, in the order given, once all have finished.
first=$(for t in "$@"; do case $t in */test_soak) echo "$t" ;; esac; done)
rest=$(for t in "$@"; do case $t in */test_soak) ;; *) echo "$t" ;; esac; done)
# shellcheck disable=SC2086
in_parallel "${SHARDD_TEST_JOBS:-3}" '"$1" --jobs 2 --verbose' $first $rest
for t in "$@"; do
  echo "== $t"
  rc=$(took "$t")
  # --verbose so skips are visible; the passing tests' own lines add nothing.
  grep -av '^\[RUN \]\|^\[PASS\]' "$log"
  line=$(grep -a "Synthesis:" "$log" | tail -n 1)
  # Synthesis: Tested: 5 | Passing: 5 | Failing: 0 | Crashing: 0
  p=$(echo "$line" | sed -n 's/.*Passing: \([0-9]*\).*/\1/p')
  f=$(echo "$line" | sed -n 's/.*Failing: \([0-9]*\).*/\1/p')
  c=$(echo "$line" | sed -n 's/.*Crashing: \([0-9]*\).*/\1/p')
  s=$(grep -ac "\[SKIP\]" "$log")
  pass=$((pass + ${p:-0}))
  fail=$((fail + ${f:-0}))
  skip=$((skip + ${s:-0}))
  if [ -z "$line" ] || [ "$rc" != 0 ] || [ "${f:-1}" != 0 ] || [ "${c:-1}" != 0 ]; then
    bad="$bad $t"
    [ -z "$line" ] && fail=$((fail + 1))
  fi
done
if [ -n "$py" ]; then
  echo "== tests/python"
  wait "$pypid"
  rc=$?
  mv "$py" "$log"
  cat "$log"
  line=$(grep -a "^python: " "$log" | tail -n 1)
  p=$(echo "$line" | sed -n 's/.* \([0-9]*\) passed.*/\1/p')
  f=$(echo "$line" | sed -n 's/.* \([0-9]*\) failed.*/\1/p')
  s=$(echo "$line" | sed -n 's/.* \([0-9]*\) skipped.*/\1/p')
  pass=$((pass + ${p:-0}))
  fail=$((fail + ${f:-0}))
  skip=$((skip + ${s:-0}))
  if [ -z "$line" ] || [ "$rc" != 0 ]; then
    bad="$bad tests/python"
    [ -z "$line" ] && fail=$((fail + 1))
  fi
fi
# A whole-tree check: one test, named for the summary line.
check() {
  name=$1 script=$2
  shift 2
  [ -f "$script" ] || return 0
  echo "== $script"
  if /usr/bin/python3 "$script" "$@"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    bad="$bad $name"
  fi
}
# The layering rule of ARCHITECTURE.md, over the sources and BUILD's objects.
check layers scripts/check_layers.py "$BUILD"
# No function over 150 lines in daemon/, client/, common/.
check functions scripts/check_functions.py
# The documentation's links and the docs/ pages the tree names lead somewhere.
check docs scripts/check_docs.py
# ... and that each check fails on what it is there to catch (each case one
# test).
for lt in tests/layers/test_*.py; do
  [ -f "$lt" ] || continue
  echo "== $lt"
  BUILD=$BUILD /usr/bin/python3 "$lt" -v >"$log" 2>&1
  rc=$?
  grep -av '\.\.\. ok$' "$log"
  p=$(grep -ac '\.\.\. ok$' "$log")
  f=$(grep -ac '\.\.\. \(FAIL\|ERROR\)$' "$log")
  s=$(grep -ac '\.\.\. skipped' "$log")
  pass=$((pass + p))
  fail=$((fail + f))
  skip=$((skip + s))
  if [ "$rc" != 0 ]; then
    bad="$bad $lt"
    [ "$f" = 0 ] && fail=$((fail + 1))
  fi
done
# FUZZ_BIN: the libFuzzer binaries, space-separated; each counts as one test.
# Two at a time: each is one process that computes all along.
fuzz=$(for fz in $FUZZ_BIN; do [ -x "$fz" ] && echo "$fz"; done)
# shellcheck disable=SC2086
in_parallel 2 'BUILD='"$BUILD"' sh scripts/run_fuzz.sh "$1"' $fuzz
for fz in $fuzz; do
  rc=$(took "$fz")
  cat "$log"
  if [ "$rc" = 0 ]; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    bad="$bad $(basename "$fz")"
  fi
done
rm -f "$log"
rm -rf "$logs"
echo
[ -n "$bad" ] && echo "failed:$bad"
echo "tests: $pass passed, $fail failed, $skip skipped"
[ -z "$bad" ]
