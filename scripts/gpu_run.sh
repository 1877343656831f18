#!/usr/bin/env bash
# One device call: setup, then the given steps; everything written to $OUT/ (results as one tarball).
# usage (device tool, carry [".device"]): source .device/setup.sh && bash scripts/gpu_run.sh "STEP" ["STEP" ...]
set -uo pipefail
export PDL_TUNE_GIT_REV=$(cat .device/rev 2>/dev/null || echo unknown)
mkdir -p "$OUT"
touch "$OUT/.start"  # (only what the steps write under results/ comes back: the files are limited to 16 MiB each)
for step in "$@"; do
  echo "=== $step" | tee -a "$OUT/log.txt"
  start=$(date +%s)
  bash -c "$step" 2>&1 | tee -a "$OUT/log.txt"
  echo "=== rc=${PIPESTATUS[0]} in $(( $(date +%s) - start ))s: $step" | tee -a "$OUT/log.txt"
  find results -type f -newer "$OUT/.start" -print0 | tar czf "$OUT/results.tgz" --null -T - 2>/dev/null
done
