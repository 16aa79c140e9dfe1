#!/usr/bin/env bash
# Issue 42's table in one run (2026-12-07): every prefill cell of the issue (bf16, fp8 KV, soft-cap 50, head
# dims 64 / 96 / 192 / 256, qk 192 / vo 128; prefill and extend) beside FlashInfer (.fi carried; its JIT
# builds on this machine) and cuDNN, page 16, inside CALL_SECONDS (OURS_CELLS: cells run first without
# FlashInfer; WARMUP=0: no warmup first).
CALL_DEFAULT=560 . lab/call_begin.sh
unpack_flashinfer && export PYTHONPATH=$PYTHONPATH:/tmp/fi
if [ "${WARMUP:-1}" = 1 ]; then  # WARMUP=0: the cells compile what they use
  timeout 120 python3 -m cupy_fa warmup --fp8 --variants --quiet 2>&1 | tail -n 1
  echo "== warmup at $(( $(date +%s) - t0 )) s"
fi
CELLS=${CELLS:-"prefill_b4_l4096 prefill_b4_l4096_fp8 prefill_b2_l8192 prefill_b2_l8192_fp8 extend_b4_q1024_l16384 extend_b4_q1024_l16384_fp8 prefill_b4_l4096_cap50 prefill_b4_l4096_d96 prefill_b4_l4096_d192 prefill_b4_l4096_qk192_vo128 prefill_b2_l8192_d64 prefill_b2_l8192_d256"}
# OURS_CELLS first without FlashInfer (ours and cuDNN; no JIT build), then CELLS with it
if [ -n "${OURS_CELLS:-}" ]; then
  timeout $(( $(left) - 5 )) python3 -m bench $OURS_CELLS --no-flashinfer --page-size 16 --quick --no-plot --out "$OUT/bench" \
    > "$OUT/bench_ours.txt" 2>&1
  echo "== bench (no FlashInfer) exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^\[" "$OUT/bench_ours.txt" | grep -E " ps=16: " | cut -c1-260
fi
timeout $(( $(left) - 5 )) python3 -m bench $CELLS --page-size 16 --quick --no-plot --out "$OUT/bench" > "$OUT/bench.txt" 2>&1
echo "== bench exit $? at $(( $(date +%s) - t0 )) s"
grep -E "^\[" "$OUT/bench.txt" | grep -E " ps=16: " | cut -c1-330
grep -E "^skipped|^FAIL" "$OUT/bench.txt" | cut -c1-300
