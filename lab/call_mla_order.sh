#!/usr/bin/env bash
# One bounded GPU call (2026-12-06, fourth stop): the MLA seesaw kernel's warpgroup-1 order (branch
# mla-order) beside main's kernel. The MLA GPU tests of this tree and of exp/pvfirst (the order's other
# form, tests included), the variant GPU tests here (schedule.window_spans from key_base), then the MLA
# bench of exp/base (main's package and kernels, this bench), . and exp/pvfirst interleaved with each
# output's digest (the trees' bits compared). A stage that would not fit is named and skipped.
# Carry the exp trees (exp/base, exp/pvfirst). CALL_SECONDS (585 in all).
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
t0=$(date +%s); total=${CALL_SECONDS:-585}
left() { echo $(( total - ($(date +%s) - t0) )); }
fits() { [ "$(left)" -ge "$1" ] || { echo "== skipped $2: $(left) s left, $1 needed"; false; }; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
git log --oneline -1

tests() {  # tree, log name, files
  local tree=$1 name=$2; shift 2
  (cd $tree && PYTHONPATH=$PWD OMP_NUM_THREADS=2 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu \
    --timeout 90 "$@") > "$OUT/$name.log" 2>&1
  echo "== $tree $*: exit $?: $(tail -n 1 "$OUT/$name.log") at $(( $(date +%s) - t0 )) s"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | head -10
}
fits 110 "MLA tests ." && tests . mla_tests tests/test_mla_gpu.py
fits 110 "MLA tests exp/pvfirst" && tests exp/pvfirst pvfirst_tests tests/test_mla_gpu.py
fits 110 "variant tests ." && tests . variant_tests tests/test_variants_gpu.py
for round in 1 2; do
  for tree in exp/base . exp/pvfirst; do
    fits 80 "MLA bench r$round $tree" || continue
    (cd $tree && PYTHONPATH=$PWD timeout 75 python3 -m bench.mla ${MLA_ONLY:+--only "$MLA_ONLY"} --no-peers --digest 2>&1 \
      | grep -E "^(decode|verify|fp8)" | cut -c1-150 | sed "s|^|r$round $tree: |")
  done
done
echo "== done at $(( $(date +%s) - t0 )) s"
