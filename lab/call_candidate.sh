#!/usr/bin/env bash
# One GPU call for a candidate change kept as a patch (2026-12-07): `python -m bench.host` first on an
# H200 (lab/call_begin.sh host_bench); then this tree against the candidate tree (exp/try: this tree's
# package, bench, tests and kernels with lab/patches/$CANDIDATE applied) on AB_ONLY's workloads
# (comma-separated), each tree in its own process (the candidate may change the package's host mirrors
# of its kernels, which a kernels-only swap in one process would not see), ROUNDS rounds interleaved,
# odd rounds in reverse order; then CANDIDATE applied to this copy of the working tree itself and
# `scripts/device_check.sh all` run on it in what is left: the check of the tree main would become.
#   CANDIDATE=20261207-trial.patch AB_ONLY=a,b,c CALL_SECONDS=585 bash lab/call_candidate.sh   (carry .fi, .sgl)
CALL_DEFAULT=585 . lab/call_begin.sh
host_bench
. lab/call_stages.sh  # mk
mk try "$CANDIDATE" "" all
for r in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
  order="base try"; [ $(( r % 2 )) = 1 ] && order="try base"
  for t in $order; do
    root=$PWD; [ $t = try ] && root=$PWD/exp/try
    PYTHONPATH=$root timeout ${AB_TREE_SECONDS:-75} python3 lab/ab_hopper.py --exact --only "$AB_ONLY" --points shipped \
      --rounds 1 2>&1 | grep -E "^ab |Error|error" | sed "s/^/$t /; s/ round 0 / round $r /" | tee -a "$OUT/ab_candidate.txt"
  done
done
python3 - "$OUT/ab_candidate.txt" <<'PY'
import collections, sys
vals = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()  # tree, "ab", workload, point ..., value, "TFLOP/s"
    if f[1:2] == ["ab"] and "TFLOP/s" in f:
        vals[(f[2], f[0])].append(float(f[f.index("TFLOP/s") - 1]))
for name in sorted({n for n, _ in vals}):
    base, tr = vals.get((name, "base"), []), vals.get((name, "try"), [])
    if base and tr:
        b, t = sum(base) / len(base), sum(tr) / len(tr)
        print(f"ab-mean {name:28s} base {b:7.1f}  try {t:7.1f}  x{t / b:.3f}  ({len(base)} / {len(tr)} rounds)")
PY
echo "== A/B at $(( $(date +%s) - t0 )) s"
patch -s -p1 < "lab/patches/$CANDIDATE" && echo "== $CANDIDATE applied to the tree at $(( $(date +%s) - t0 )) s"
CHECK_SECONDS=$(( $(left) - 5 )) TEST_SECONDS=${TEST_SECONDS:-330} OUT=$OUT/check bash scripts/device_check.sh all \
  > "$OUT/check.log" 2>&1
echo "== device_check.sh all (the candidate tree): exit $? at $(( $(date +%s) - t0 )) s"
sed -n '/device_check summary/,$p' "$OUT/check.log" | cut -c1-260
echo "== done at $(( $(date +%s) - t0 )) s"
