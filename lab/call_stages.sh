# Sourced by lab/call_final.sh and lab/call_short.sh (2026-12-06): exp trees built on the device from
# lab/patches (nothing extra carried) and timed beside this tree by lab/ab_hopper.py --kernel-trees.
#   FP8_ABLATE="a b"  the fp8 prefill ablation trees lab/patches/20261206-fp8-ablate-{a,b}.patch (timing only)
#   TAKE_BACK=P.patch this tree against itself with patch P taken back, on AB_ONLY's workloads
#                     (comma-separated whole names)
#   TRY_PATCH=P.patch this tree against a whole tree (package, bench, tests, kernels) with patch P applied,
#                     on AB_ONLY's workloads, then TRY_TESTS (GPU test files) run inside that tree; the A/B
#                     swaps only kernels/ in one process (lab/ab_hopper.py --kernel-trees), so a patch that
#                     changes the package's host mirrors (shared-memory sizes) needs lab/call_candidate.sh
# Needs $OUT and t0 set, the package on PYTHONPATH.
mk() {  # exp/$1: this tree's kernels ($4 = all: and package, bench, tests) with lab/patches/$2 applied ($3 = -R: taken back)
  rm -rf exp/$1; mkdir -p exp/$1; cp -r kernels exp/$1/
  [ "${4:-}" = all ] && cp -r cupy_fa bench tests pyproject.toml exp/$1/
  (cd exp/$1 && patch -s ${3:-} -p1 < ../../lab/patches/$2)
}
ab_trees() {  # $1: a title, $2: --only workloads (whole names), $3: exp trees; two rounds
  timeout ${AB_SECONDS:-60} python3 lab/ab_hopper.py --exact --only "$2" --kernel-trees "$3" --rounds 2 \
    > "$OUT/ab_$1.txt" 2>&1
  grep -E "^ab|^  prefill" "$OUT/ab_$1.txt" | cut -c1-150; echo "== A/B $1 ($3) at $(( $(date +%s) - t0 )) s"
}
ab_stages() {
  if [ -n "${FP8_ABLATE:-}" ]; then
    local trees=""
    for a in $FP8_ABLATE; do mk f8$a 20261206-fp8-ablate-$a.patch && trees="$trees${trees:+,}exp/f8$a"; done
    ab_trees fp8 prefill_b4_l4096_fp8 "$trees"
  fi
  if [ -n "${TAKE_BACK:-}" ]; then mk back "$TAKE_BACK" -R && ab_trees back "${AB_ONLY:-prefill_b4_l4096}" exp/back; fi
  if [ -n "${TRY_PATCH:-}" ]; then
    mk try "$TRY_PATCH" "" all && ab_trees try "${AB_ONLY:-prefill_b4_l4096}" exp/try
    if [ -n "${TRY_TESTS:-}" ]; then
      (cd exp/try && PYTHONPATH=$PWD OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout ${TRY_TEST_SECONDS:-120} \
        python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 -m gpu --timeout 100 $TRY_TESTS) \
        > "$OUT/try_tests.txt" 2>&1
      echo "== exp/try tests ($TRY_TESTS) exit $? at $(( $(date +%s) - t0 )) s"
      grep -E "passed|failed|FAILED|ERROR" "$OUT/try_tests.txt" | tail -n 20
    fi
  fi
}
