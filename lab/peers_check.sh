#!/usr/bin/env bash
# Bench cells beside FlashInfer (and SDPA cuDNN) in one GPU run, with FlashInfer's JIT builds
# kept off the timed runs: first each warm-up wave (`;`-separated in WARM) builds the FlashInfer
# modules of its cells, one process per cell, the cells of a wave at the same time, the waves in
# turn (each cell also runs once, 4 launches x 2 replays, which writes FlashInfer's module to its
# disk cache); then ONE process times every cell of CELLS in order, alone on the machine, with the
# modules built. The summary table is printed last.
#
# Cost (H200, FlashInfer 0.7.4, 2026-12-02): a prefill module about 110 s to build alone; thirteen
# builds at once, or five beside a test suite, did not finish in 330-400 s. Two or three per wave.
#
# Usage on the device machine, from the repository root (FlashInfer from .fi/flashinfer.tar.xz,
# scripts/pack_flashinfer.sh):
#   WARM="prefill_b4_l4096_cap50 prefill_b4_l4096_sinks;prefill_b4_l4096 prefill_b2_l8192_fp16" \
#   CELLS="prefill_b4_l4096_cap50 prefill_b4_l4096_sinks prefill_b4_l4096 prefill_b2_l8192_full" \
#   bash lab/peers_check.sh
# Knobs: WARM_SECONDS (each wave's limit, default 240), TOTAL_SECONDS (the call, default 570: the
# timed run gets what is left, less 15 s, as its --budget), PAGE_SIZE (16), BENCH_ARGS (default
# --quick). Under $OUT (or ./device_out): the summary, the warm-ups' tails, the timed run's log and JSON.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
summary=$OUT/peers_summary.txt; : > "$summary"
if [ -f .fi/flashinfer.tar.xz ]; then
  mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws
else
  echo "flashinfer: .fi/flashinfer.tar.xz absent: the cells run without it" | tee -a "$summary"
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader; git log --oneline -1; } 2>&1 \
  | tee -a "$summary"

IFS=';' read -r -a waves <<< "${WARM:-}"
mkdir -p /tmp/peers_warm_logs; : > "$OUT/peers_warm.txt"  # (at most 8 files come back from a call: one for the tails)
for wave in "${waves[@]}"; do
  read -r -a cells <<< "$wave"; pids=()
  for cell in "${cells[@]}"; do
    timeout "${WARM_SECONDS:-240}" python3 -m bench "$cell" --page-size "${PAGE_SIZE:-16}" --quick --no-ceilings \
      --no-plot --launches 4 --reps 2 --warmup 1 --out /tmp/peers_warm > "/tmp/peers_warm_logs/$cell.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; rc=$?
    echo "[$(el) s] warm ${cells[$i]}: exit $rc (124: cut at WARM_SECONDS)" >> "$summary"
    { echo "-- ${cells[$i]}"; tail -n 3 "/tmp/peers_warm_logs/${cells[$i]}.log" | cut -c1-400; } >> "$OUT/peers_warm.txt"
  done
done

left=$(( ${TOTAL_SECONDS:-570} - $(el) ))
if [ -n "${CELLS:-}" ] && [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m bench $CELLS --page-size "${PAGE_SIZE:-16}" ${BENCH_ARGS:---quick} --no-plot --out "$OUT" \
    --budget $(( left - 15 )) > "$OUT/peers_bench.log" 2>&1
  echo "[$(el) s] timed run: exit $? (124: cut at the call's limit)" >> "$summary"
else
  echo "timed run: skipped (CELLS empty or $left s left)" >> "$summary"
fi
echo; echo "================ peers_check summary ($(el) s) ================"
cat "$summary"
sed -n '/^workload /,$p' "$OUT/peers_bench.log" 2>/dev/null
grep -E "^skipped" "$OUT/peers_bench.log" 2>/dev/null
