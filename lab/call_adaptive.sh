#!/usr/bin/env bash
# One call whose work depends on the card it lands on (2026-12-07): on an H200, the closing check
# (lab/call_final.sh: bench.host, device_check.sh all, bench.mla; .fi and .sgl carried); on any other
# card, the fp8 tensor-copy staging A/B (lab/call_fp8_tma.sh), then the qk 192 / vo 128 prefill cell
# beside FlashInfer (lab/call_prefill_table.sh without its warmup) in the time left.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
s0=$(date +%s)
CALL_SECONDS=${FP8_SECONDS:-400} bash lab/call_fp8_tma.sh
WARMUP=0 CELLS=${CELLS:-prefill_b4_l4096_qk192_vo128} CALL_SECONDS=$(( ${CALL_SECONDS:-585} - ($(date +%s) - s0) )) \
  bash lab/call_prefill_table.sh
