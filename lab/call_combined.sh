#!/usr/bin/env bash
# One GPU call when machines are scarce (2026-12-06): `bench.host` first on an H200 (issue 41's
# figures on a machine nothing has run on yet), the fp8 producer ablations (lab/patches
# 20261206-fp8-ablate-*, in exp trees of this tree's kernels, by lab/ab_hopper.py --kernel-trees),
# an MLA A/B of main's seesaw kernel (this tree with lab/patches/20261206-mla-lean.patch taken back),
# this tree, and this tree with the bulk-copy end (lab/patches/20261206-mla-bulk-store.patch) or the
# merge at (2, 1) (MLA_ONLY cells, two rounds; digests compare the trees' bits), then scripts/device_check.sh all in what is left of
# CALL_SECONDS. The exp trees are built here from patches (nothing extra carried beside .fi .sgl).
. lab/call_budget.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "== $gpu"
if echo "$gpu" | grep -q H200; then
  timeout ${HOST_SECONDS:-75} python3 -m bench.host --no-flashinfer --json "$OUT/host.json" > "$OUT/host.txt" 2>&1
  grep -v "^\[" "$OUT/host.txt" | tail -n 22; echo "== bench.host at $(( $(date +%s) - t0 )) s"
fi
. lab/call_stages.sh  # mk
for a in nolds nocvt nostage; do mk f8$a 20261206-fp8-ablate-$a.patch; done
mk base 20261206-mla-lean.patch -R all  # main's MLA kernel before the lean loop (no longer reverses whole after b86e986's key_places)
mk bulk 20261206-mla-bulk-store.patch "" all; mkdir -p exp/mw2 && cp -r kernels cupy_fa bench tests pyproject.toml exp/mw2/
sed -i 's/^MERGE_WIDE = (8, 1)/MERGE_WIDE = (2, 1)/' exp/mw2/cupy_fa/families/mla.py
fits 70 "fp8 ablations" && timeout 70 python3 lab/ab_hopper.py --exact --only prefill_b4_l4096_fp8,prefill_b4_l4096 \
  --kernel-trees exp/f8nolds,exp/f8nocvt,exp/f8nostage --rounds 2 > "$OUT/fp8_ablate.txt" 2>&1
grep -E "^ab|^  prefill" "$OUT/fp8_ablate.txt" | cut -c1-150; echo "== fp8 ablations at $(( $(date +%s) - t0 )) s"
for round in 1 2; do
  for tree in exp/base . exp/bulk exp/mw2; do
    fits $(( ${CHECK_MIN:-400} + 25 )) "MLA r$round $tree" || continue
    (cd $tree && timeout 40 python3 -m bench.mla ${MLA_ONLY:+--only "$MLA_ONLY"} --no-peers --digest 2>&1 \
      | grep -E "^(decode|verify)" | cut -c1-150 | sed "s|^|r$round $tree: |")
  done
done | tee "$OUT/mla_ab.txt"; echo "== MLA A/B at $(( $(date +%s) - t0 )) s"
CHECK_SECONDS=$(( $(left) - 15 )) TEST_SECONDS=${TEST_SECONDS:-300} OUT=$OUT/check bash scripts/device_check.sh all \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh all: exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
