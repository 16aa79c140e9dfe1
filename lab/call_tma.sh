#!/usr/bin/env bash
# One bounded GPU call (2026-12-06): the MLA seesaw kernel's key blocks by TMA. The MLA GPU tests
# (tests/test_mla_gpu.py: the TMA == cp.async bit-for-bit test, every mode at 8 / 16 / 128 heads),
# then the MLA bench with CUPY_FA_MLA_TMA=1 against 0, interleaved (ours only), then the EAGLE draft
# chain probe in the time left (CALL_SECONDS, 585 in all). Carry .sgl for the probe.
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
t0=$(date +%s); total=${CALL_SECONDS:-585}
left() { echo $(( total - ($(date +%s) - t0) )); }
fits() { [ "$(left)" -ge "$1" ] || { echo "== skipped $2: $(left) s left, $1 needed"; false; }; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu \
  --timeout 180 tests/test_mla_gpu.py > "$OUT/mla_tests.log" 2>&1
echo "== tests/test_mla_gpu.py: exit $?: $(tail -n 1 "$OUT/mla_tests.log") at $(( $(date +%s) - t0 )) s"
grep -E "^(FAILED|ERROR)|seed|Error" "$OUT/mla_tests.log" | head -20
for round in 1 2; do
  for tma in 1 0; do
    fits 45 "bench r$round tma=$tma" || continue
    CUPY_FA_MLA_TMA=$tma timeout 90 python3 -m bench.mla --only "${AB_ONLY:-B=}" --no-peers 2>&1 \
      | grep -E "^(decode|verify|fp8)" | cut -c1-170 | sed "s|^|r$round tma=$tma: |"
  done
done
if fits 60 "EAGLE probe" && ls .sgl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sgl-site .sgl/*.whl
  PYTHONPATH=/tmp/sgl-site:$PWD OPENBLAS_NUM_THREADS=1 timeout $(( $(left) - 5 )) python3 lab/eagle_chain_probe.py \
    > "$OUT/eagle_probe.txt" 2>&1
  echo "== eagle probe exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^==|^   |Error" "$OUT/eagle_probe.txt" | cut -c1-400 | head -60
fi
echo "== done at $(( $(date +%s) - t0 )) s"
