#!/usr/bin/env bash
# Every prefill on the wgmma family (2026-12-05), on an H200 in one run (about 4-5 minutes): its
# kernels compiled by the device's NVRTC (registers, spills, HGMMA in the SASS), the kernels the tests take warmed on every
# core, the GPU tests of fp8 prefill, the variants over fp8, head dims 96 / 192 and the soft-cap's
# forms, then the interleaved A/B of the tile choices (lab/ab_hopper.py), and, with FI=1, the bench
# cells of its table beside FlashInfer and cuDNN. Every step bounded by `timeout`.
# Usage, from the repository root: OUT=... bash lab/hopper_check.sh (written 2026-12-05)
# Knobs: TESTS (pytest files, default below), TEST_SECONDS (default 200), AB (1: the A/B, default 1),
# AB_ARGS, AB_SECONDS (default 150), FI (1: the bench cells with the peers; needs /work-fi.sh),
# BENCH_SECONDS (default 420), BENCH_CELLS, NCU (1: Nsight Compute on the soft-cap forms).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_FA_CACHE_DIR=${CUPY_FA_CACHE_DIR:-/tmp/cupy_fa_cache} CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
summary=$OUT/summary.txt; : > "$summary"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$summary"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; git log --oneline -1 2>/dev/null; } \
  2>&1 | tee -a "$summary"

# 1. the wgmma kernels through the device's NVRTC: registers, spills, and HGMMA / MUFU counts in SASS
stamp "sass"
timeout 120 python3 lab/sass_hopper.py > "$OUT/sass.txt" 2>&1; echo "sass exit $?" >> "$summary"
tail -n 1 "$OUT/sass.txt" >> "$summary"; grep "CHECK" "$OUT/sass.txt" | head -20 >> "$summary"

# 2. the kernels the tests take, into the disk cache on every core
stamp "warmup"
timeout 120 python3 -m cupy_fa warmup --fp8 --variants --quiet > "$OUT/warmup.txt" 2>&1
echo "warmup exit $?: $(tail -n 1 "$OUT/warmup.txt")" >> "$summary"

# 3. the GPU tests
TESTS=${TESTS:-"tests/test_prefill_sm90_gpu.py tests/test_fp8_prefill_gpu.py tests/test_fp8_variants_gpu.py tests/test_headdims_gpu.py tests/test_fp8_gpu.py tests/test_variants_gpu.py"}
if [ "$TESTS" != none ]; then
  stamp "tests: $TESTS"
  OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout ${TEST_SECONDS:-200} python3 -m pytest -v \
    -p no:cacheprovider -n 8 -m gpu --timeout 180 $TESTS -rs --durations=15 --junitxml="$OUT/junit.xml" \
    > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?: $(tail -n 1 "$OUT/pytest.log")" >> "$summary"
  grep -E "^(FAILED|ERROR)|Timeout" "$OUT/pytest.log" | head -30 >> "$summary"
  # the error lines the checks print (worst request / row errors), for the record
  grep -E "fp8 wgmma|tanh [02] cap|sm90 prefill" "$OUT/pytest.log" | grep -E "worst|max|err" | head -40 > "$OUT/errors.txt"
fi

# 4. the interleaved A/B of the tile choices (ours only, each point checked against float64 first)
if [ "${AB:-1}" = 1 ]; then
  stamp "ab"
  timeout ${AB_SECONDS:-150} python3 lab/ab_hopper.py ${AB_ARGS:---rounds 2} --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
  echo "ab exit $?" >> "$summary"; sed -n '/^means over rounds/,$p' "$OUT/ab.txt" >> "$summary"
fi

# 5. Nsight Compute: the plain and the soft-capped kernels' pipes and stalls
if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  stamp "ncu"
  timeout ${NCU_SECONDS:-120} ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats -k regex:prefill_sm90 -c ${NCU_COUNT:-6} \
    python3 lab/ab_hopper.py --once --exact --only ${NCU_ONLY:-prefill_b4_l4096,prefill_b4_l4096_cap50} \
    > "$OUT/ncu.txt" 2>&1
  echo "ncu exit $?" >> "$summary"
fi

# 6. the table: ours beside FlashInfer (its fp8-KV, soft-cap and head-dim prefill) and cuDNN
if [ "${FI:-0}" = 1 ]; then
  stamp "bench"
  [ -f /work-fi.sh ] && source /work-fi.sh
  BENCH_CELLS=${BENCH_CELLS:-"prefill_b4_l4096 prefill_b4_l4096_fp8 prefill_b2_l8192 prefill_b2_l8192_fp8 extend_b4_q1024_l16384 extend_b4_q1024_l16384_fp8 prefill_b4_l4096_cap50 prefill_b4_l4096_d96 prefill_b4_l4096_d192 prefill_b2_l8192_d64 prefill_b2_l8192_d256"}
  timeout ${BENCH_SECONDS:-420} python3 -m bench $BENCH_CELLS --page-size 16 --quick --no-plot --out "$OUT" \
    > "$OUT/bench.txt" 2>&1
  echo "bench exit $?" >> "$summary"; tail -n 30 "$OUT/bench.txt" >> "$summary"
fi
stamp "done"
