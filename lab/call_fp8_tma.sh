#!/usr/bin/env bash
# The fp8 tensor-copy staging (branch fp8-tma; lab/NOTES.md 2026-12-07, prediction there) against main
# in one call: this tree with the branch's patch in exp/fp8tma (untracked), its fp8 prefill GPU
# tests, then scripts/ab_trees.sh over main and the branch, two rounds interleaved, on the fp8 prefill
# cells, then the branch with CUPY_FA_FP8_TMA=0 once. Run from main's tree: bash lab/call_fp8_tma.sh
CALL_DEFAULT=500 . lab/call_begin.sh
rm -rf exp/fp8tma && mkdir -p exp/fp8tma && cp -r kernels cupy_fa bench tests scripts pyproject.toml README.md exp/fp8tma/ \
  && (cd exp/fp8tma && patch -s -p1 < ../../lab/patches/20261207-fp8-tma-staging.patch) || { echo "== the patch did not apply"; exit 1; }
(cd exp/fp8tma && PYTHONPATH=$PWD timeout ${TEST_SECONDS:-200} python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_fp8_prefill_gpu.py 2>&1 | tail -n 8)
echo "== branch fp8 prefill tests at $(( $(date +%s) - t0 )) s"
CELLS="prefill_b4_l4096_fp8 prefill_b2_l8192_fp8 extend_b4_q1024_l16384_fp8 prefill_b4_l4096"
ROUNDS=${ROUNDS:-2} timeout $(( $(left) - 60 )) bash scripts/ab_trees.sh ". exp/fp8tma" $CELLS --page-size 16 2>&1 | tail -n 20
echo "== A/B at $(( $(date +%s) - t0 )) s"
(cd exp/fp8tma && CUPY_FA_FP8_TMA=0 PYTHONPATH=$PWD timeout $(( $(left) - 5 )) python3 -m bench $CELLS --page-size 16 \
  --quick --no-peers --no-ceilings --no-plot --out /tmp/fp8tma_off 2>&1 | grep -E " ps=16: " | cut -c1-160)
echo "== knob off at $(( $(date +%s) - t0 )) s"
