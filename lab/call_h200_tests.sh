#!/usr/bin/env bash
# A short call for an H200 only (2026-12-07): bench.host in one pass (issue 41's host figures are H200
# figures), then scripts/device_check.sh's GPU tests alone inside CALL_SECONDS; on any other card it
# stops at once (those tests passed on an H100 for this package). .sgl carried for the SGLang tests.
CALL_DEFAULT=300 . lab/call_begin.sh
echo "$gpu" | grep -q H200 || { echo "== not an H200: nothing run"; exit 0; }
HOST_SECONDS=${HOST_SECONDS:-40} HOST_PASSES=1 host_bench
CHECK_SECONDS=$(( $(left) - 5 )) TEST_SECONDS=$(( $(left) - 15 )) OUT=$OUT/check bash scripts/device_check.sh tests \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh tests: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
