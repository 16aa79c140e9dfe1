#!/usr/bin/env bash
# One bounded GPU call (2026-12-05): any of the GPU suite (scripts/device_check.sh tests), SGLang's kit
# over the matrix for one backend (kit-cupy, kit-triton) or its MLA method (kit-mla), the wgmma A/B
# (lab/ab_hopper.py), the SGLang bench, the prefill bench cells beside FlashInfer (fi), the MLA bench
# and its split sizes (mla), host time per call (host), first calls over empty caches (cold; COLD_PROFILE=1
# adds a cProfile of each first call), ncu of the 128-head MLA seesaw kernel (ncu-mla), of ours beside FlashInfer's
# MLA kernels at decode B=64 L=4096, 128 and 16 heads (ncu-mla-peer; .fi carried), and of the wgmma prefill
# kernel, plain / fp8 / soft-capped (ncu-prefill), the MLA bench
# over copies of other revisions, interleaved (ab-mla-trees: AB_MLA_TREES, AB_MLA_ONLY, AB_MLA_ROUNDS), the GPU
# tests of such a copy (tree-tests: TREE, TESTS), the EAGLE draft chain probe (eagle-probe). Stages
# run in the order given; each is bounded by `timeout`, and the
# logs go to $OUT as one archive (logs.tgz) beside summary.txt.
# Usage, from the repository root (carry .sgl for the suite / kit / sglang stages, .fi for fi / mla):
#   STAGES="suite kit-cupy ab" bash lab/suite_kit_check.sh
# Knobs: TEST_SECONDS (suite's pytest, 340: about 275 s on an H100 with 8 workers), KIT_CONFIGS, KIT_BUDGET (s, 120), AB_ONLY (cap50,fp8),
# AB_SECONDS (100), BENCH_CELLS (fi), FI_SECONDS (420: FlashInfer's JIT builds take 76-86 s a cell on the
# device image, 2026-12-06), TESTS (stage "tests": pytest files), HOST_CELLS,
# HOST_FI (1: FlashInfer's run beside ours), HOST_SECONDS (150).
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
export TRITON_CACHE_DIR=/tmp/triton_cache
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/summary.txt"; }
git log --oneline -1 2>/dev/null | tee -a "$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
KIT_CONFIGS=${KIT_CONFIGS:-d64-bf16-kit,d256-bf16-kit,d64-fp16-p64,d256-fp16-p64,d128-bf16-p64}
SGL_PATH=""
sgl_site() {  # SGLang 0.5.17's wheels (scripts/pack_sglang.sh), once per machine
  SGL_PATH=/tmp/sgl-site
  [ -d /tmp/sgl-site/sglang ] || timeout 90 python3 scripts/sgl_wheels.py --install /tmp/sgl-site > /dev/null \
    || echo "PIP INSTALL FAILED" | tee -a "$OUT/summary.txt"
}
fi_site() {
  [ -d /tmp/fi/flashinfer ] || { mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi; }
}
kit() {  # kit for backend $1 over $KIT_CONFIGS
  sgl_site
  stamp "kit $1: $KIT_CONFIGS"
  PYTHONPATH=/tmp/sgl-site:$PWD OPENBLAS_NUM_THREADS=1 timeout $(( ${KIT_BUDGET:-120} + 40 )) \
    python3 tests/sglang_harness/run_kit.py --backends "$1" --configs "$KIT_CONFIGS" --budget "${KIT_BUDGET:-120}" \
    --json "$OUT/kit_$1.json" > "$OUT/kit_$1.txt" 2>&1
  echo "kit $1 exit $?" | tee -a "$OUT/summary.txt"
  grep -E "^(FAIL|SKIP|NOT|TOTAL)|passed" "$OUT/kit_$1.txt" | head -40 | tee -a "$OUT/summary.txt"
}
for stage in ${STAGES:-suite}; do
  case $stage in
    suite)
      stamp "suite"
      TEST_SECONDS=${TEST_SECONDS:-340} CHECK_SECONDS=$(( ${TEST_SECONDS:-340} + 90 )) OUT=$OUT/suite \
        bash scripts/device_check.sh tests > "$OUT/suite.log" 2>&1
      echo "suite exit $?" | tee -a "$OUT/summary.txt"
      grep -vE "^(DECODE|DRAFT|EXTEND|IDLE|MIXED|TARGET|mode |-)" "$OUT/suite/summary.txt" | head -60 | tee -a "$OUT/summary.txt" ;;
    tests)
      stamp "tests: ${TESTS:-}"
      [ -d .sgl ] && sgl_site
      PYTHONPATH=$PWD${SGL_PATH:+:$SGL_PATH} OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout ${TEST_SECONDS:-150} python3 -m pytest -q -p no:cacheprovider \
        -n 8 -m gpu --timeout 120 -rs ${TESTS:-} > "$OUT/tests.log" 2>&1  # (TESTS may add -rP for the prints)
      echo "tests exit $?: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
      grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 | tee -a "$OUT/summary.txt" ;;
    kit-cupy) kit cupy_fa ;;
    kit-triton) kit triton ;;
    kit-mla)  # SGLang's MLA method for cupy_fa and triton (kv_lora_rank 512 + rope 64)
      sgl_site
      stamp "kit mla: ${KIT_MLA_CONFIGS:-d128-bf16-p64,d128-fp16-kit}"
      PYTHONPATH=/tmp/sgl-site:$PWD OPENBLAS_NUM_THREADS=1 timeout $(( ${KIT_BUDGET:-120} + 40 )) \
        python3 tests/sglang_harness/run_kit.py --method mla --backends cupy_fa,triton \
        --configs "${KIT_MLA_CONFIGS:-d128-bf16-p64,d128-fp16-kit}" --budget "${KIT_BUDGET:-120}" \
        --json "$OUT/kit_mla.json" > "$OUT/kit_mla.txt" 2>&1
      echo "kit mla exit $?" | tee -a "$OUT/summary.txt"
      grep -E "^(FAIL|SKIP|NOT|TOTAL)|passed" "$OUT/kit_mla.txt" | head -40 | tee -a "$OUT/summary.txt" ;;
    mla)  # the MLA bench beside FlashInfer (with each output's digest), then the 128-head cells at the splits in MLA_SPLITS (ours)
      fi_site
      stamp "mla bench"
      PYTHONPATH=$PWD:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws timeout ${MLA_SECONDS:-200} python3 -m bench.mla \
        --digest --json "$OUT/mla.json" > "$OUT/mla.txt" 2>&1
      echo "mla bench exit $?" | tee -a "$OUT/summary.txt"
      grep -E "^(decode|verify|fp8|ceilings)" "$OUT/mla.txt" | cut -c1-230 | tee -a "$OUT/summary.txt"
      for split in ${MLA_SPLITS:-}; do
        CUPY_FA_MLA_SPLIT_SIZE=$split timeout 60 python3 -m bench.mla --only "H=128" --no-peers 2>&1 \
          | grep -E "^(decode|verify)" | cut -c1-110 | sed "s/^/split $split: /" | tee -a "$OUT/summary.txt"
      done ;;
    ab)
      stamp "ab ${AB_ONLY:-cap50,fp8}"
      timeout ${AB_SECONDS:-100} python3 lab/ab_hopper.py --only "${AB_ONLY:-cap50,fp8}" --rounds ${AB_ROUNDS:-2} \
        --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
      echo "ab exit $?" | tee -a "$OUT/summary.txt"
      grep -E "^ab |^  " "$OUT/ab.txt" | tail -40 | tee -a "$OUT/summary.txt" ;;
    sglang-bench)
      sgl_site
      stamp "sglang bench"
      PYTHONPATH=/tmp/sgl-site:$PWD timeout ${SGL_BENCH_SECONDS:-120} python3 -m bench.sglang --json "$OUT/sglang_bench.json" \
        > "$OUT/sglang_bench.txt" 2>&1
      echo "sglang bench exit $?" | tee -a "$OUT/summary.txt"
      grep -viE "warn" "$OUT/sglang_bench.txt" | tail -16 | tee -a "$OUT/summary.txt" ;;
    fi)
      fi_site
      stamp "bench beside FlashInfer: ${BENCH_CELLS:-}"
      PYTHONPATH=$PWD:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws timeout ${FI_SECONDS:-420} python3 -m bench \
        ${BENCH_CELLS:-prefill_b4_l4096 prefill_b4_l4096_cap50 prefill_b4_l4096_fp8} --page-size 16 --quick --no-plot \
        --out "$OUT/bench" > "$OUT/bench.txt" 2>&1
      echo "bench exit $?" | tee -a "$OUT/summary.txt"
      sed -n '/^workload /,$p' "$OUT/bench.txt" | tee -a "$OUT/summary.txt" ;;
    host)  # host time per call (ours; FlashInfer's with HOST_FI=1 and .fi carried) and the GraphRunner steps
      stamp "host: ${HOST_CELLS:-decode_b64_l4096 prefill_b4_l4096}"
      [ -n "${HOST_FI:-}" ] && fi_site
      PYTHONPATH=$PWD:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws timeout ${HOST_SECONDS:-150} python3 -m bench.host \
        ${HOST_CELLS:-decode_b64_l4096 prefill_b4_l4096} --page-size 16 $([ -n "${HOST_FI:-}" ] || echo --no-flashinfer) \
        --json "$OUT/host.json" > "$OUT/host.txt" 2>&1
      echo "host exit $?" | tee -a "$OUT/summary.txt"
      tail -n 24 "$OUT/host.txt" | tee -a "$OUT/summary.txt" ;;
    cold)  # first calls over empty caches (prefill, decode, MLA decode) and warmup() on every core
      stamp "cold start"
      timeout ${COLD_SECONDS:-150} python3 scripts/cold_compile.py --no-serial --json "$OUT/cold.json" > "$OUT/cold.txt" 2>&1
      echo "cold exit $?" | tee -a "$OUT/summary.txt"
      tail -n 16 "$OUT/cold.txt" | tee -a "$OUT/summary.txt" ;;
    ncu-mla-peer)  # ours and FlashInfer's MLA kernels on one cell each (lab/probe_mla_peer.py): where each spends its time
      fi_site
      for cell in "decode B=64 L=4096 H=128" "decode B=64 L=4096 H=16"; do
        stamp "ncu mla peer: $cell"
        log="$OUT/ncu_mla_peer_$(echo "$cell" | tr -c 'A-Za-z0-9=\n' '_').txt"
        PYTHONPATH=$PWD:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws timeout ${NCU_SECONDS:-240} ncu --profile-from-start off \
          --clock-control none --set full python3 lab/probe_mla_peer.py --cell "$cell" > "$log" 2>&1
        echo "ncu mla peer exit $?" | tee -a "$OUT/summary.txt"
        grep -E "Context [0-9]+, Stream|^ *(Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|L2 Cache Throughput|L1/TEX Hit Rate|Compute \(SM\) Throughput|Executed Ipc Active|Issue Slots Busy|Executed Instructions|Registers Per Thread|Dynamic Shared Memory Per Block|Grid Size|Achieved Occupancy|Warp Cycles Per Issued Instruction|No Eligible) " \
          "$log" | cut -c1-150 | tee -a "$OUT/summary.txt"
      done ;;
    ncu-mla)  # where the 128-head seesaw kernel's warps wait (decode B=64 L=4096): full set + SASS stall samples
      stamp "ncu mla: ${NCU_MLA_CELL:-decode B=64 L=4096 H=128}"
      timeout ${NCU_SECONDS:-240} ncu --clock-control none -k regex:mla_wgmma_kernel -s 2 -c 1 --set full \
        --import-source no -f -o /tmp/ncu_mla python3 -m bench.mla --only "${NCU_MLA_CELL:-decode B=64 L=4096 H=128}" \
        --no-peers --reps 1 --launches 1 > "$OUT/ncu_mla_run.txt" 2>&1
      echo "ncu mla exit $?" | tee -a "$OUT/summary.txt"
      ncu --import /tmp/ncu_mla.ncu-rep --print-details all > "$OUT/ncu_mla.txt" 2>&1
      ncu --import /tmp/ncu_mla.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_mla_sass.csv" 2>&1
      grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Registers|Achieved Occupancy|Issue Slots|Issued Ipc|Stall|Warp Cycles Per|L2 Hit|Tensor|pipe|Eligible|No Eligible|Active Warps" \
        "$OUT/ncu_mla.txt" | head -60 | tee -a "$OUT/summary.txt"
      python3 lab/ncu_sass_top.py "$OUT/ncu_mla_sass.csv" 2>&1 | head -40 | tee -a "$OUT/summary.txt" ;;
    ncu-prefill)  # the wgmma prefill kernel's pipes, stalls and shared-memory traffic: plain, fp8 KV, soft-cap 50
      for cell in ${NCU_PREFILL_CELLS:-prefill_b4_l4096 prefill_b4_l4096_fp8 prefill_b4_l4096_cap50}; do
        stamp "ncu prefill: $cell"
        timeout ${NCU_SECONDS:-90} ncu --clock-control none -k regex:prefill_sm90 -c 1 --section SpeedOfLight \
          --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section InstructionStats \
          --section MemoryWorkloadAnalysis_Tables --metrics smsp__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum \
          python3 lab/ab_hopper.py --once --exact --only $cell > "$OUT/ncu_$cell.txt" 2>&1
        echo "ncu $cell exit $?" | tee -a "$OUT/summary.txt"
        grep -E "Duration|Compute \(SM\) Throughput|Registers Per|Issue Slots Busy|Issued Ipc|No Eligible|Eligible Warps|Warp Cycles Per Issued|Stall|pipe_|gmma|bank_conflicts|inst_executed.sum|Shared .*(Wavefronts|Conflicts)" \
          "$OUT/ncu_$cell.txt" | head -40 | tee -a "$OUT/summary.txt"
      done ;;
    ab-mla-trees)  # the MLA bench (ours) in exp/base (a copy of another revision, carried) and here, interleaved
      stamp "ab mla trees: ${AB_MLA_TREES:-exp/base .} (${AB_MLA_ONLY:-H=128})"
      for round in $(seq ${AB_MLA_ROUNDS:-2}); do
        for tree in ${AB_MLA_TREES:-exp/base .}; do
          (cd $tree && PYTHONPATH=$PWD timeout ${AB_MLA_SECONDS:-90} python3 -m bench.mla --only "${AB_MLA_ONLY:-H=128}" \
            --no-peers --digest 2>&1 | grep -E "^(decode|verify|fp8)" | cut -c1-150 | sed "s|^|r$round $tree: |") | tee -a "$OUT/summary.txt"
        done
      done ;;
    tree-tests)  # GPU tests of a carried tree (TREE, e.g. exp/epi with its tests/ and pyproject.toml): TESTS
      stamp "tree tests: ${TREE:-.} ${TESTS:-}"
      (cd ${TREE:-.} && PYTHONPATH=$PWD OMP_NUM_THREADS=2 timeout ${TEST_SECONDS:-150} python3 -m pytest -q -p no:cacheprovider \
        -n 8 -m gpu --timeout 120 -rs ${TESTS:-}) > "$OUT/tree_tests.log" 2>&1
      echo "tree tests exit $?: $(tail -n 1 "$OUT/tree_tests.log")" | tee -a "$OUT/summary.txt"
      grep -E "^(FAILED|ERROR)" "$OUT/tree_tests.log" | head -20 | tee -a "$OUT/summary.txt" ;;
    eagle-probe)  # SGLang's MLA EAGLE draft chain case alone, attention calls eager against graph (lab/eagle_chain_probe.py)
      sgl_site
      stamp "eagle probe"
      PYTHONPATH=/tmp/sgl-site:$PWD OPENBLAS_NUM_THREADS=1 timeout ${PROBE_SECONDS:-150} python3 lab/eagle_chain_probe.py \
        > "$OUT/eagle_probe.txt" 2>&1
      echo "eagle probe exit $?" | tee -a "$OUT/summary.txt"
      grep -E "^==|^   |Error" "$OUT/eagle_probe.txt" | cut -c1-400 | head -40 | tee -a "$OUT/summary.txt" ;;
    *) echo "unknown stage $stage" | tee -a "$OUT/summary.txt" ;;
  esac
done
stamp "done"
cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt . 2>/dev/null \
  && find . -mindepth 1 -not -name logs.tgz -not -name summary.txt -delete
