#!/usr/bin/env bash
# The second call on an H100 after `device_check.sh all` (2026-12-08, twenty-eighth stop): the three
# measurements the last stop left waiting, in one call (the MLA GPU tests of this tree already ran in the
# check, so they are not repeated here):
#   1. lab/call_mla_host.sh without its tests: MLA host time, main before the host path (exp/base:
#      `git archive 0e83f75`, untracked, it travels) against this tree, and bench.mla digests of both;
#   2. lab/patches/20261208-mla-mma-fp16.patch: its MLA GPU tests, then the fp8 cells on the mma.sync tile
#      (CUPY_FA_MLA_WGMMA_FP8=0) against this tree, two interleaved rounds with digests;
#   3. the price of 2048-key splits at 16 heads (CUPY_FA_MLA_SPLIT_SIZE=2048), beside the default.
CALL_DEFAULT=${CALL_SECONDS:-585} . lab/call_begin.sh
MLA_TESTS=0 CALL_SECONDS=200 bash lab/call_mla_host.sh 2>&1 | grep -v "^== NVIDIA"
echo "== host A/B done at $(( $(date +%s) - t0 )) s"
if patched_tree exp/mma 20261208-mla-mma-fp16.patch; then
  TEST_TREES=exp/mma ROUNDS=2 MLA_ONLY=fp8 AB_TREES=".:CUPY_FA_MLA_WGMMA_FP8=0 exp/mma:CUPY_FA_MLA_WGMMA_FP8=0" \
    CALL_SECONDS=$(( $(left) - 70 )) bash lab/call_mla_ab.sh 2>&1 | tail -c 4000
fi
for knob in CUPY_FA_MLA_SPLIT_SIZE=2048 CUPY_FA_MLA_SPLIT_SIZE=1024; do
  fits 30 "split price $knob" && env $knob timeout 28 python3 -m bench.mla --no-peers --only "H=16" 2>&1 \
    | grep -E "^(decode|verify)" | cut -c1-150 | sed "s|^|$knob: |"
done
echo "== done at $(( $(date +%s) - t0 )) s"
