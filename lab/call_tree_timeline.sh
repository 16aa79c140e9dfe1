#!/usr/bin/env bash
# The timeline probe (lab/probe_timeline.py) over exp trees (2026-12-07): for each patch name in
# TREE_PATCHES (lab/patches/<name>.patch), a copy of this tree's package, kernels, bench and lab with the
# patch applied, probed over TIMELINE_CELLS with its own kernel cache; this tree first (name "shipped";
# SHIPPED=0: the patched trees only).
# Diagnosis only: the patched trees may compute wrong results (the ablations are timing-only).
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
root=$PWD
first=shipped; [ "${SHIPPED:-1}" = 0 ] && first=""
for name in $first ${TREE_PATCHES:-}; do
  dir=/tmp/tree_$name; rm -rf "$dir"; mkdir -p "$dir"; cp -r cupy_fa kernels bench lab "$dir"/
  if [ "$name" != shipped ]; then (cd "$dir" && patch -s -p1 < "$root/lab/patches/$name.patch") || { echo "== $name: patch failed"; continue; }; fi
  (cd "$dir" && PYTHONPATH=$dir CUPY_FA_CACHE_DIR=/tmp/cc_$name CUPY_CACHE_DIR=/tmp/cupy_cache \
     timeout ${TIMELINE_SECONDS:-110} python3 lab/probe_timeline.py $TIMELINE_CELLS) > "$OUT/timeline_$name.txt" 2>&1
  echo "== $name: exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^==|variant|later waves|per CTA|producer|handover|graph replay" "$OUT/timeline_$name.txt" | grep -v "^\[" | cut -c1-190
done
echo "== done at $(( $(date +%s) - t0 )) s"
