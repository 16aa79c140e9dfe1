#!/usr/bin/env bash
# A probe call (2026-12-07): AB_CELLS by lab/ab_hopper.py (e.g. its lab cells, fp16 against bf16 queries
# over a 16-bit and an fp8 cache; two interleaved rounds; TREE_PATCH: beside an exp tree of lab/patches),
# then lab/probe_timeline.py over TIMELINE_CELLS, then device_check's ncu stage over NCU_WORKLOADS
# (NCU_WHO, NCU_KERNELS, NCU_METRICS as device_check takes them), its key lines printed; each bounded
# inside CALL_SECONDS.
CALL_DEFAULT=480 . lab/call_begin.sh
trees=""
if [ -n "${TREE_PATCH:-}" ]; then  # exp/tree: this tree's kernels with lab/patches/$TREE_PATCH, timed beside it
  . lab/call_stages.sh && mk tree "$TREE_PATCH" && trees=exp/tree
fi
if [ -n "${AB_CELLS:-}" ]; then
  timeout ${AB_SECONDS:-200} python3 lab/ab_hopper.py --exact --only "$AB_CELLS" --rounds ${ROUNDS:-2} \
    ${trees:+--kernel-trees $trees} > "$OUT/ab.txt" 2>&1
  echo "== ab exit $? at $(( $(date +%s) - t0 )) s"; sed -n '/^means over rounds/,$p' "$OUT/ab.txt" | cut -c1-150
fi
if [ -n "${TIMELINE_CELLS:-}" ] && [ "$(left)" -ge 60 ]; then  # the timeline stamps' probe (a trace build)
  timeout ${TIMELINE_SECONDS:-120} python3 lab/probe_timeline.py $TIMELINE_CELLS > "$OUT/timeline.txt" 2>&1
  echo "== timeline exit $? at $(( $(date +%s) - t0 )) s"; grep -v "^\[" "$OUT/timeline.txt" | cut -c1-200 | head -80
fi
if [ -n "${NCU_WORKLOADS:-}" ] && [ "$(left)" -ge 60 ]; then
  OUT=$OUT/ncu timeout $(( $(left) - 5 )) bash scripts/device_check.sh ncu > "$OUT/ncu.log" 2>&1
  echo "== ncu exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^==== ncu|Duration|Executed Instructions|issue_active|warps_eligible|stalled_(short|long|math|wait|barrier|mio|lg|no_inst|dispatch|selected|not_selected|branch|sleeping|tex|drain|membar)|pipe_xu|gmma|Achieved Occupancy|Registers Per" \
    "$OUT/ncu/ncu.txt" 2>/dev/null | cut -c1-160 | head -120
fi
echo "== done at $(( $(date +%s) - t0 )) s"
