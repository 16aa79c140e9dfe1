#!/usr/bin/env bash
# The GPU check of a kernel or host restructure against an older tree, in one call (~8 minutes):
#   1. both trees' kernels compiled into one disk cache (in parallel);
#   2. outputs and LSE of both trees bit for bit on every bench shape and a random grid
#      (scripts/compare_trees.py), schedules compared too;
#   3. the GPU test suite of this tree (scripts/device_check.sh tests);
#   4. an interleaved A/B of the two trees, ours only (scripts/ab_trees.sh, ROUNDS=2).
# Usage on the device machine, from the repo root: bash lab/device_compare.sh OLD_TREE
# OLD_TREE holds the old revision (cupy_fa/, kernels/, bench/), made before the call with
#   mkdir -p exp/base && git archive REV | tar -x -C exp/base      (untracked: it travels with the tree)
# Knobs: COMPARE_SECONDS (150), TEST_SECONDS (200), AB_BUDGET (seconds of cells per bench run, 40),
# AB_WORKLOADS (the bench's decode-like workloads and prefill_b4_l4096), GRID (random cases, 20).
# Logs under $OUT (or ./device_out); the summary is printed last.
set -uo pipefail
old=${1:?usage: device_compare.sh OLD_TREE}
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
summary=$OUT/compare_summary.txt; : > "$summary"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$summary"; }

stamp "warming both trees' kernels"
(PYTHONPATH=$old python3 scripts/warm_cache.py 8 > "$OUT/warm_old.log" 2>&1 &
 python3 scripts/warm_cache.py 8 > "$OUT/warm_new.log" 2>&1; wait)
tail -n 1 "$OUT/warm_old.log" "$OUT/warm_new.log" >> "$summary"

stamp "compare_trees $old ."
timeout ${COMPARE_SECONDS:-150} python3 scripts/compare_trees.py "$old" --grid ${GRID:-20} --out /tmp/compare_trees \
  > "$OUT/compare_trees.txt" 2>&1; echo "compare_trees exit $?" >> "$summary"
cp /tmp/compare_trees/*.log "$OUT/" 2>/dev/null
grep -E "differ|shape!|ERROR|CHANGED|NaN|cases:|exited|^old:|^new:" "$OUT/compare_trees.txt" | tail -n 40 >> "$summary"

stamp "GPU tests"
TEST_SECONDS=${TEST_SECONDS:-200} CHECK_SECONDS=300 OUT=$OUT bash scripts/device_check.sh tests > "$OUT/device_check.log" 2>&1
sed -n '/^================ device_check summary/,$p' "$OUT/device_check.log" | grep -E "pytest:|FAILED|ERROR|Timeout|failure" >> "$summary"

stamp "A/B $old against ."
work=${AB_WORKLOADS:-"decode_b64_l4096 decode_b16_l32768 decode_b1_l131072 decode_b1_l4096 decode_b32_l4096 verify_q4_b64_l4096 verify_q8_b64_l4096 draft_extend_q4_b64_l4096 prefill_b4_l4096"}
ROUNDS=2 bash scripts/ab_trees.sh "$old ." $work --budget ${AB_BUDGET:-40} > "$OUT/ab_trees.txt" 2>&1
cat "$OUT/ab_trees.txt" >> "$summary"
stamp "done"
echo; echo "================ device_compare summary ================"; cat "$summary"
