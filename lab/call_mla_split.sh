#!/usr/bin/env bash
# One GPU call for the MLA split size at 128 heads and MLA kernel patches (2026-12-07): bench.mla of
# this tree at the shipped split sizes and with CUPY_FA_MLA_SPLIT_SIZE=$SPLIT (1024 by default), and of
# one exp tree a patch in PATCHES (lab/patches/, applied to a copy of this tree's package, kernels,
# bench and tests), interleaved, ROUNDS rounds with each output's digest (lab/call_mla_ab.sh; the
# patched trees' MLA GPU tests first), then the 128-head cells beside FlashInfer's MLA wrapper at each
# split size (.fi carried) for the rule: a size ships only where decode B=1 L=32768 stays within 1.0x
# FlashInfer. MLA_TESTS=1 also runs this tree's MLA GPU tests with the knob set (decode == verify at
# the new size). CALL_SECONDS (585 in all).
. lab/call_budget.sh
SPLIT=${SPLIT:-1024}
unpack_flashinfer
if [ "${MLA_TESTS:-0}" = 1 ] && fits 120 "MLA tests at $SPLIT"; then
  CUPY_FA_MLA_SPLIT_SIZE=$SPLIT timeout 110 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/test_mla_gpu.py \
    > "$OUT/mla_tests_split.log" 2>&1
  echo "== MLA GPU tests at split $SPLIT: exit $?: $(tail -n 1 "$OUT/mla_tests_split.log")"
fi
trees=""
for patch in ${PATCHES:-}; do
  tree=exp/$(basename "$patch" .patch)
  patched_tree "$tree" "$patch" && trees="$trees $tree"
done
FI_SECONDS=${FI_SECONDS:-330}
TEST_TREES="${trees:- }" AB_TREES=". .:CUPY_FA_MLA_SPLIT_SIZE=$SPLIT$trees" ROUNDS=${ROUNDS:-2} \
  CALL_SECONDS=$(( $(left) - FI_SECONDS )) bash lab/call_mla_ab.sh
# the 128-head cells beside FlashInfer (its first run JIT-builds the MLA wrapper: up to a few minutes)
limit=$(( FI_SECONDS - 90 ))
for knob in "" "CUPY_FA_MLA_SPLIT_SIZE=$SPLIT"; do
  fits $(( limit + 5 )) "bench.mla beside FlashInfer ${knob:-shipped}" || continue
  echo "== bench.mla --only H=128 beside FlashInfer, ${knob:-shipped split sizes}, at $(( $(date +%s) - t0 )) s"
  env $knob PYTHONPATH=$PWD:/tmp/fi timeout $limit python3 -m bench.mla --only "H=128" 2>&1 \
    | grep -E "^(decode|verify|fp8)|rror" | cut -c1-220
  limit=80
done
echo "== done at $(( $(date +%s) - t0 )) s"
