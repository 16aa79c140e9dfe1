#!/usr/bin/env bash
# One bounded GPU call (2026-12-06) when the device is scarce: the GPU suite (scripts/device_check.sh tests,
# its summary table printed whole), then, in the time left (CALL_SECONDS, 585 in all): the MLA GPU tests of
# exp/epi (a carried copy of branch mla-epilogue, tests included), the MLA bench of exp/step1, . and exp/epi
# interleaved (the 128-head B=64 cells), the 16-head cells on the seesaw kernel against the mma.sync tile
# (CUPY_FA_MLA_WGMMA_MIN_HEADS), and the EAGLE draft chain probe. A stage that would not fit is named and
# skipped. Carry .sgl and the exp trees.
. lab/call_budget.sh

CHECK_SECONDS=330 TEST_SECONDS=${TEST_SECONDS:-290} OUT=$OUT/check bash scripts/device_check.sh tests > "$OUT/check.log" 2>&1
echo "== device_check.sh tests: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log"

if fits 70 "exp/epi MLA tests"; then
  (cd exp/epi && OMP_NUM_THREADS=2 timeout $(( $(left) > 110 ? 100 : $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider \
    -n 8 -m gpu --timeout 90 tests/test_mla_gpu.py) > "$OUT/epi_tests.log" 2>&1
  echo "== exp/epi tests/test_mla_gpu.py: exit $?: $(tail -n 1 "$OUT/epi_tests.log") at $(( $(date +%s) - t0 )) s"
  grep -E "^(FAILED|ERROR)" "$OUT/epi_tests.log" | head -10
fi
for round in 1 2; do
  for tree in exp/step1 . exp/epi; do
    fits 45 "MLA bench r$round $tree" || continue
    (cd $tree && PYTHONPATH=$PWD timeout 60 python3 -m bench.mla --only "B=64 L=4096 H=128" --no-peers 2>&1 \
      | grep -E "^(decode|verify|fp8)" | cut -c1-150 | sed "s|^|r$round $tree: |")
  done
done
for heads in 64 16; do
  fits 45 "16-head cells, min heads $heads" || continue
  CUPY_FA_MLA_WGMMA_MIN_HEADS=$heads timeout 60 python3 -m bench.mla --only "H=16" --no-peers 2>&1 \
    | grep -E "^(decode|verify|fp8)" | cut -c1-170 | sed "s|^|min heads $heads: |"
done
if fits 60 "EAGLE probe"; then
  [ -d /tmp/sgl-site/sglang ] || python3 scripts/sgl_wheels.py --install /tmp/sgl-site > /dev/null
  PYTHONPATH=/tmp/sgl-site:$PWD OPENBLAS_NUM_THREADS=1 timeout $(( $(left) - 5 )) python3 lab/eagle_chain_probe.py \
    > "$OUT/eagle_probe.txt" 2>&1
  echo "== eagle probe exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^==|^   |Error" "$OUT/eagle_probe.txt" | cut -c1-400 | head -40
fi
echo "== done at $(( $(date +%s) - t0 )) s"
