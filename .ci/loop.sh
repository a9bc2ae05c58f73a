#!/usr/bin/env bash
# Issue 20's stability check: N fresh-clone CI runs back to back (default 10), one line per run.
#   bash .ci/loop.sh [N] [LOG]      (LOG default: /tmp/ci-loop.txt; touch LOG.stop to end after the current run)
# Each run clones this checkout's HEAD into a scratch directory with ../shared beside it and runs .ci/run there,
# exactly as CI does.  Keep the machine otherwise idle: the times are the measurement.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
shared=$(cd "$repo/../shared" && pwd)
n=${1:-10}
log=${2:-/tmp/ci-loop.txt}
scratch=$(mktemp -d /tmp/ci-loop.XXXXXX)
for i in $(seq 1 "$n"); do
  rm -rf "$scratch/main" "$scratch/shared"
  ln -s "$shared" "$scratch/shared"
  git clone -q "$repo" "$scratch/main"
  head=$(git -C "$scratch/main" rev-parse --short HEAD)
  start=$(date +%s)
  (cd "$scratch/main" && bash .ci/run > "$scratch/run-$i.log" 2>&1)
  rc=$?
  echo "run $i head $head rc $rc secs $(( $(date +%s) - start )) $(tail -1 "$scratch/run-$i.log")" | tee -a "$log"
  [ -f "$log.stop" ] && break
done
