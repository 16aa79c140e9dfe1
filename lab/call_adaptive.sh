#!/usr/bin/env bash
# One call whose work depends on the card it lands on (2026-12-07): on an H200, the closing check
# (lab/call_final.sh: bench.host, device_check.sh all, bench.mla; .fi and .sgl carried: the tree with both
# fits the carry limit since .sgl holds wheels.tar.xz); on any other card, where the fp8 prefill tile's time
# goes after the half-chunk widening: the SGLang backend's GPU tests through scripts/sgl_wheels.py first, the
# 128-head MLA seesaw kernel's executed instructions per SASS line (ncu_mla_sass.csv.gz), the ncu source
# counters and the clock stamps of main's tiles (lab/call_probe.sh), then the stamps of main's fp8 tile
# beside the as16 tree's (the 16-bit producer under the fp8 tile's consumers; lab/call_tree_timeline.sh) in
# the time left; the logs come back as logs.tgz. With PATCH set, on any other card
# the A/B of that fp8 prefill patch against main instead (lab/call_fp8_ab.sh).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if echo "$gpu" | grep -q H200; then
  HOST_SECONDS=70 AFTER_CHECK=5 CALL_SECONDS=${H200_SECONDS:-${CALL_SECONDS:-585}} exec bash lab/call_final.sh
fi
if [ -n "${PATCH:-}" ]; then CALL_SECONDS=${CALL_SECONDS:-400} exec bash lab/call_fp8_ab.sh; fi
s0=$(date +%s)
# The SGLang backend's GPU tests through scripts/sgl_wheels.py --install (device_check.sh's install path since
# afb10fa), before the probes (its first GPU run, 2026-12-07 on an H100: 8 passed).
site=$(python3 scripts/sgl_wheels.py --install /tmp/sgl-site); echo "== sgl_wheels --install exit $? ($site)"
PYTHONPATH=/tmp/sgl-site:$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sglang_graph_gpu.py 2>&1 | tail -n 4
echo "== sglang GPU tests at $(( $(date +%s) - s0 )) s"
OUT=${OUT:-$PWD/device_out}
left=$(( ${CALL_SECONDS:-585} - ($(date +%s) - s0) ))
if [ "$left" -ge 150 ]; then  # the 128-head MLA seesaw kernel's executed instructions per SASS line (decode B=64 L=4096)
  timeout $(( left - 40 < 150 ? left - 40 : 150 )) ncu --clock-control none -k regex:mla_wgmma_kernel -s 2 -c 1 --section SourceCounters \
    --section InstructionStats --section WarpStateStats --import-source no -f -o /tmp/ncu_mla \
    python3 -m bench.mla --only "decode B=64 L=4096 H=128" --no-peers --reps 1 --launches 1 > "$OUT/ncu_mla_run.txt" 2>&1
  echo "== ncu mla exit $? at $(( $(date +%s) - s0 )) s"
  ncu --import /tmp/ncu_mla.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu_mla_sass.csv.gz"
  ncu --import /tmp/ncu_mla.ncu-rep --print-details all 2>&1 | grep -E "Duration|Executed Instructions|Issued Ipc|Warp Cycles Per Issued" | head
fi
TIMELINE_CELLS="prefill_b4_l4096 prefill_b4_l4096_fp8" NCU_WORKLOADS=prefill_b4_l4096_fp8 NCU_WHO=ours \
  NCU_KERNELS=prefill_sm90_kernel NCU_SOURCE=1 CALL_SECONDS=$(( (${CALL_SECONDS:-585} - ($(date +%s) - s0)) * 2 / 3 )) bash lab/call_probe.sh
left=$(( ${CALL_SECONDS:-585} - ($(date +%s) - s0) ))
if [ "$left" -ge 90 ]; then
  SHIPPED=0 TREE_PATCHES=20261206-fp8-ablate-as16 TIMELINE_CELLS=prefill_b4_l4096_fp8 TIMELINE_SECONDS=$(( left - 15 )) \
    bash lab/call_tree_timeline.sh
fi
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=ncu_mla_sass.csv.gz . 2>/dev/null; find . -mindepth 1 ! -name logs.tgz ! -name ncu_mla_sass.csv.gz -delete)
