#!/usr/bin/env bash
# Where the 128-head MLA step's time goes at 1024-key splits (2026-12-07; lab/NOTES, twenty-third stop,
# next runs item 3): the seesaw kernel's clock-stamp timeline (lab/mla_trace_stamp.py on a copy of this
# tree in exp/trace, lab/probe_mla_timeline.py over its cells), then each kernel of one step under Nsight
# Compute's duration metric alone (the attention kernel and the split merge apart, serialised), for the
# cells in CELLS. Bounded inside CALL_SECONDS (default 200).
CALL_DEFAULT=200 . lab/call_budget.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
tree_copy exp/trace cupy_fa kernels bench && python3 lab/mla_trace_stamp.py exp/trace \
  || { echo "== the trace stamps do not apply"; exit 1; }
if fits 90 "timeline probe"; then
  (cd exp/trace && PYTHONPATH=$PWD CUPY_FA_CACHE_DIR=/tmp/cupy_fa_trace timeout 85 python3 "$OLDPWD/lab/probe_mla_timeline.py" 2>&1 \
    | tail -n 60)
  echo "== timeline at $(( $(date +%s) - t0 )) s"
fi
for cell in ${CELLS:-"decode B=64 L=4096 H=128" "verify q=4 B=64 L=4096 H=128"}; do
  fits 65 "ncu durations: $cell" || continue
  timeout 60 ncu --clock-control none -k "regex:mla_wgmma|merge" --metrics gpu__time_duration.sum python3 -m bench.mla --only "$cell" --no-peers \
    --reps 1 --launches 1 > "$OUT/ncu_durations.txt" 2>&1
  echo "== ncu durations, $cell: exit $?"
  # each launch: the kernel's name (up to its template arguments) and its duration, in launch order
  awk '/Context [0-9]+, Stream/ {name=$1; if (name == "void") name=$2} /gpu__time_duration.sum/ {print name, $NF, $(NF-1)}' "$OUT/ncu_durations.txt" \
    | tail -n 12
done
echo "== done at $(( $(date +%s) - t0 )) s"
