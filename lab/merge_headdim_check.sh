#!/usr/bin/env bash
# The device check of merge_states, the cascade example and head dims 96 / 192 (2026-12-01),
# in one call of at most CHECK_SECONDS (default 150), from the repository root on a GPU machine:
#   bash lab/merge_headdim_check.sh
# 1. the kernels these checks use into the disk cache (8 processes);
# 2. their GPU tests, -n 8: tests/test_merge_states_gpu.py (merge_states against float64 and
#    against attention over the concatenated keys, in place, in a graph, its errors, the cascade
#    example) and tests/test_headdims_gpu.py (head dims 96 / 192 in every mode, eager and graph,
#    page sizes 1 and 16, decode == verify bits); any failure, error or skip fails the call;
# 3. examples/cascade_shared_prefix.py as a user runs it;
# 4. the bench cells at head dims 96 / 192 (decode B=64 L=4096, prefill B=4 L=4096, page size 16):
#    ours beside SDPA, then beside FlashInfer too when .fi/flashinfer.tar.xz is present
#    (scripts/pack_flashinfer.sh), in the time left (FlashInfer compiles each new head dim's
#    kernel on first use: cells past the time left are named as skipped; BENCH_WORKLOADS picks
#    the cells, CHECK_SECONDS=400 gives them all their time).
# Logs go under $OUT (or ./device_out); the summary is printed last; exit 1 when a check failed.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
t0=$(date +%s); limit=${CHECK_SECONDS:-150}
left() { echo $(( limit - ($(date +%s) - t0) )); }
summary=$OUT/summary.txt; : > "$summary"
failed=0

if [ -f .fi/flashinfer.tar.xz ]; then  # FlashInfer as an archive (scripts/pack_flashinfer.sh)
  mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws
else
  echo "flashinfer: .fi/flashinfer.tar.xz absent: the bench runs without it" >> "$summary"
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"; } 2>&1 | tee -a "$summary"

# 1. compile (or load) the variants of the head dims the checks use, before the test workers start
start=$(date +%s)
python3 scripts/warm_cache.py 8 --head-dims 96,128,192 --hooks-for 96,192 --no-fp8 > "$OUT/warm.log" 2>&1 || failed=1
echo "warm: $(tail -n 1 "$OUT/warm.log") ($(( $(date +%s) - start )) s)" >> "$summary"

# 2. the GPU tests
start=$(date +%s)
export CUPY_FA_REPORT=/tmp/modes_21b.jsonl; : > "$CUPY_FA_REPORT"
export CUPY_FA_FAILURE_LOG=$OUT/failures.log; : > "$CUPY_FA_FAILURE_LOG"
tests="tests/test_merge_states_gpu.py"
[ -f tests/test_headdims_gpu.py ] && tests="$tests tests/test_headdims_gpu.py"
OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout $(( $(left) - 25 )) python3 -m pytest -v \
  -p no:cacheprovider -n 8 -m gpu --timeout 100 $tests -rs --durations=8 --junitxml="$OUT/junit.xml" \
  > "$OUT/pytest.log" 2>&1
rc=$?
grep -E "FAILED|ERROR|Timeout|SKIPPED" "$OUT/pytest.log" | head -20 >> "$summary"
[ -s "$CUPY_FA_FAILURE_LOG" ] && { echo "failure reasons:"; grep -A4 "^====" "$CUPY_FA_FAILURE_LOG" | head -40; } >> "$summary"
counts=$(python3 scripts/junit_counts.py "$OUT/junit.xml")
read -r n_tests n_failed n_errors n_skipped _ <<< "$counts"
echo "GPU tests: $n_tests collected, $n_failed failed, $n_errors errors, $n_skipped skipped, pytest exit $rc ($(( $(date +%s) - start )) s)" >> "$summary"
if [ "$rc" != 0 ] || [ "$n_tests" -le 0 ] || [ "$n_failed" != 0 ] || [ "$n_errors" != 0 ] || [ "$n_skipped" != 0 ]; then
  echo "ERROR: the GPU tests did not all pass (a skip counts: on a GPU machine none may)" >> "$summary"; failed=1
fi
grep -E "^(merged halves|seed [0-9]+: rel|cascade:|relative error)" "$OUT/pytest.log" | head -12 >> "$summary" || true
[ -s "$CUPY_FA_REPORT" ] && python3 scripts/modes_table.py "$CUPY_FA_REPORT" >> "$summary" 2>&1

# 3. the cascade example, as a user runs it
start=$(date +%s)
for args in "" "--dtype fp16 --page-size 1 --prefix 3000 --requests 32"; do
  timeout 40 python3 examples/cascade_shared_prefix.py $args > "$OUT/cascade.log" 2>&1; rc=$?
  { echo "example cascade_shared_prefix.py $args (exit $rc):"; grep -E "^(cascade|prefix|relative|seed)" "$OUT/cascade.log"; } >> "$summary"
  [ "$rc" = 0 ] || failed=1
done
echo "example: $(( $(date +%s) - start )) s" >> "$summary"

# 4. the bench cells at the new head dims: ours and SDPA first (every cell), then beside FlashInfer in
# the time left (it compiles a kernel per new head dim on first use, tens of seconds each)
cells=${BENCH_WORKLOADS:-decode_b64_l4096_d96 decode_b64_l4096_d192 prefill_b4_l4096_d96 prefill_b4_l4096_d192}
bench_stage() {  # $1: a title, $2: extra bench flags; the cell lines into the summary
  local budget=$(( $(left) - 8 ))
  if [ "$budget" -le 15 ]; then echo "bench $1: no time left ($budget s)" >> "$summary"; return; fi
  timeout $budget python3 -m bench $cells --page-size 16 --quick --no-ceilings --no-plot $2 \
    --budget $(( budget - 12 )) --out "$OUT" > "$OUT/bench_$1.log" 2>&1
  local rc=$?
  { echo "bench $1 (exit $rc; $budget s):"; grep -E "ps=16: |^skipped|^FAIL|flashinfer:" "$OUT/bench_$1.log" \
      | sed -E 's/^\[[0-9:]+\] //'; } >> "$summary"
  [ "$rc" = 0 ] || [ "$rc" = 124 ] || failed=1  # 124: cut at the call's limit (the cells done are listed)
}
bench_stage ours_sdpa --no-flashinfer
if [ -f .fi/flashinfer.tar.xz ]; then bench_stage flashinfer ""; fi

echo "total: $(( $(date +%s) - t0 )) s of $limit" >> "$summary"
echo; echo "================ merge_headdim_check summary ================"; cat "$summary"
exit $failed
