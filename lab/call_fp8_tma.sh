#!/usr/bin/env bash
# The fp8 tensor-copy staging (branch fp8-tma; lab/NOTES.md 2026-12-07, prediction there) against main
# in one call: lab/call_fp8_ab.sh with its patch (the branch's fp8 prefill GPU tests, then
# scripts/ab_trees.sh over main and the branch), then the branch with CUPY_FA_FP8_TMA=0 once.
# Run from main's tree: bash lab/call_fp8_tma.sh
CALL_DEFAULT=500 . lab/call_begin.sh
PATCH=20261207-fp8-tma-staging.patch CALL_SECONDS=$(( $(left) - 40 )) bash lab/call_fp8_ab.sh
CELLS="prefill_b4_l4096_fp8 prefill_b2_l8192_fp8 extend_b4_q1024_l16384_fp8 prefill_b4_l4096"
(cd exp/fp8ab && CUPY_FA_FP8_TMA=0 PYTHONPATH=$PWD timeout $(( $(left) - 5 )) python3 -m bench $CELLS --page-size 16 \
  --quick --no-peers --no-ceilings --no-plot --out /tmp/fp8tma_off 2>&1 | grep -E " ps=16: " | cut -c1-160)
echo "== knob off at $(( $(date +%s) - t0 )) s"
