#!/usr/bin/env bash
# The whole GPU check in one call: environment, GPU test suite, demo, benchmarks.
# Usage on the device machine, from the repo root:
#   bash scripts/device_check.sh [STAGES] [pytest -k expr]
# STAGES: "all" (tests demo engine bench; the default) or a quoted list of tests, demo, engine,
# ab (knob A/B, tuning only), ncu (hardware counters, diagnosis only), sanitizer (compute-sanitizer's
# four tools over scripts/sanitize_cases.py and the example engine, about 2-3 minutes), soak (10,000
# engine steps through graphs, scripts/soak.py, about 2 minutes), bench. After "ab" the bench runs
# with the best knobs it found.
# Knobs: CHECK_SECONDS (whole call, default 560), TEST_SECONDS (pytest, default 300), BENCH_ARGS,
# AB_SETTINGS, AB_WORKLOADS, AB_ARGS (scripts/ab_decode.sh), AB_APPLY (0: the bench after "ab" runs
# at the defaults, not at the A/B's pick), EXPECT_TESTS (the number of GPU tests the run must
# collect, e.g. when a run is to be compared with the count of a branch), CUPY_FA_SEED (replay
# the seed a failure printed: tests/cases.py).
# On a GPU machine no GPU test may skip: a skip (a broken driver, a missing device) is an error
# here, as is a failure, an error or a count other than EXPECT_TESTS; the script then exits 1.
# Logs go under $OUT (or ./device_out); the summary table is printed last.
# .fi/ (FlashInfer, scripts/pack_flashinfer.sh) and .sgl/ (SGLang 0.5.17's wheels, scripts/pack_sglang.sh)
# are used where a checkout has them; without .sgl/ the SGLang backend's GPU tests are not collected
# and the summary says so.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache} CUPY_FA_CACHE_DIR=${CUPY_FA_CACHE_DIR:-/tmp/cupy_fa_cache}
stages=${1:-all}; kexpr=${2:-}
want() { [[ " $stages " == *" $1 "* ]] || { [ "$stages" = all ] && [[ " ab ncu sanitizer soak " != *" $1 "* ]]; }; }
t0=$(date +%s); limit=${CHECK_SECONDS:-560}  # the whole run's budget: the bench gets what is left
summary=$OUT/summary.txt; : > "$summary"
check_failed=0  # 1 once a stage that checks something (the GPU tests) found a problem

if [ -f .fi/flashinfer.tar.xz ]; then  # FlashInfer as an archive (scripts/pack_flashinfer.sh)
  mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws
else  # the archive is git-ignored: a checkout has it only where it was copied in
  echo "flashinfer: .fi/flashinfer.tar.xz absent: the bench runs without it" >> "$summary"
fi

sglang_ignore=()  # SGLang 0.5.17 and what its attention kit's import needs, as wheels (scripts/pack_sglang.sh)
sgl_status=0  # .sgl/*.whl, or .sgl/wheels.tar.xz made into wheels, installed (1: none carried, 2: pip failed)
sgl_wheels=$(python3 scripts/sgl_wheels.py --install /tmp/sgl-site) || sgl_status=$?
if [ $sgl_status = 0 ]; then
  export PYTHONPATH=/tmp/sgl-site:$PYTHONPATH
elif [ $sgl_status = 2 ]; then
  echo "ERROR: sglang: installing $sgl_wheels/*.whl failed" >> "$summary"; check_failed=1
else  # never a silent skip: say which GPU tests were left out
  sglang_ignore=(--ignore=tests/test_sglang_graph_gpu.py)
  echo "sglang: .sgl/ absent (scripts/pack_sglang.sh makes it): tests/test_sglang_graph_gpu.py, the SGLang" \
       "backend's 8 GPU tests, not collected" >> "$summary"
fi

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c 'import cupy, numpy, torch; print("cupy", cupy.__version__, "numpy", numpy.__version__, "torch", torch.__version__)'
} 2>&1 | tee -a "$summary"

