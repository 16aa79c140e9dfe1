#!/usr/bin/env bash
# The first call of the next stop (after 2026-12-07), by the card it lands on: on an H200 the closing check
# (lab/call_final.sh: bench.host, device_check.sh all, bench.mla beside FlashInfer; .fi and .sgl carried):
# issue 41's bars are H200 figures; on any other card where the 128-head MLA step's time goes at 1024-key
# splits (lab/call_mla_timeline.sh: the seesaw kernel's timeline, each kernel's duration), then issue 42's
# prefill table beside FlashInfer (lab/call_prefill_table.sh: the soft-cap, fp8 and head-dim cells).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
CALL_SECONDS=170 bash lab/call_mla_timeline.sh
CALL_SECONDS=$(( ${CALL_SECONDS:-585} - 175 )) exec bash lab/call_prefill_table.sh
