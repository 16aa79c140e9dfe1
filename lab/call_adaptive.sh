#!/usr/bin/env bash
# One call whose work depends on the card it lands on (2026-12-07): on an H200, the closing check
# (lab/call_final.sh: bench.host, device_check.sh all, bench.mla; .fi and .sgl carried: the tree with both
# fits the carry limit since .sgl holds wheels.tar.xz); on any other card, the A/B of an fp8 prefill patch
# against main (lab/call_fp8_ab.sh; PATCH, default the widen-halves patch).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
PATCH=${PATCH:-20261207-fp8-widen-halves.patch} CALL_SECONDS=${CALL_SECONDS:-400} exec bash lab/call_fp8_ab.sh
