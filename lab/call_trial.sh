#!/usr/bin/env bash
# The first of two chained GPU calls (2026-12-07): `python -m bench.host` on an H200 first (a fresh
# machine: lab/call_begin.sh host_bench), then the A/B stages of lab/call_stages.sh (TRY_PATCH with
# TRY_TESTS, TAKE_BACK, FP8_ABLATE). The second call, on the machine still warm, is the whole check:
#   OUT=$OUT/check CHECK_SECONDS=575 bash scripts/device_check.sh all
CALL_DEFAULT=330 . lab/call_begin.sh
host_bench
. lab/call_stages.sh
ab_stages
echo "== done at $(( $(date +%s) - t0 )) s"
