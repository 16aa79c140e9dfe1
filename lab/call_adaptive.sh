#!/usr/bin/env bash
# One call whose work depends on the card it lands on (2026-12-07): on an H200, the closing check
# (lab/call_final.sh: bench.host, device_check.sh all, bench.mla; .fi and .sgl carried: the tree with both
# fits the carry limit since .sgl holds wheels.tar.xz); on any other card, the A/B of an fp8 prefill patch
# against main (lab/call_fp8_ab.sh; PATCH, default the widen-halves patch), then, unless PATCH was given,
# the consumers-meet probe on the bf16 cells and one fp8 cell in the time left.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
if [ -n "${PATCH:-}" ]; then CALL_SECONDS=${CALL_SECONDS:-400} exec bash lab/call_fp8_ab.sh; fi
s0=$(date +%s)
PATCH=20261207-fp8-widen-halves.patch CALL_SECONDS=$(( ${CALL_SECONDS:-585} / 2 + 40 )) bash lab/call_fp8_ab.sh
PATCH=20261207-probe-consumers-meet.patch CELLS="prefill_b4_l4096 prefill_b2_l8192 extend_b4_q1024_l16384 prefill_b4_l4096_fp8" \
  CALL_SECONDS=$(( ${CALL_SECONDS:-585} - ($(date +%s) - s0) )) bash lab/call_fp8_ab.sh
