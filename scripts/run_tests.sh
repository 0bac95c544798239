#!/bin/sh
# Runs every test binary given, then the Python tests, and prints one
# closing line "tests: N passed, N failed, N skipped" summed from
# Criterion's per-binary synthesis lines. Exits non-zero on any failure.
# Run from the repository root (tests find build/ and tests/ from there).
BUILD=${BUILD:-build}
export SHARDD_BIN="$BUILD/shardd" SHARDCTL_BIN="$BUILD/shardctl" SHARDD_LIB="$BUILD/libshardd.so"
pass=0 fail=0 skip=0 bad=""
log=$(mktemp)
for t in "$@"; do
  echo "== $t"
  "$t" --jobs 2 --verbose >"$log" 2>&1
  rc=$?
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
if [ -d tests/python ] && [ -z "$SHARDD_NO_PYTHON" ]; then
  echo "== tests/python"
  /usr/bin/python3 tests/python/run.py >"$log" 2>&1
  rc=$?
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
# The layering rule of ARCHITECTURE.md, over the sources and BUILD's
# objects: one test.
if [ -f scripts/check_layers.py ]; then
  echo "== scripts/check_layers.py"
  if /usr/bin/python3 scripts/check_layers.py "$BUILD"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    bad="$bad layers"
  fi
fi
# No function over 150 lines in daemon/, client/, common/: one test.
if [ -f scripts/check_functions.py ]; then
  echo "== scripts/check_functions.py"
  if /usr/bin/python3 scripts/check_functions.py; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    bad="$bad functions"
  fi
fi
# The documentation's links and the docs/ pages the tree names lead
# somewhere: one test.
if [ -f scripts/check_docs.py ]; then
  echo "== scripts/check_docs.py"
  if /usr/bin/python3 scripts/check_docs.py; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    bad="$bad docs"
  fi
fi
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
for fz in $FUZZ_BIN; do
  [ -x "$fz" ] || continue
  if BUILD=$BUILD sh scripts/run_fuzz.sh "$fz"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    bad="$bad $(basename "$fz")"
  fi
done
rm -f "$log"
echo
[ -n "$bad" ] && echo "failed:$bad"
echo "tests: $pass passed, $fail failed, $skip skipped"
[ -z "$bad" ]
