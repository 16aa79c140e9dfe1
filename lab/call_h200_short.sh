#!/usr/bin/env bash
# A short call for the device time left (2026-12-08, twenty-seventh stop: about 250 s): the MLA GPU tests first
# (the fp16-query fp8 cases are new), then on an H200 issue 41's figures (bench.host on the fresh machine, two
# passes; then scripts/cold_compile.py --no-serial: the first calls cold and warmup() on every core), then
# bench.mla beside FlashInfer (.fi carried) while time is left.
CALL_DEFAULT=${CALL_SECONDS:-150} . lab/call_begin.sh
tree_tests . mla_tests 60 tests/test_mla_gpu.py
grep -E "passed|failed" "$OUT/mla_tests.log" | tail -1
HOST_SECONDS=60 host_bench
if echo "$gpu" | grep -q H200 && fits 40 "cold_compile"; then
  timeout 40 python3 scripts/cold_compile.py --no-serial 2>&1 | tail -n 14; echo "== cold at $(( $(date +%s) - t0 )) s"
fi
unpack_flashinfer && export PYTHONPATH=$PYTHONPATH:/tmp/fi
fits 40 "bench.mla" && { timeout $(( $(left) - 3 )) python3 -m bench.mla 2>&1 | grep -E "^(decode|verify|fp8|ceilings)" | cut -c1-240; }
echo "== done at $(( $(date +%s) - t0 )) s"
