#!/usr/bin/env bash
# One bounded GPU call for an MLA kernel experiment (2026-12-06): the MLA GPU tests of each tree in
# TEST_TREES (". exp/x": trees carrying tests/), the variant GPU tests here when VARIANT_TESTS=1, the
# seesaw kernel's timeline (lab/probe_mla_timeline.py) in PROBE_TREE (a tree with
# lab/mla_trace_stamp.py applied), then the MLA bench of AB_TREES interleaved (ROUNDS, 2)
# with each output's digest (the trees' bits compared; MLA_ONLY: cells whose name holds it; an
# entry "tree:VAR=value,VAR2=value" runs that tree with those CUPY_FA_* knobs set). A stage
# that would not fit is named and skipped. Carry the exp trees. CALL_SECONDS (585 in all).
. lab/call_budget.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

for tree in ${TEST_TREES:-.}; do
  fits 110 "MLA tests $tree" && tree_tests $tree "mla_tests_$(basename $tree)" 100 tests/test_mla_gpu.py
done
[ "${VARIANT_TESTS:-0}" = 1 ] && fits 110 "variant tests ." && tree_tests . variant_tests 100 tests/test_variants_gpu.py
if [ -n "${PROBE_TREE:-}" ] && fits 90 "timeline probe"; then
  (cd $PROBE_TREE && PYTHONPATH=$PWD timeout 80 python3 $OLDPWD/lab/probe_mla_timeline.py 2>&1 | tail -40)
fi
for round in $(seq ${ROUNDS:-2}); do
  for entry in ${AB_TREES:-exp/base .}; do
    tree=${entry%%:*}; knob=""; [ "$entry" != "$tree" ] && knob=${entry#*:}
    fits 60 "MLA bench r$round $entry" || continue
    (cd $tree && env ${knob//,/ } PYTHONPATH=$PWD timeout 55 python3 -m bench.mla ${MLA_ONLY:+--only "$MLA_ONLY"} \
      --no-peers --digest 2>&1 | grep -E "^(decode|verify|fp8)" | cut -c1-150 | sed "s|^|r$round $entry: |")
  done
done
echo "== done at $(( $(date +%s) - t0 )) s"