if want tests; then
  start=$(date +%s)
  export CUPY_FA_REPORT=/tmp/modes.jsonl; : > "$CUPY_FA_REPORT"
  export CUPY_FA_FP8_REPORT=/tmp/fp8_modes.jsonl; : > "$CUPY_FA_FP8_REPORT"  # fp8 against 16-bit per mode
  export CUPY_FA_FAILURE_LOG=$OUT/failures.log; : > "$CUPY_FA_FAILURE_LOG"  # reasons, written as they happen
  python3 scripts/warm_cache.py  # every variant into the disk cache once, 8 processes, before the workers
  # GPU tests only (CI runs the CPU ones); -v so a log cut short still names each result;
  # bounded so the demo, engine and bench still get their share of the call
  # 8 pytest workers share 16 cores: 2 BLAS threads each (the bench's fp64 reference keeps them all).
  # The CPU-only modules (tests/*_cpu.py, never a GPU test: tests/test_cuda_probe_cpu.py checks) are
  # not collected: their imports (psutil for the transformers CPU test) need not exist here.
  OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout ${TEST_SECONDS:-300} python3 -m pytest -v -p no:cacheprovider -p no:benchmark -n 8 -m gpu --timeout 240 \
    --ignore-glob='*_cpu.py' ${sglang_ignore[@]+"${sglang_ignore[@]}"} tests ${kexpr:+-k "$kexpr"} -rs --durations=10 --junitxml="$OUT/junit.xml" > "$OUT/pytest.log" 2>&1
  test_rc=$?
  grep -E "FAILED|ERROR|Timeout" "$OUT/pytest.log" | head -20 >> "$summary"
  [ -s "$CUPY_FA_FAILURE_LOG" ] && { echo "failure reasons (first lines each):"; grep -A3 "^====" "$CUPY_FA_FAILURE_LOG" | head -40; } >> "$summary"
  echo "pytest: $(tail -n 1 "$OUT/pytest.log") ($(( $(date +%s) - start )) s)" >> "$summary"
  # the counts from the JUnit file: on the GPU machine every GPU test runs, none skips
  counts=$(python3 scripts/junit_counts.py "$OUT/junit.xml")
  read -r n_tests n_failed n_errors n_skipped _ <<< "$counts"
  echo "GPU tests: $n_tests collected, $n_failed failed, $n_errors errors, $n_skipped skipped${EXPECT_TESTS:+ (expected $EXPECT_TESTS)}" >> "$summary"
  if [ "$n_tests" = -1 ]; then
    echo "ERROR: no counts in $OUT/junit.xml (pytest cut short by TEST_SECONDS?): $counts" >> "$summary"; check_failed=1
  elif [ "$n_skipped" != 0 ]; then
    { echo "ERROR: $n_skipped GPU tests skipped; on a GPU machine none may (a skip here is a broken setup):"
      grep -E "^SKIPPED" "$OUT/pytest.log" | head -20; } >> "$summary"
    check_failed=1
  fi
  if [ "$test_rc" != 0 ] || [ "$n_failed" != 0 ] || [ "$n_errors" != 0 ] || [ "$n_tests" -le 0 ]; then
    echo "ERROR: the GPU tests did not all pass (pytest exit $test_rc)" >> "$summary"; check_failed=1
  fi
  if [ -n "${EXPECT_TESTS:-}" ] && [ "$n_tests" != "$EXPECT_TESTS" ]; then
    echo "ERROR: $n_tests GPU tests collected, $EXPECT_TESTS expected" >> "$summary"; check_failed=1
  fi
  python3 scripts/modes_table.py "$CUPY_FA_REPORT" >> "$summary"
  python3 scripts/fp8_modes_table.py "$CUPY_FA_FP8_REPORT" >> "$summary"
fi
if want demo; then
  python3 -m cupy_fa.demo 2>&1 | tee "$OUT/demo.log"
  echo "demo:" >> "$summary"; sed -n '/^== summary/,$p' "$OUT/demo.log" >> "$summary"
fi
if want engine; then
  python3 examples/engine.py 2>&1 | tee "$OUT/engine.log"
  echo "engine (examples/engine.py, exit $?):" >> "$summary"; tail -n 25 "$OUT/engine.log" >> "$summary"
fi
if want sanitizer; then  # memcheck, racecheck, initcheck, synccheck: one line each in the summary
  start=$(date +%s)
  bash scripts/sanitize.sh "$OUT" > "$OUT/sanitizer.log" 2>&1; rc=$?
  { echo "sanitizer (exit $rc, $(( $(date +%s) - start )) s):"; grep -E "^sanitizer|^    " "$OUT/sanitizer.log"; } >> "$summary"
  [ "$rc" = 0 ] || check_failed=1
fi
if want soak; then  # a simulated engine through graphs, checked against float64 every 100 steps
  python3 scripts/soak.py --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1; rc=$?
  { echo "soak (exit $rc):"; grep -E "^soak:" "$OUT/soak.log"; } >> "$summary"
  [ "$rc" = 0 ] || check_failed=1
