#!/usr/bin/env bash
# One call for an MLA kernel patch (2026-12-07). On an H200 the closing check instead: lab/call_final.sh in
# H200_SECONDS, or under 500 s lab/call_h200_tests.sh (bench.host and the GPU tests). On any other card this
# tree becomes the candidate (lab/patches/$MLA_PATCH applied in place; main's package, bench, tests and
# kernels kept in exp/base first): the candidate's whole GPU suite (scripts/device_check.sh tests,
# TEST_SECONDS; SUITE=0: its MLA GPU tests alone), then bench.mla of exp/base and the candidate interleaved
# with each output's digest (lab/call_mla_ab.sh; ROUNDS, 2) in what is left of CALL_SECONDS.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  if [ "${H200_SECONDS:-585}" -lt 500 ]; then CALL_SECONDS=$H200_SECONDS exec bash lab/call_h200_tests.sh; fi
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${H200_SECONDS:-585} exec bash lab/call_final.sh
fi
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"; s0=$(date +%s)
rm -rf exp/base && mkdir -p exp/base && cp -r kernels cupy_fa bench tests pyproject.toml exp/base/ \
  && patch -s -p1 < "lab/patches/$MLA_PATCH" || { echo "== $MLA_PATCH does not apply"; exit 1; }
if [ "${SUITE:-1}" = 1 ]; then
  CHECK_SECONDS=$(( ${TEST_SECONDS:-300} + 40 )) TEST_SECONDS=${TEST_SECONDS:-300} OUT=$OUT/check \
    bash scripts/device_check.sh tests > "$OUT/check.log" 2>&1
  echo "== device_check.sh tests (the candidate): exit $? at $(( $(date +%s) - s0 )) s"
  sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-200 | head -40
fi
TEST_TREES=$([ "${SUITE:-1}" = 1 ] && echo " " || echo .) AB_TREES="exp/base ." ROUNDS=${ROUNDS:-2} CALL_SECONDS=$(( ${CALL_SECONDS:-585} - ($(date +%s) - s0) )) \
  bash lab/call_mla_ab.sh
