#!/usr/bin/env bash
# The first call of the next stop (after 2026-12-07, twenty-sixth stop), by the card it lands on: on an
# H200 the closing check (lab/call_final.sh: bench.host, device_check.sh all, bench.mla beside FlashInfer;
# .fi and .sgl carried): issue 41's bars are H200 figures. On any other card issue 42's prefill table with
# the soft-capped cell beside FlashInfer's first (lab/call_prefill_table.sh; its JIT build was cut before).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
CELLS=${CELLS:-"prefill_b4_l4096_cap50 prefill_b4_l4096 prefill_b4_l4096_fp8 prefill_b2_l8192 prefill_b2_l8192_fp8"} \
  WARMUP=0 CALL_SECONDS=${CALL_SECONDS:-420} exec bash lab/call_prefill_table.sh
