#!/usr/bin/env bash
# The fp8 (e4m3fn) KV cache's GPU check in one call, on a GPU machine, from the repository root:
#   bash lab/fp8_check.sh
# 1. the kernels a step over an fp8 or a 16-bit cache can select into the disk cache
#    (lab/warm_fp8.py, 16 processes; the rest compile at first use); with
#    .fi/flashinfer.tar.xz present (scripts/pack_flashinfer.sh) FlashInfer is unpacked as in
#    scripts/device_check.sh and its bf16 and fp8 decode wrappers JIT-compile in the background
#    (python -m bench.fp8 --warm-peers) while the tests run;
# 2. the fp8 GPU tests, tests/test_fp8_gpu.py, 8 workers (append bit for bit, attention against
#    float64 on the dequantised cache in every mode eager and replayed, decode == verify, the
#    refusals, torch fp8 tensors), and the table of fp8's error against the 16-bit cache per mode;
# 3. python -m bench.fp8 --ab: decode B=64 L=4096 (ours bf16, ours fp8 per-head / per-tensor scales,
#    FlashInfer bf16 and fp8 when it imports) against the read ceiling it measures, and prefill
#    B=4 L=4096 over the fp8 cache beside the bf16 one; then (--ab, tuning only, last so a cut
#    keeps the rest) the fp8 decode tile at 64 / 128 keys per KV tile, depths 2 to 4, folded or not.
# It keeps within FP8_CHECK_SECONDS (default 195; pytest gets TEST_SECONDS, default 110), writes its
# logs under $OUT (or ./device_out) and prints the summary last. Exit 1 when a test failed, errored
# or skipped (on a GPU machine a skip is a broken setup) or when the counts are missing.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
t0=$(date +%s); limit=${FP8_CHECK_SECONDS:-195}
summary=$OUT/fp8_summary.txt; : > "$summary"
failed=0
elapsed() { echo $(( $(date +%s) - t0 )); }

peers=--no-peers
if [ -f .fi/flashinfer.tar.xz ]; then
  mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws && peers=
else
  echo "flashinfer: .fi/flashinfer.tar.xz absent: the bench runs without it" >> "$summary"
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c 'import cupy, numpy, torch; print("cupy", cupy.__version__, "numpy", numpy.__version__, "torch", torch.__version__)'
  git log -1 --format='tree: %h %s' 2>/dev/null | cut -c1-120
} 2>&1 | tee -a "$summary"

timeout 60 python3 lab/warm_fp8.py 16 2>&1 | tail -n 1 | sed "s/^/warm: /" >> "$summary"
echo "warm done at $(elapsed) s" >> "$summary"
fi_pid=
if [ -z "$peers" ]; then  # FlashInfer's JIT compile of its two decode wrappers, beside the tests
  timeout 150 python3 -m bench.fp8 --warm-peers > "$OUT/fp8_fi_warm.log" 2>&1 &
  fi_pid=$!
fi

export CUPY_FA_FP8_REPORT=/tmp/fp8_modes.jsonl; : > "$CUPY_FA_FP8_REPORT"
export CUPY_FA_FAILURE_LOG=$OUT/fp8_failures.log; : > "$CUPY_FA_FAILURE_LOG"
start=$(date +%s)
OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout ${TEST_SECONDS:-110} \
  python3 -m pytest -v -p no:cacheprovider -p no:benchmark -n 8 -m gpu --timeout 100 tests/test_fp8_gpu.py \
  -rs --durations=8 --junitxml="$OUT/fp8_junit.xml" > "$OUT/fp8_pytest.log" 2>&1
test_rc=$?
grep -E "FAILED|ERROR|Timeout" "$OUT/fp8_pytest.log" | head -20 >> "$summary"
[ -s "$CUPY_FA_FAILURE_LOG" ] && { echo "failure reasons (first lines each):"; grep -A6 "^====" "$CUPY_FA_FAILURE_LOG" | head -60; } >> "$summary"
echo "pytest: $(tail -n 1 "$OUT/fp8_pytest.log") ($(( $(date +%s) - start )) s)" >> "$summary"
read -r n_tests n_failed n_errors n_skipped _ <<< "$(python3 scripts/junit_counts.py "$OUT/fp8_junit.xml")"
echo "fp8 GPU tests: $n_tests collected, $n_failed failed, $n_errors errors, $n_skipped skipped" >> "$summary"
if [ "$n_tests" = -1 ] || [ "$test_rc" != 0 ] || [ "$n_failed" != 0 ] || [ "$n_errors" != 0 ] || [ "$n_skipped" != 0 ] \
   || [ "$n_tests" -le 0 ]; then
  echo "ERROR: the fp8 GPU tests did not all pass (pytest exit $test_rc)" >> "$summary"; failed=1
fi
python3 scripts/fp8_modes_table.py "$CUPY_FA_FP8_REPORT" >> "$summary"

if [ -n "$fi_pid" ]; then  # the JIT compile must be done (or given up) before anything is timed
  wait "$fi_pid"; echo "flashinfer warm (exit $?, done at $(elapsed) s): $(tail -n 2 "$OUT/fp8_fi_warm.log" | tr '\n' ' ' | cut -c1-400)" >> "$summary"
fi
left=$(( limit - $(elapsed) - 5 ))
if [ "$left" -gt 20 ]; then
  timeout "$left" python3 -m bench.fp8 $peers --ab --json "$OUT/fp8_bench.json" > "$OUT/fp8_bench.log" 2>&1
  bench_rc=$?
  { echo "bench.fp8 (exit $bench_rc, $(elapsed) s in):"; grep -E "^read ceiling|^decode|^prefill|^A/B|^  " "$OUT/fp8_bench.log"
    [ "$bench_rc" = 0 ] || tail -n 15 "$OUT/fp8_bench.log"; } >> "$summary"
  [ "$bench_rc" = 124 ] && echo "bench.fp8: cut at the time limit (the lines above are what it measured)" >> "$summary"
else
  echo "bench.fp8: skipped, only $left s left" >> "$summary"
fi
echo; echo "================ fp8_check summary ($(elapsed) s) ================"; cat "$summary"
exit $failed
