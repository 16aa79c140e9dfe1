#!/usr/bin/env bash
# One call (2026-12-07): on an H200 `python -m bench.host` first (issue 41's figures, a fresh machine);
# then the fp8 producer over N staging slots (lab/patches/20261207-fp8-deep.patch): the timeline of its
# tree at 3 stages and 4 staging slots, and ab_hopper's "deep" points beside the table and the bf16 cell;
# then scripts/device_check.sh "tests demo engine" in what is left (its summary printed whole).
CALL_DEFAULT=590 . lab/call_begin.sh
HOST_SECONDS=${HOST_SECONDS:-75} host_bench
. lab/call_stages.sh && mk deep 20261207-fp8-deep.patch
SHIPPED=0 TREE_PATCHES=20261207-fp8-deep-3x4 TIMELINE_CELLS=prefill_b4_l4096_fp8 TIMELINE_SECONDS=60 \
  bash lab/call_tree_timeline.sh 2>&1 | tail -n 8
echo "== timeline at $(( $(date +%s) - t0 )) s"
timeout ${AB_SECONDS:-100} python3 lab/ab_hopper.py --exact --only prefill_b4_l4096,prefill_b4_l4096_fp8,prefill_b2_l8192_fp8 \
  --points "shipped,table,deep" --rounds 2 > "$OUT/ab.txt" 2>&1
echo "== ab exit $? at $(( $(date +%s) - t0 )) s"; grep -E "^ab|^  " "$OUT/ab.txt" | cut -c1-150
CHECK_SECONDS=$(( $(left) - 5 )) TEST_SECONDS=${TEST_SECONDS:-310} OUT=$OUT/check bash scripts/device_check.sh "tests demo engine" \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh tests demo engine: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
echo "== done at $(( $(date +%s) - t0 )) s"
