#!/bin/sh
# Runs each libFuzzer binary given for FUZZ_SECONDS (CI: 60, else 15) on a
# scratch copy of its seeds: tests/fuzz/corpus_NAME/ for fuzz_NAME, and
# tests/fuzz/corpus/ for fuzz_request. Prints each one's statistics, or
# the tail of its log and its crash artifact's name; exits non-zero when
# any found something.
BUILD=${BUILD:-build}
secs=${FUZZ_SECONDS:-$([ "${CI:-}" = true ] && echo 60 || echo 15)}
rc=0
log=$(mktemp)
for bin in "$@"; do
  name=$(basename "$bin")
  seeds=tests/fuzz/corpus_${name#fuzz_}
  [ "$name" = fuzz_request ] && seeds=tests/fuzz/corpus
  echo "== $bin (${secs} s)"
  corpus=$(mktemp -d)
  cp "$seeds"/* "$corpus"/
  if "$bin" -max_total_time="$secs" -max_len=4096 -rss_limit_mb=2048 \
      -artifact_prefix="$BUILD/fuzz/" -print_final_stats=1 "$corpus" >"$log" 2>&1; then
    grep -a "stat::number_of_executed_units\|stat::new_units_added" "$log"
  else
    tail -n 60 "$log"
    rc=1
  fi
  rm -rf "$corpus"
done
rm -f "$log"
exit $rc
