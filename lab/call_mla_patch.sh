#!/usr/bin/env bash
# One call for an MLA kernel patch (2026-12-07): on an H200 the closing check instead (lab/call_final.sh,
# H200_SECONDS); on any other card exp/new, this tree (package, bench, tests, kernels) with
# lab/patches/$MLA_PATCH applied, its MLA GPU tests, then bench.mla of this tree and exp/new interleaved
# with each output's digest (lab/call_mla_ab.sh; ROUNDS, 2).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${H200_SECONDS:-585} exec bash lab/call_final.sh
fi
rm -rf exp/new && mkdir -p exp/new && cp -r kernels cupy_fa bench tests pyproject.toml exp/new/ \
  && (cd exp/new && patch -s -p1 < "../../lab/patches/$MLA_PATCH") || { echo "== $MLA_PATCH does not apply"; exit 1; }
TEST_TREES=exp/new AB_TREES=". exp/new" ROUNDS=${ROUNDS:-2} exec bash lab/call_mla_ab.sh
