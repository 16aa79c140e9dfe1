#!/usr/bin/env bash
# MLA's split merge at 16-byte lanes against main (2026-12-07; lab/NOTES, twenty-fourth stop). On an
# H200 `python -m bench.host` first (issue 41's figures, one pass). Then, with exp/vec8 this tree with
# lab/patches/20261207-mla-merge-vec8.patch and exp/pages with lab/patches/20261207-mla-first-pages-early.patch
# (the seesaw kernel's first page ids loaded earlier): exp/vec8's MLA and invariance GPU tests (the MHA
# merge's SASS changed in addressing only); bench.mla of main, exp/vec8 and exp/pages interleaved (ROUNDS,
# 2; digests must be equal); each merge tree's merge under Nsight Compute's duration (decode and verify at
# 128 heads); the MHA split cells of the bench on main and exp/vec8 interleaved (the MHA merge unchanged
# within 1%); exp/pages' MLA GPU tests where time is left. CALL_SECONDS (default 480); a stage that does
# not fit is named and skipped.
CALL_DEFAULT=480 . lab/call_begin.sh
HOST_PASSES=1 HOST_SECONDS=60 host_bench
patched_tree exp/vec8 20261207-mla-merge-vec8.patch || exit 1
patched_tree exp/pages 20261207-mla-first-pages-early.patch || exit 1
fits 150 "exp/vec8 GPU tests" && tree_tests exp/vec8 vec8_tests 140 tests/test_mla_gpu.py tests/test_invariance_gpu.py
run_tree() {  # tree, command...
  local tree=$1; shift
  (cd $tree && PYTHONPATH=$PWD CUPY_FA_CACHE_DIR=/tmp/cupy_fa_$(basename $tree) "$@")
}
for round in $(seq ${ROUNDS:-2}); do
  for tree in . exp/vec8 exp/pages; do
    fits 45 "bench.mla r$round $tree" || continue
    run_tree $tree timeout 40 python3 -m bench.mla --no-peers --digest 2>&1 | grep -E "^(decode|verify|fp8)" | cut -c1-150 \
      | sed "s|^|r$round $tree: |"
  done
done
for tree in . exp/vec8; do
  for cell in "decode B=64 L=4096 H=128" "verify q=4 B=64 L=4096 H=128"; do
    fits 40 "ncu $tree $cell" || continue
    run_tree $tree timeout 35 ncu --clock-control none -k "regex:merge" --metrics gpu__time_duration.sum python3 -m bench.mla \
      --only "$cell" --no-peers --reps 1 --launches 1 > "$OUT/ncu_merge.txt" 2>&1
    echo "== ncu merge, $tree, $cell: exit $?: $(awk '/Context [0-9]+, Stream/ {n=$2} /gpu__time_duration.sum/ {print n, $NF}' \
      "$OUT/ncu_merge.txt" | tail -n 4 | tr '\n' ' ')"
  done
done
for round in $(seq ${ROUNDS:-2}); do
  for tree in . exp/vec8; do
    fits 30 "MHA bench r$round $tree" || continue
    run_tree $tree timeout 28 python3 -m bench decode_b64_l4096 verify_q4_b64_l4096 decode_b16_l32768 --page-size 16 \
      --no-peers --no-ceilings --no-plot --out "$OUT/mha_$round$(basename $tree)" 2>&1 | grep -E "ours" | cut -c1-110 \
      | sed "s|^|r$round $tree: |"
  done
done
fits 120 "exp/pages MLA GPU tests" && tree_tests exp/pages pages_tests 110 tests/test_mla_gpu.py  # (last: what its merge would need)
echo "== done at $(( $(date +%s) - t0 )) s"
