#!/usr/bin/env bash
# One GPU call (2026-12-07, twenty-sixth stop): on an H200 first `bench.host` (issue 41's figures, on a fresh
# machine); then the fp8 seesaw branch's MLA GPU tests and its A/B against the mma.sync tile
# (CUPY_FA_MLA_WGMMA_FP8=0), two interleaved rounds of every bench.mla cell with digests
# (lab/call_mla_ab.sh); then the 128-head cells at 4096- and 2048-key splits (CUPY_FA_MLA_SPLIT_SIZE).
CALL_DEFAULT=590 . lab/call_begin.sh
host_bench
TEST_TREES=. ROUNDS=2 AB_TREES=". .:CUPY_FA_MLA_WGMMA_FP8=0" CALL_SECONDS=$(( $(left) - 75 )) bash lab/call_mla_ab.sh 2>&1 | tail -c 6000
grep -E "passed|failed|error" "$OUT/mla_tests_..log" | tail -2
grep -E "^(FAILED|E )" "$OUT/mla_tests_..log" | head -20 | cut -c1-300
for split in 4096 2048; do
  fits 30 "split $split" || break
  CUPY_FA_MLA_SPLIT_SIZE=$split timeout $(( $(left) - 3 < 40 ? $(left) - 3 : 40 )) python3 -m bench.mla --no-peers --digest \
    --only "B=64 L=4096 H=128" 2>&1 | grep -E "^(decode|verify|fp8)" | cut -c1-150 | sed "s|^|split $split: |"
done
echo "== done at $(( $(date +%s) - t0 )) s"
