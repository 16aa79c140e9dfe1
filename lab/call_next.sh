#!/usr/bin/env bash
# The first call of the next stop (after 2026-12-07, twenty-fourth stop), by the card it lands on: on an
# H200 the closing check (lab/call_final.sh: bench.host, device_check.sh all, bench.mla beside FlashInfer;
# .fi and .sgl carried): issue 41's bars are H200 figures; on any other card the MLA merge at 16-byte lanes
# and the seesaw kernel's first page ids loaded early, each against main (lab/call_merge_ab.sh: the
# merge tree's GPU tests, bench.mla of the three trees interleaved, the merges' ncu durations, the MHA
# split cells of both merge trees).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
CALL_SECONDS=${CALL_SECONDS:-440} exec bash lab/call_merge_ab.sh
