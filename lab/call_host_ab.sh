#!/usr/bin/env bash
# One GPU call for a host-path candidate (2026-12-07, issue 41): lab/host_copy_probe.py first on the fresh
# machine, then `python -m bench.host` on this tree and on exp/try (this tree's package and tests with
# lab/patches/$CANDIDATE applied), each in its own process, ROUNDS rounds (base try, try base, ...), the
# candidate's GPU tests TRY_TESTS in exp/try, then with what is left (FI_CELLS) `python -m bench` of those
# cells beside FlashInfer.
#   CANDIDATE=20261207-pinned-mirror.patch CALL_SECONDS=420 bash lab/call_host_ab.sh   (carry .fi)
CALL_DEFAULT=420 . lab/call_begin.sh
timeout 40 python3 lab/host_copy_probe.py 2>&1 | tail -n 6; echo "== host_copy_probe at $(( $(date +%s) - t0 )) s"
. lab/call_stages.sh  # mk
mk try "$CANDIDATE" "" all
CELLS=${HOST_CELLS:-"decode_b1_l4096 decode_b64_l4096 decode_b16_l32768 verify_q4_b64_l4096 prefill_b4_l4096 decode_b64_l4096_w1024"}
for r in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
  order="base try"; [ $(( r % 2 )) = 1 ] && order="try base"
  for t in $order; do
    root=$PWD; [ $t = try ] && root=$PWD/exp/try
    PYTHONPATH=$root timeout ${HOST_TREE_SECONDS:-90} python3 -m bench.host --no-flashinfer --no-graph --repeats 300 \
      $CELLS --json "$OUT/host_${t}_$r.json" > "$OUT/host_${t}_$r.txt" 2>&1
    echo "== bench.host $t round $r exit $? at $(( $(date +%s) - t0 )) s"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
vals = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/host_*_*.json")):
    tree = path.rsplit("/", 1)[1].split("_")[1]
    for row in json.load(open(path))["cells"]:
        for k in ("run_us", "plan_us"):
            vals.setdefault((row["workload"], k), {}).setdefault(tree, []).append(row["ours"][k])
print(f"{'cell':28s} {'figure':8s} {'base':>14s} {'try':>14s}  try/base (each round's median us)")
for (cell, k), d in vals.items():
    b, t = d.get("base", []), d.get("try", [])
    if b and t:
        print(f"{cell:28s} {k:8s} {' '.join(f'{x:6.1f}' for x in b):>14s} {' '.join(f'{x:6.1f}' for x in t):>14s}"
              f"  x{statistics.mean(t) / statistics.mean(b):.3f}")
PY
if [ -n "${TRY_TESTS:-}" ]; then
  (cd exp/try && PYTHONPATH=$PWD OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout ${TRY_TEST_SECONDS:-150} \
    python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --timeout 120 $TRY_TESTS) > "$OUT/try_tests.txt" 2>&1
  echo "== exp/try tests ($TRY_TESTS) exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "passed|failed|FAILED|ERROR" "$OUT/try_tests.txt" | tail -n 20
fi
if [ -n "${FI_CELLS:-}" ] && [ "$(left)" -ge 60 ]; then
  if [ -f .fi/flashinfer.tar.xz ]; then
    mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi
  fi
  PYTHONPATH=$PWD:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws timeout $(( $(left) - 5 )) python3 -m bench $FI_CELLS \
    --page-size 16 --quick --no-plot --out "$OUT/fi" > "$OUT/fi_bench.txt" 2>&1
  echo "== bench $FI_CELLS exit $? at $(( $(date +%s) - t0 )) s"; grep -E "ps=16:|ceilings" "$OUT/fi_bench.txt" | cut -c1-300
fi
echo "== done at $(( $(date +%s) - t0 )) s"
