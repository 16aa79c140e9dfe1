#!/usr/bin/env bash
# The closing GPU call (2026-12-06): scripts/device_check.sh all (its summary table printed whole),
# then `python -m bench.host` on two cells (issue 41's host figures on this host), then the EAGLE
# draft chain probe (SGLang's MLA kit case; .sgl carried), each bounded inside CALL_SECONDS.
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
t0=$(date +%s); total=${CALL_SECONDS:-585}
left() { echo $(( total - ($(date +%s) - t0) )); }
CHECK_SECONDS=${CHECK_SECONDS:-480} TEST_SECONDS=${TEST_SECONDS:-330} OUT=$OUT/check bash scripts/device_check.sh all \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh all: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
if [ "$(left)" -ge 50 ]; then
  timeout $(( $(left) > 100 ? 55 : $(left) - 40 )) python3 -m bench.host decode_b64_l4096 prefill_b4_l4096 --no-flashinfer \
    --repeats 200 2>&1 | grep -v "^\[" | tail -n 25
  echo "== bench.host at $(( $(date +%s) - t0 )) s"
fi
if [ "$(left)" -ge 35 ] && [ -d /tmp/sgl-site/sglang ]; then
  PYTHONPATH=/tmp/sgl-site:$PWD OPENBLAS_NUM_THREADS=1 timeout $(( $(left) - 5 )) python3 lab/eagle_chain_probe.py \
    > "$OUT/eagle_probe.txt" 2>&1
  echo "== eagle probe exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^==|^   " "$OUT/eagle_probe.txt" | cut -c1-600 | head -40
fi
echo "== done at $(( $(date +%s) - t0 )) s"
