#!/usr/bin/env bash
# The next session's first call (prepared 2026-12-07), one command for any card:
#   on an H200, `python -m bench.host` first (issue 41's figures, on a machine nothing has run on yet);
#   the sm90 producer's clock stamps over this tree, the as16 tree and the 3-stage, 4-slot fp8 tree
#   (lab/call_tree_timeline.sh; predictions in lab/NOTES.md, 2026-12-07);
#   scripts/device_check.sh all in what is left (its summary printed whole).
# Carry .fi and .sgl (the check's FlashInfer peers and SGLang tests).
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
t0=$(date +%s); total=${CALL_SECONDS:-590}
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "== $gpu"
if echo "$gpu" | grep -q H200; then
  timeout ${HOST_SECONDS:-75} python3 -m bench.host --no-flashinfer --json "$OUT/host.json" 2>&1 | grep -v "^\[" | tail -n 22
  echo "== bench.host at $(( $(date +%s) - t0 )) s"
fi
TREE_PATCHES="20261206-fp8-ablate-as16 20261207-fp8-deep-3x4" TIMELINE_CELLS="prefill_b4_l4096 prefill_b4_l4096_fp8" \
  TIMELINE_SECONDS=70 bash lab/call_tree_timeline.sh 2>&1 | tee "$OUT/tree_timeline.txt" | grep -v "^  variant"
echo "== timelines at $(( $(date +%s) - t0 )) s"
CHECK_SECONDS=$(( $(left) - 5 )) TEST_SECONDS=${TEST_SECONDS:-330} OUT=$OUT/check bash scripts/device_check.sh all \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh all: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
echo "== done at $(( $(date +%s) - t0 )) s"
