#!/usr/bin/env bash
# The first call of the next stop (2026-12-07), by the card it lands on: on an H200 the closing check
# (lab/call_final.sh: bench.host, device_check.sh all, bench.mla; .fi and .sgl carried); on any other card
# the MLA split size at 128 heads and the L2-prefetch patch (lab/call_mla_split.sh: the patched tree's MLA GPU
# tests, bench.mla of main, main at 1024-key splits and the patch interleaved, then both sizes beside FlashInfer).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
MLA_TESTS=${MLA_TESTS:-0} PATCHES=${PATCHES-20261207-mla-l2-prefetch.patch} CALL_SECONDS=${CALL_SECONDS:-585} \
  exec bash lab/call_mla_split.sh
