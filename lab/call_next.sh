#!/usr/bin/env bash
# The first call of the next stop (after 2026-12-08, twenty-seventh stop), by the card it lands on: on an
# H200 the closing check (lab/call_final.sh: bench.host, device_check.sh all, bench.mla beside FlashInfer with
# its host columns; .fi and .sgl carried): issue 41's bars are H200 figures. On any other card
# `device_check.sh all` alone: main's MLA host path, the caches' append path and nine MLA GPU test cases
# have run on no GPU yet.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
. lab/call_budget.sh
echo "== $gpu"
CHECK_SECONDS=$(( ${CALL_SECONDS:-585} - 15 )) TEST_SECONDS=330 OUT=$OUT/check bash scripts/device_check.sh all \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh all: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