fi
if want ab; then  # tuning only: knob A/B, ours alone (scripts/ab_decode.sh)
  IFS=';' read -ra ab_settings <<< "${AB_SETTINGS:-}"  # "stages split warps_m per_cta pdl fold;..." (or its defaults)
  bash scripts/ab_decode.sh /tmp/best_knobs.sh "${ab_settings[@]}" 2>&1 | tee -a "$summary"
  if [ "${AB_APPLY:-1}" = 1 ] && [ -f /tmp/best_knobs.sh ]; then  # AB_APPLY=0: the bench keeps the defaults
    source /tmp/best_knobs.sh && echo "bench runs with: $(cat /tmp/best_knobs.sh)" >> "$summary"
  fi
fi
if want ncu; then  # diagnosis only: hardware counters of ours and of FlashInfer, page 16, into one file
  # NCU_EXTRA: more sections (e.g. "--section InstructionStats --section SourceCounters"); NCU_METRICS:
  # a comma list of metrics for one more pass of its own (a name ncu lacks fails only that pass);
  # NCU_SOURCE=1: one more pass whose per-instruction SASS counts and stall samples go to sass_*.csv;
  # NCU_KERNELS: our kernels' regex, the first the one the stall and source passes read (default
  # attention_kernel|merge_kernel; the sm90 prefill tile is prefill_sm90_kernel)
  export NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis ${NCU_EXTRA:-}"
  NCU_STALLS=smsp__warps_eligible.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active
  for reason in long_scoreboard short_scoreboard barrier mio_throttle math_pipe_throttle wait lg_throttle \
                not_selected selected no_instruction dispatch_stall; do
    NCU_STALLS=$NCU_STALLS,smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio
  done
  ncu_pass() {  # one ncu pass over the bench of workload $w ($who, $flags): a title word, then ncu's options
    echo "==== ncu ${1:+$1 }$who $w" >> "$OUT/ncu.txt"; shift
    timeout 150 ncu --clock-control none "$@" \
      python3 -m bench $w --page-size 16 --quick $flags --no-ceilings --no-plot --out /tmp/ncu_bench >> "$OUT/ncu.txt" 2>&1
  }
  for w in ${NCU_WORKLOADS:-decode_b64_l4096 verify_q8_b64_l4096}; do
    for who in ${NCU_WHO:-ours flashinfer}; do
      if [ $who = ours ]; then kernels=${NCU_KERNELS:-attention_kernel|merge_kernel}; flags=--no-peers
      else kernels='BatchPrefill|BatchDecode|MergeStates'; flags=; fi
      ncu_pass "" -k "regex:$kernels" -c 2 $NCU_SECTIONS
      # where the attention kernel's warps wait: issue-stall reasons, cycles per issued instruction
      ncu_pass stalls -k "regex:${kernels%%|*}" -c 1 --metrics "$NCU_STALLS"
      if [ -n "${NCU_METRICS:-}" ]; then ncu_pass metrics -k "regex:${kernels%%|*}" -c 1 --metrics "$NCU_METRICS"; fi
      if [ "${NCU_SOURCE:-0}" = 1 ]; then  # per-instruction counts and stall samples (SASS), one CSV each
        ncu_pass source -k "regex:${kernels%%|*}" -c 1 --section SourceCounters --section WarpStateStats \
          -f -o "/tmp/ncu_source_${who}_$w"
        ncu --import "/tmp/ncu_source_${who}_$w.ncu-rep" --page source --csv --print-source sass \
          > "$OUT/sass_${who}_$w.csv" 2>> "$OUT/ncu.txt"
      fi
    done
  done
  echo "ncu (key lines; whole report in ncu.txt):" >> "$summary"
  grep -E "^==== ncu|^  [a-zA-Z_].*(Kernel|kernel)|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit|Waves Per SM|L2 Hit|L1/TEX Hit|stalled|warps_eligible|issue_active|inst_executed|bank_conflicts|Executed Instructions|Branch Instructions" "$OUT/ncu.txt" >> "$summary"
fi
if want bench; then
  left=$(( limit - ($(date +%s) - t0) - 20 ))
  # --budget starts no new workload late; the timeout ends one that runs long (a peer's JIT build of
  # minutes in its first prefill cell), so the summary below is always printed within CHECK_SECONDS
  timeout $(( left > 70 ? left + 10 : 80 )) python3 -m bench --out "$OUT" --budget $(( left > 60 ? left - 60 : 10 )) \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
  [ "$bench_rc" = 124 ] && echo "bench: stopped at CHECK_SECONDS (exit 124); the cells above are whole" >> "$summary"
  echo "bench (last table):" >> "$summary"; tail -n 40 "$OUT/bench.log" | grep -v "flashinfer.jit" >> "$summary"
fi
echo; echo "================ device_check summary ================"; cat "$summary"
exit $check_failed
