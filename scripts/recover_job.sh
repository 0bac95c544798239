#!/bin/sh
# recover_job.sh — brings a multi-node job back from its last collective
# checkpoint after one node's daemon died without writing its part
# (kill -9, the OOM killer, a crash, power loss): docs/multi-node.md,
# "A node's daemon killed". Run it on EVERY node of the job, once that
# node's trainers of the job are stopped (and the dead node's daemon is
# running again), then relaunch the trainers everywhere: they resume at the
# checkpoint's step.
#
#   scripts/recover_job.sh [--socket PATH] [--wait SEC] JOB CHECKPOINT_DIR
#
# On each node it
#   1. releases JOB (`shardctl release`). A survivor refuses while the
#      job's retried collective still waits for the dead node; that wait is
#      abandoned --peer-grace (default 1 s) after the node's last trainer
#      left, so the release is retried every 0.2 s for up to --wait seconds
#      (default 10). A daemon that does not hold JOB (the restarted one)
#      has nothing to release.
#   2. restores CHECKPOINT_DIR (`shardctl restore`), the job's collective
#      checkpoint (sm.checkpoint, the same directory on every node): this
#      node's part, after checking every node's part against the job
#      manifest.
# Exit status: 0 restored; 1 a step failed (shardctl's message on stderr);
# 2 usage. shardctl is $SHARDCTL, else shardctl on PATH.
set -u
SHARDCTL=${SHARDCTL:-shardctl}
sock=
wait_s=10
while [ $# -gt 0 ]; do
  case "$1" in
    --socket) [ $# -ge 2 ] || { echo "recover_job.sh: --socket needs a path" >&2; exit 2; }
              sock=$2; shift 2 ;;
    --wait)   [ $# -ge 2 ] || { echo "recover_job.sh: --wait needs seconds" >&2; exit 2; }
              wait_s=$2; shift 2 ;;
    --help|-h) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --*) echo "recover_job.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -ne 2 ]; then
  echo "usage: recover_job.sh [--socket PATH] [--wait SEC] JOB CHECKPOINT_DIR" >&2
  exit 2
fi
job=$1
dir=$2
ctl() {
  if [ -n "$sock" ]; then "$SHARDCTL" --socket "$sock" "$@"; else "$SHARDCTL" "$@"; fi
}

# 1. release, retried while the job is busy (its abandoned wait ending)
start=$(date +%s.%N)
tries=0
while :; do
  tries=$((tries + 1))
  if out=$(ctl release "$job" 2>&1); then
    echo "recover_job.sh: $out"
    break
  fi
  case "$out" in
    *E_NOT_FOUND*)
      echo "recover_job.sh: no job \"$job\" here to release (a restarted daemon)"
      break ;;
    *E_BUSY*)
      now=$(date +%s.%N)
      if awk -v a="$start" -v b="$now" -v w="$wait_s" 'BEGIN { exit !(b - a >= w) }'; then
        echo "recover_job.sh: job \"$job\" still refuses its release after ${wait_s} s: $out" >&2
        echo "recover_job.sh: are this node's trainers of it all stopped? (shardctl status)" >&2
        exit 1
      fi
      sleep 0.2 ;;
    *)
      echo "recover_job.sh: release of \"$job\" failed: $out" >&2
      exit 1 ;;
  esac
done

# 2. restore this node's part of the collective checkpoint
if ! out=$(ctl restore "$dir" 2>&1); then
  echo "recover_job.sh: restore of $dir failed: $out" >&2
  exit 1
fi
echo "recover_job.sh: restored $out"
echo "recover_job.sh: relaunch the job's trainers on every node once every node is restored"
exit 0
