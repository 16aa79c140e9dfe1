#!/usr/bin/env bash
# One GPU call (prepared 2026-12-08, twenty-seventh stop) for lab/patches/20261208-mla-mma-fp16.patch (branch
# mla-mma-fp16: the MLA mma.sync tile's fp8 products in fp16): this tree with the patch in exp/mma, its MLA GPU
# tests, then the fp8 cells of bench.mla on the mma.sync tile (CUPY_FA_MLA_WGMMA_FP8=0) for this tree and
# exp/mma, two interleaved rounds with digests (lab/call_mla_ab.sh). About 200 s.
CALL_DEFAULT=${CALL_SECONDS:-240} . lab/call_begin.sh
patched_tree exp/mma 20261208-mla-mma-fp16.patch || exit 1
TEST_TREES=exp/mma ROUNDS=2 MLA_ONLY=fp8 AB_TREES=".:CUPY_FA_MLA_WGMMA_FP8=0 exp/mma:CUPY_FA_MLA_WGMMA_FP8=0" \
  CALL_SECONDS=$(( $(left) - 5 )) bash lab/call_mla_ab.sh 2>&1 | tail -c 5000
echo "== done at $(( $(date +%s) - t0 )) s"
