#!/usr/bin/env bash
# One GPU call (2026-12-07, twenty-seventh stop): on an H200 `bench.host` first (issue 41's figures, on a
# fresh machine); the MLA GPU tests of this tree (branch mla-fp8-fp16: an fp8 cache's products in fp16);
# then every bench.mla cell of main's tree (exp/base: `git archive main`, untracked, travels with the
# tree) and this one, two interleaved rounds with digests (lab/call_mla_ab.sh).
CALL_DEFAULT=${CALL_SECONDS:-330} . lab/call_begin.sh
host_bench
TEST_TREES=. ROUNDS=2 AB_TREES="exp/base ." CALL_SECONDS=$(( $(left) - 5 )) bash lab/call_mla_ab.sh 2>&1 | tail -c 7000
grep -E "^(FAILED|E )" "$OUT/mla_tests_..log" | head -20 | cut -c1-300
echo "== done at $(( $(date +%s) - t0 )) s"
