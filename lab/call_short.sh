#!/usr/bin/env bash
# A short GPU call when device time is nearly spent (2026-12-06): the A/B stages of lab/call_stages.sh
# (FP8_ABLATE, TAKE_BACK, TRY_PATCH with TRY_TESTS), then this tree's GPU tests of TEST_FILES (8 workers).
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
t0=$(date +%s)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
. lab/call_stages.sh
ab_stages
if [ -n "${TEST_FILES:-}" ]; then
  OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout ${TEST_SECONDS:-100} python3 -m pytest -q -p no:cacheprovider \
    -p no:benchmark -n 8 -m gpu --timeout 90 $TEST_FILES > "$OUT/tests.txt" 2>&1
  echo "== tests exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "passed|failed|FAILED|ERROR" "$OUT/tests.txt" | tail -n 25
fi
echo "== done at $(( $(date +%s) - t0 )) s"
