#!/bin/sh
# Runs each libFuzzer binary given for FUZZ_SECONDS (make test: 30 when
# CI=true, else 15; make fuzz: 60) on a scratch copy of its seeds:
# tests/fuzz/corpus_NAME/ for fuzz_NAME, and tests/fuzz/corpus/ for
# fuzz_request. Prints each one's statistics, or
# the tail of its log and its crash artifact's name (copied to $BUILD/fuzz/);
# exits non-zero when any found something.
#
# Root's connections skip every per-uid bound (and CI runs as root), so
# run as root a fuzzer runs as FUZZ_UID (default: nobody's uid, 65534)
# through setpriv or runuser, where either is there: its requests then
# meet the per-uid bounds a user's do. fuzz_ranks stays root: it makes
# its connections as users itself (and as root beside them), which only
# root can. FUZZ_UID=0 keeps root's paths for all.
BUILD=${BUILD:-build}
secs=${FUZZ_SECONDS:-$([ "${CI:-}" = true ] && echo 30 || echo 15)}
fuzz_uid=${FUZZ_UID:-$(id -u nobody 2>/dev/null || echo 65534)}
rc=0
log=$(mktemp)
for bin in "$@"; do
  name=$(basename "$bin")
  seeds=tests/fuzz/corpus_${name#fuzz_}
  [ "$name" = fuzz_request ] && seeds=tests/fuzz/corpus
  corpus=$(mktemp -d)
  cp "$seeds"/* "$corpus"/
  mkdir "$corpus.art"
  as=""
  if [ "$(id -u)" = 0 ] && [ "$fuzz_uid" != 0 ] && [ "$name" != fuzz_ranks ]; then
    if command -v setpriv >/dev/null 2>&1; then
      as="setpriv --reuid=$fuzz_uid --regid=$fuzz_uid --clear-groups --"
    elif command -v runuser >/dev/null 2>&1; then
      as="runuser -u $(id -nu "$fuzz_uid") --"
    else
      echo "note: neither setpriv nor runuser: $name runs as root (no per-uid bounds)"
    fi
    # a checkout in a folder only root may enter (a CI runner's home, a
    # mktemp -d) cannot be run as another uid: root's paths then
    if [ -n "$as" ] && ! $as sh -c 'test -x "$1"' _ "$bin" 2>/dev/null; then
      echo "note: uid $fuzz_uid cannot run $bin (a folder above it is closed to it): $name runs as root (no per-uid bounds)"
      as=""
    fi
    [ -n "$as" ] && chown -R "$fuzz_uid:$fuzz_uid" "$corpus" "$corpus.art"
  fi
  echo "== $bin (${secs} s, uid $( [ -n "$as" ] && echo "$fuzz_uid" || id -u))"
  # the artifact lands where the fuzzer's uid may write, then in $BUILD/fuzz/
  if $as "$bin" -max_total_time="$secs" -max_len=4096 -rss_limit_mb=2048 \
      -artifact_prefix="$corpus.art/" -print_final_stats=1 "$corpus" >"$log" 2>&1; then
    grep -a "stat::number_of_executed_units\|stat::new_units_added" "$log"
  else
    tail -n 60 "$log"
    for a in "$corpus.art"/*; do
      [ -f "$a" ] || continue
      cp "$a" "$BUILD/fuzz/" && echo "artifact: $BUILD/fuzz/$(basename "$a")"
    done
    rc=1
  fi
  rm -rf "$corpus" "$corpus.art"
done
rm -f "$log"
exit $rc
