#!/usr/bin/env bash
# The safety checks (bounds, properties, concurrency, the error table) in one GPU run (about 5-7
# minutes on an H200), a table last:
#   1. GPU tests: garbage device metadata (tests/test_bounds_gpu.py), concurrency, the hypothesis
#      properties against float64, the error table's GPU rows, decode == verify invariance;
#   2. the soak: 10,000 engine steps through CUDA graphs, checked every 100 (scripts/soak.py);
#   3. compute-sanitizer's memcheck, racecheck, initcheck, synccheck (scripts/sanitize.sh);
#   4. the bounds checks' cost: decode-like bench cells of the tree before them (exp/base, a copy
#      of cupy_fa/, kernels/ and bench/ of that revision, made beforehand: see below) beside this
#      tree, interleaved (scripts/ab_trees.sh), and this tree / base per cell;
#   5. when time is left: the same bits as that tree (scripts/compare_trees.py exp/base).
# Usage, from the repository root: bash lab/safety_check.sh
#   exp/base beforehand, on a machine with the git history:
#   mkdir -p exp/base && git archive BASE_REV cupy_fa kernels bench | tar -x -C exp/base
# Knobs: SAFETY_SECONDS (the whole call, 540: the A/B gets what is left, skipped under 45 s),
# SAFETY_TEST_SECONDS (90), SOAK_SECONDS (60), SANITIZE_SECONDS (per tool and target, 40),
# AB_WORKLOADS. Logs under $OUT (or ./device_out).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2
table=$OUT/safety_table.txt; : > "$table"
row() { printf "%-11s %-5s %s\n" "$1" "$2" "$3" >> "$table"; }
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1 | sed 's/^/device: /' >> "$table"

python3 scripts/warm_cache.py 2>&1 | tail -n 1
if [ -d exp/base/cupy_fa ]; then (cd exp/base && PYTHONPATH=$PWD python3 ../../scripts/warm_cache.py 2>&1 | tail -n 1); fi

# 1. GPU tests
start=$(date +%s)
# (the invariance tests but their two long-context ones, which device_check.sh runs)
timeout "${SAFETY_TEST_SECONDS:-90}" python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu -rs -k "not 131072" \
  tests/test_bounds_gpu.py tests/test_concurrency_gpu.py tests/test_properties_gpu.py tests/test_errors_table.py \
  tests/test_invariance_gpu.py tests/test_plan.py tests/test_modes_graph_gpu.py::test_refused_row_writes_nan \
  > "$OUT/safety_pytest.log" 2>&1
rc=$?
line=$(tail -n 1 "$OUT/safety_pytest.log")
row tests "$([ $rc = 0 ] && echo ok || echo FAIL)" "$line ($(( $(date +%s) - start )) s)"
grep -E "^(FAILED|ERROR)" "$OUT/safety_pytest.log" | head -n 8 | sed 's/^/            /' >> "$table"

# 2. the soak
start=$(date +%s)
timeout $(( ${SOAK_SECONDS:-60} + 30 )) python3 scripts/soak.py --max-seconds "${SOAK_SECONDS:-60}" \
  --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1
rc=$?
row soak "$([ $rc = 0 ] && echo ok || echo FAIL)" "$(grep -m 1 -E '^soak: [0-9]+ steps' "$OUT/soak.log") ($(( $(date +%s) - start )) s)"
grep -E "^soak: (memory|after|at the end|FAIL|step)" "$OUT/soak.log" | sed 's/^soak: /            /' >> "$table"

# 3. compute-sanitizer
start=$(date +%s)
SANITIZE_SECONDS=${SANITIZE_SECONDS:-40} bash scripts/sanitize.sh "$OUT" > "$OUT/sanitize.log" 2>&1
rc=$?
row sanitizer "$([ $rc = 0 ] && echo ok || echo FAIL)" "four tools over sanitize_cases.py, memcheck + synccheck over the engine ($(( $(date +%s) - start )) s)"
grep -E "^sanitizer " "$OUT/sanitize.log" | sed 's/^sanitizer /            /' >> "$table"

# 4. the checks' cost
left=$(( ${SAFETY_SECONDS:-540} - ($(date +%s) - t0) - 15 ))
if [ -d exp/base/cupy_fa ] && [ "$left" -ge 45 ]; then
  start=$(date +%s)
  workloads=${AB_WORKLOADS:-decode_b64_l4096 decode_b16_l32768 decode_b1_l4096 verify_q4_b64_l4096}
  ROUNDS=2 timeout "$left" bash scripts/ab_trees.sh "exp/base ." $workloads --page-size 16 \
    > "$OUT/ab.log" 2>&1
  python3 - "$OUT/ab_cells.txt" <<'PY' >> "$OUT/ab.log" 2>&1
import collections, glob, json, sys
cells = collections.defaultdict(lambda: {"base": [], "checked": []})
for path in glob.glob("/tmp/abt_*/bench_*.json"):
    tree = "base" if path.split("/")[2].startswith("abt_base_") else "checked"
    for r in json.load(open(path))["rows"]:
        o = r["impls"].get("ours", {})
        if o.get("status") == "ok":
            cells[f"{r['workload']} ps{r['page_size']}"][tree].append(o["value"])
with open(sys.argv[1], "w") as f:
    for cell, v in sorted(cells.items()):
        if v["base"] and v["checked"]:
            b, c = sum(v["base"]) / len(v["base"]), sum(v["checked"]) / len(v["checked"])
            f.write(f"{'':17s} {cell:26s} base {b:.3f}  checked {c:.3f}  checked/base {c / b:.4f}  "
                    f"({len(v['base'])}+{len(v['checked'])} rounds)\n")
        else:
            f.write(f"{'':17s} {cell:26s} a tree's figure is missing (see ab.log)\n")
PY
  row "checks' cost" "" "bench figures (TB/s), base = the tree before the checks ($(( $(date +%s) - start )) s):"
  cat "$OUT/ab_cells.txt" >> "$table" 2>/dev/null || row "" FAIL "no A/B figures (see ab.log)"
elif [ -d exp/base/cupy_fa ]; then
  row "checks' cost" skip "only $left s left of SAFETY_SECONDS"
else
  row "checks' cost" skip "exp/base absent: make it beforehand (see this script's header)"
fi
# 5. the same bits as the tree before the checks (bench shapes, graphs, a random grid), if time is left
left=$(( ${SAFETY_SECONDS:-540} - ($(date +%s) - t0) - 10 ))
if [ -d exp/base/cupy_fa ] && [ "$left" -ge 90 ]; then
  start=$(date +%s)
  timeout "$left" python3 scripts/compare_trees.py exp/base --grid 12 > "$OUT/compare_trees.log" 2>&1
  rc=$?
  row "same bits" "$([ $rc = 0 ] && echo ok || echo FAIL)" "$(grep -E '^[0-9]+ cases: ' "$OUT/compare_trees.log" | tail -n 1) (exit $rc, $(( $(date +%s) - start )) s)"
else
  row "same bits" skip "exp/base absent or only $left s left (scripts/compare_trees.py exp/base does it)"
fi
echo; echo "================ safety_check ($(( $(date +%s) - t0 )) s) ================"; cat "$table"
