#!/usr/bin/env bash
# The first call of the next stop (2026-12-07, twenty-sixth stop), by the card it lands on: on an H200 the
# closing check (lab/call_final.sh: bench.host, device_check.sh all, bench.mla beside FlashInfer; .fi and .sgl
# carried): issue 41's bars are H200 figures. On any other card: device_check.sh all on this tree (its
# summary printed whole), then the 128-head MLA cells at 4096- and 2048-key splits (CUPY_FA_MLA_SPLIT_SIZE:
# the price of the fixed splits; prediction in lab/NOTES, twenty-sixth stop), then the 128-head cells beside
# FlashInfer at the default split, each bounded inside CALL_SECONDS.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${CALL_SECONDS:-585} exec bash lab/call_final.sh
fi
CALL_DEFAULT=590 . lab/call_begin.sh
CHECK_SECONDS=$(( $(left) - ${AFTER_CHECK:-140} )) TEST_SECONDS=330 OUT=$OUT/check bash scripts/device_check.sh all \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh all: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
for split in 4096 2048; do
  fits 30 "split $split" || break
  echo "== bench.mla --no-peers --only 'L=4096 H=128', CUPY_FA_MLA_SPLIT_SIZE=$split"
  CUPY_FA_MLA_SPLIT_SIZE=$split timeout $(( $(left) - 5 )) python3 -m bench.mla --no-peers --digest \
    --only "L=4096 H=128" 2>&1 | grep -E "^(decode|verify|fp8|ceilings)" | cut -c1-200
done
if fits 60 "bench.mla beside FlashInfer" && unpack_flashinfer; then
  echo "== bench.mla --only 'L=4096 H=128' beside FlashInfer, default split, at $(( $(date +%s) - t0 )) s"
  PYTHONPATH=$PWD:/tmp/fi timeout $(( $(left) - 3 )) python3 -m bench.mla --digest --only "L=4096 H=128" 2>&1 \
    | grep -E "^(decode|verify|fp8)" | cut -c1-230
fi
echo "== done at $(( $(date +%s) - t0 )) s"
