#!/usr/bin/env bash
# The attention variants (sliding window, logits soft-cap, attention sinks) on a GPU in one call,
# about 200 s on an H200: their GPU tests (every mode eager and graph, both kernel families,
# decode == verify, reads bounded by the window, the plan kernel against its model, the error
# rows), then their bench cells beside the plain ones, ours first, then beside FlashInfer where
# .fi/flashinfer.tar.xz is present (scripts/pack_flashinfer.sh). The summary is printed last.
# Usage, from the repository root: bash lab/variants_check.sh
# Knobs: TOTAL_SECONDS (default 200: the FlashInfer cells get what is left of it; FlashInfer
# JIT-compiles each variant's module on first use, tens of seconds each, so a cold machine needs
# about 400 for all of them), TEST_SECONDS (pytest, default 120), BENCH_SECONDS (our cells, default
# 70), CUPY_FA_SEED (replay a failure's seed, tests/cases.py), TESTS=none (skip the GPU tests: a run
# right after the whole suite). Logs under $OUT (or ./device_out). Some of the FlashInfer cells
# alone: lab/peers_check.sh (modules built first, then every cell timed in one process).
# Exit status 1 when a GPU test failed, errored or skipped, or our bench cells failed their check.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
t0=$(date +%s)
summary=$OUT/variants_summary.txt; : > "$summary"
failed=0

if [ -f .fi/flashinfer.tar.xz ]; then  # FlashInfer as an archive (as scripts/device_check.sh unpacks it)
  mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws && have_fi=1
else
  have_fi=0; echo "flashinfer: .fi/flashinfer.tar.xz absent: ours alone" >> "$summary"
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; } 2>&1 \
  | tee -a "$summary"

# 1. the kernels these tests run (head dims 64 / 128, plain and with the variant hooks) into the
#    disk cache, 8 processes, before the pytest workers (which would each compile them again)
python3 - <<'PY' 2>&1 | tee -a "$summary"
import time
from concurrent.futures import ProcessPoolExecutor

from cupy_fa import schedule

VARIANTS = list(dict.fromkeys(schedule.warmup_variants(head_dims=(64, 128), arch="sm_90a", variants=True)))


def one(i):
    from cupy_fa import _build

    _build.get_function(VARIANTS[i])


start = time.perf_counter()
with ProcessPoolExecutor(8) as pool:
    list(pool.map(one, range(len(VARIANTS))))
print(f"warm: {len(VARIANTS)} kernel variants compiled in {time.perf_counter() - start:.1f} s")
PY

# 2. the GPU tests of the variants (and the error rows, the plan model with a window)
if [ "${TESTS:-}" = none ]; then
  echo "GPU tests: skipped (TESTS=none)" >> "$summary"
else
start=$(date +%s)
OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout ${TEST_SECONDS:-120} python3 -m pytest -v \
  -p no:cacheprovider -p no:benchmark -n 8 -m gpu --timeout 110 -rs --durations=8 --junitxml="$OUT/variants_junit.xml" \
  tests/test_variants_gpu.py "tests/test_plan.py::test_device_plan_matches_model_with_a_window" \
  tests/test_errors_table.py -k "variant or window or sinks" \
  > "$OUT/variants_pytest.log" 2>&1
test_rc=$?
grep -E "^(FAILED|ERROR)|Timeout" "$OUT/variants_pytest.log" | head -20 >> "$summary"
echo "pytest: $(tail -n 1 "$OUT/variants_pytest.log") ($(( $(date +%s) - start )) s, exit $test_rc)" >> "$summary"
counts=$(python3 scripts/junit_counts.py "$OUT/variants_junit.xml")
read -r n_tests n_failed n_errors n_skipped _ <<< "$counts"
echo "GPU tests: $n_tests collected, $n_failed failed, $n_errors errors, $n_skipped skipped" >> "$summary"
if [ "$test_rc" != 0 ] || [ "$n_tests" -le 0 ] || [ "$n_failed" != 0 ] || [ "$n_errors" != 0 ] || [ "$n_skipped" != 0 ]; then
  echo "ERROR: the variants' GPU tests did not all pass (see $OUT/variants_pytest.log)" >> "$summary"; failed=1
  grep -E "^E  |rng seed|^FAILED" "$OUT/variants_pytest.log" | head -40 >> "$summary"
fi
fi

# 3. the bench cells: each variant beside the plain cell of its shape, page size 16
cells="decode_b64_l4096 decode_b64_l4096_w1024 decode_b64_l4096_cap50 decode_b64_l4096_sinks
       prefill_b4_l4096 prefill_b4_l4096_w1024 prefill_b4_l4096_cap50 prefill_b4_l4096_sinks
       decode_b1_l131072 decode_b1_l131072_w4096"
budget=${BENCH_SECONDS:-70}
start=$(date +%s)
timeout $(( budget + 30 )) python3 -m bench $cells --page-size 16 --quick --no-ceilings --no-plot --no-peers \
  --out "$OUT" --budget "$budget" > "$OUT/variants_bench_ours.log" 2>&1
bench_rc=$?
[ "$bench_rc" = 0 ] || { echo "ERROR: our bench cells failed a check or did not finish (exit $bench_rc)" >> "$summary"; failed=1; }
if [ "$have_fi" = 1 ]; then
  # FlashInfer JIT-compiles a module per variant on first use (tens of seconds each, cached under
  # /tmp/fiws while the machine stays up): the variant cells first, one module's cells per run, in
  # the time left; each cell's line is in the log as it finishes
  : > "$OUT/variants_bench_fi.log"
  for group in "decode_b64_l4096_w1024 decode_b1_l131072_w4096" decode_b64_l4096_cap50 decode_b64_l4096_sinks \
               prefill_b4_l4096_w1024 prefill_b4_l4096_cap50 prefill_b4_l4096_sinks \
               "decode_b64_l4096 decode_b1_l131072" prefill_b4_l4096; do
    left=$(( ${TOTAL_SECONDS:-200} - ($(date +%s) - t0) - 10 ))
    if [ "$left" -le 20 ]; then echo "bench beside FlashInfer: no time left for: $group" >> "$summary"; continue; fi
    start=$(date +%s)
    timeout "$left" python3 -m bench $group --page-size 16 --quick --no-ceilings --no-plot --out "$OUT" \
      >> "$OUT/variants_bench_fi.log" 2>&1
    echo "bench beside FlashInfer, $group: exit $? in $(( $(date +%s) - start )) s (124: cut at the time limit)" >> "$summary"
  done
fi

echo; echo "================ variants_check summary ($(( $(date +%s) - t0 )) s) ================"
cat "$summary"
echo "---- bench, ours (page size 16, --quick; each variant beside its plain cell) ----"
grep -E " ps=16: " "$OUT/variants_bench_ours.log" | sed 's/^\[[0-9:]*\] //' | cut -c1-200
sed -n '/^wrote .*json/,$p' "$OUT/variants_bench_ours.log" | grep -v "^wrote" | tail -n 25
if [ -f "$OUT/variants_bench_fi.log" ]; then
  echo "---- bench beside FlashInfer (the cells reached in the time left) ----"
  grep -E " ps=16: " "$OUT/variants_bench_fi.log" | sed 's/^\[[0-9:]*\] //' | cut -c1-420
fi
exit $failed
