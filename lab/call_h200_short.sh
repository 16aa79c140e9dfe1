#!/usr/bin/env bash
# A short first call on an H200 (2026-12-08, twenty-seventh stop: about 400 s of device time left): issue 41's
# H200 figures first (bench.host on the fresh machine, two passes; then scripts/cold_compile.py --no-serial:
# the first calls cold and warmup() on every core), then bench.mla beside FlashInfer (.fi carried), then
# issue 42's prefill cells beside FlashInfer while time is left. On another card: the same, bench.host too.
HOST_ANY=1 CALL_DEFAULT=${CALL_SECONDS:-330} . lab/call_begin.sh
HOST_SECONDS=75 host_bench
fits 45 "cold_compile" && { timeout 45 python3 scripts/cold_compile.py --no-serial 2>&1 | tail -n 14; echo "== cold at $(( $(date +%s) - t0 )) s"; }
unpack_flashinfer && export PYTHONPATH=$PYTHONPATH:/tmp/fi
fits 60 "bench.mla" && { timeout 75 python3 -m bench.mla 2>&1 | grep -E "^(decode|verify|fp8|ceilings)" | cut -c1-240; echo "== bench.mla at $(( $(date +%s) - t0 )) s"; }
fits 60 "prefill cells" && timeout $(( $(left) - 5 )) python3 -m bench prefill_b4_l4096 prefill_b4_l4096_fp8 prefill_b4_l4096_cap50 \
  --page-size 16 --quick --no-plot --out "$OUT/bench" 2>&1 | grep -E " ps=16: " | sed 's/sdpa_flash [^|]*|//; s/n\/a: n\/a: [^|]*//' | cut -c1-300
echo "== done at $(( $(date +%s) - t0 )) s"
