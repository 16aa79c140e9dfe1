#!/usr/bin/env bash
# An fp8 prefill producer patch against main in one call (2026-12-07): this tree with PATCH (a file in
# lab/patches/) applied in exp/fp8ab (untracked), its fp8 prefill GPU tests, then scripts/ab_trees.sh over
# main and the patched tree, ROUNDS rounds interleaved, on the fp8 prefill cells and the bf16 cell.
#   PATCH=20261207-fp8-widen-halves.patch bash lab/call_fp8_ab.sh
CALL_DEFAULT=400 . lab/call_begin.sh
patched_tree exp/fp8ab "${PATCH:?a patch in lab/patches}" kernels cupy_fa bench tests scripts pyproject.toml README.md || exit 1
(cd exp/fp8ab && PYTHONPATH=$PWD timeout ${TEST_SECONDS:-200} python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_fp8_prefill_gpu.py 2>&1 | tail -n 8)
echo "== patched tree's fp8 prefill tests at $(( $(date +%s) - t0 )) s"
CELLS=${CELLS:-"prefill_b4_l4096_fp8 prefill_b2_l8192_fp8 extend_b4_q1024_l16384_fp8 prefill_b4_l4096"}
ROUNDS=${ROUNDS:-2} timeout $(( $(left) - 10 )) bash scripts/ab_trees.sh ". exp/fp8ab" $CELLS --page-size 16 2>&1 | tail -n 20
echo "== A/B at $(( $(date +%s) - t0 )) s"
