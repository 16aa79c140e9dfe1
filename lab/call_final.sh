#!/usr/bin/env bash
# The closing GPU call (2026-12-06): `python -m bench.host` over its default cells first on an H200 (issue 41's
# host figures, on a machine nothing else has run on yet: a test run before doubles them; lab/call_begin.sh),
# then lab/host_copy_probe.py on any card (COPY_PROBE=0: not), then LAB_SCRIPT (a lab script) where set,
# then with TIMELINE_CELLS the clock-stamp timelines of this tree and TREE_PATCHES' trees
# (lab/call_tree_timeline.sh), then an MLA A/B of the exp trees in MLA_AB_TREES (MLA_ONLY, ROUNDS as lab/call_mla_ab.sh takes them) where
# set, then the A/B stages of lab/call_stages.sh (FP8_ABLATE, TAKE_BACK, TRY_PATCH; after the check
# with AB_AFTER=1), then
# scripts/device_check.sh all (its summary table printed whole), then bench.mla beside FlashInfer,
# then, if time is left, the EAGLE
# draft chain probe (SGLang's MLA kit case; .sgl carried), each bounded inside CALL_SECONDS.
CALL_DEFAULT=585 . lab/call_begin.sh
host_bench
if [ "${COPY_PROBE:-1}" = 1 ]; then  # plan's host copy, pageable against pinned (lab/host_copy_probe.py; any card)
  timeout 40 python3 lab/host_copy_probe.py 2>&1 | tail -n 6; echo "== host_copy_probe at $(( $(date +%s) - t0 )) s"
fi
if [ -n "${LAB_SCRIPT:-}" ]; then  # one lab script before the check (LAB_SECONDS, default 70), its output in $OUT/lab_script.txt
  timeout ${LAB_SECONDS:-70} python3 $LAB_SCRIPT 2>&1 | tee "$OUT/lab_script.txt"; echo "== $LAB_SCRIPT at $(( $(date +%s) - t0 )) s"
fi
if [ -n "${TIMELINE_CELLS:-}" ]; then  # timelines of this tree and of TREE_PATCHES' trees (lab/call_tree_timeline.sh)
  TIMELINE_SECONDS=${TIMELINE_SECONDS:-70} bash lab/call_tree_timeline.sh 2>&1 | tee "$OUT/tree_timeline.txt" \
    | grep -v "^  variant"
  echo "== timelines at $(( $(date +%s) - t0 )) s"
fi
if [ -n "${MLA_AB_TREES:-}" ]; then  # an MLA A/B of exp trees before the check (lab/call_mla_ab.sh, no tests)
  TEST_TREES=" " AB_TREES="$MLA_AB_TREES" CALL_SECONDS=${MLA_AB_SECONDS:-70} bash lab/call_mla_ab.sh 2>&1 \
    | grep -v "fp8" | cut -c1-112 | tee "$OUT/mla_ab.txt"
  echo "== MLA A/B at $(( $(date +%s) - t0 )) s"
fi
. lab/call_stages.sh  # mk, ab_trees, ab_stages (FP8_ABLATE, TAKE_BACK, TRY_PATCH)
[ "${AB_AFTER:-0}" = 1 ] || ab_stages
CHECK_SECONDS=${CHECK_SECONDS:-$(( $(left) - ${AFTER_CHECK:-75} ))} TEST_SECONDS=${TEST_SECONDS:-330} OUT=$OUT/check bash scripts/device_check.sh all \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh all: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
[ "${AB_AFTER:-0}" = 1 ] && ab_stages  # (AB_AFTER=1: the A/B stages after the check)
if [ "$(left)" -ge 70 ] && [ -d /tmp/fi/flashinfer ]; then  # bench.mla beside FlashInfer (device_check unpacked it)
  PYTHONPATH=$PWD:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws timeout $(( $(left) - 8 )) python3 -m bench.mla \
    --digest --json "$OUT/mla.json" > "$OUT/mla.txt" 2>&1
  echo "== bench.mla (FlashInfer beside) exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^(decode|verify|fp8|ceilings)" "$OUT/mla.txt" | cut -c1-230
fi
if [ "$(left)" -ge 35 ] && [ -d /tmp/sgl-site/sglang ]; then
  PYTHONPATH=/tmp/sgl-site:$PWD OPENBLAS_NUM_THREADS=1 timeout $(( $(left) - 5 )) python3 lab/eagle_chain_probe.py \
    > "$OUT/eagle_probe.txt" 2>&1
  echo "== eagle probe exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^==|^   " "$OUT/eagle_probe.txt" | cut -c1-600 | head -40
fi
if [ -n "${NCU_WORKLOADS:-}" ] && [ "$(left)" -ge 60 ]; then  # an ncu side-by-side last (NCU_* as device_check takes them)
  OUT=$OUT/ncu timeout $(( $(left) - 5 )) bash scripts/device_check.sh ncu > "$OUT/ncu.log" 2>&1
  echo "== ncu stage exit $? at $(( $(date +%s) - t0 )) s"; tail -n 60 "$OUT/ncu.log" | cut -c1-200
fi
echo "== done at $(( $(date +%s) - t0 )) s"
