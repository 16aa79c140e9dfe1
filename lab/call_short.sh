#!/usr/bin/env bash
# A short GPU call when device time is nearly spent (2026-12-06): the A/B stages of lab/call_final.sh
# (FP8_ABLATE, TAKE_BACK on AB_ONLY), then the GPU tests of TEST_FILES (8 workers), each bounded.
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
t0=$(date +%s)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mk() { rm -rf exp/$1; mkdir -p exp/$1; cp -r kernels exp/$1/; (cd exp/$1 && patch -s ${3:-} -p1 < ../../lab/patches/$2); }
ab_trees() {
  timeout ${AB_SECONDS:-55} python3 lab/ab_hopper.py --exact --only "$2" --kernel-trees "$3" --rounds 2 > "$OUT/ab_$1.txt" 2>&1
  grep -E "^ab|^  prefill" "$OUT/ab_$1.txt" | cut -c1-150; echo "== A/B $1 ($3) at $(( $(date +%s) - t0 )) s"
}
if [ -n "${TAKE_BACK:-}" ]; then mk back "$TAKE_BACK" -R && ab_trees back "${AB_ONLY:-prefill_b4_l4096}" exp/back; fi
if [ -n "${FP8_ABLATE:-}" ]; then
  trees=""
  for a in $FP8_ABLATE; do mk f8$a 20261206-fp8-ablate-$a.patch && trees="$trees${trees:+,}exp/f8$a"; done
  ab_trees fp8 prefill_b4_l4096_fp8 "$trees"
fi
if [ -n "${TEST_FILES:-}" ]; then
  OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout ${TEST_SECONDS:-100} python3 -m pytest -q -p no:cacheprovider \
    -p no:benchmark -n 8 -m gpu --timeout 90 $TEST_FILES > "$OUT/tests.txt" 2>&1
  echo "== tests exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.txt" | tail -n 25
fi
echo "== done at $(( $(date +%s) - t0 )) s"
