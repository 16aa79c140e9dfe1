#!/usr/bin/env bash
# The prefill family behind BatchAttention (the sm_90a wgmma kernel for every request of more than
# 16 tokens on Hopper, the small-q tiles for the rest), checked on one GPU in one call (~6 min):
#   1. cold NVRTC: first prefill / decode / mixed calls and the whole warmup() from an empty cache,
#      then warm (scripts/cold_compile.py; alone on the machine, so the figures are clean);
#   2. every variant of this tree (and of OLD_TREE) into the disk cache; FlashInfer's JIT modules for
#      the bench cells built in the background (one process per module: bf16 D 64 / 128 / 256, fp16);
#   3. the GPU tests of the two-family dispatch and of what it touches (mixed steps' small-q rows
#      bit-identical to pure decode, long rows against float64, graphs, plan, invariance, the sm_90a
#      family), and at the same time scripts/compare_trees.py OLD_TREE --small-q: every decode-like
#      shape bit for bit and with the same schedule as OLD_TREE;
#   4. the bench cells beside FlashInfer and SDPA cuDNN: prefill_b4_l4096, prefill_b2_l8192,
#      extend_b4_q1024_l16384 (page 16 and 1), D 64 / 256, non-causal, fp16, the long-prefix extend
#      and the ragged mixed batch (page 16);
# then a short table last.
# Usage on the device machine, from the repo root (FlashInfer when .fi/flashinfer.tar.xz is present, as device_check.sh):
#   bash lab/prefill_family_check.sh [OLD_TREE]
# OLD_TREE (default exp/base): a directory with the old revision's cupy_fa/, kernels/ and bench/, made
# before the call with `mkdir -p exp/base && git archive a1fec95 | tar -x -C exp/base` (untracked: it
# travels with the tree); without it step 3 skips the comparison and says so.
# Knobs: TEST_SECONDS (150), COMPARE_SECONDS (150), BENCH_SECONDS (80: page 16), BENCH1_SECONDS (35: page 1),
# GRID (12 random cases), COLD (1; 0 skips step 1), TESTS (the GPU test files of step 3), FI_WARM (the bench
# cells whose FlashInfer modules step 2 builds; FI_WARM_SECONDS, 300, bounds each), PS16_CELLS / PS1_CELLS (the
# bench cells of step 4: page size 1 first). TESTS=none skips the GPU tests (a run right after the whole suite).
# The run keeps at most 8 files under $OUT: the warm-up logs stay in /tmp (their tails in one file).
# Cost (H200, 2026-12-02): our 255 variants compile in 48 s alone but took 258 s beside eleven
# FlashInfer JIT builds, which left the bench 290 s of a 590 s call for 9 cells: warm few modules a call.
set -uo pipefail
old=${1:-exp/base}
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
summary=$OUT/summary.txt; : > "$summary"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$summary"; }

if [ -f .fi/flashinfer.tar.xz ]; then  # FlashInfer as an archive (scripts/pack_flashinfer.sh)
  mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws
else
  echo "flashinfer: .fi/flashinfer.tar.xz absent: the bench runs without it" | tee -a "$summary"
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c 'import cupy, torch; print("cupy", cupy.__version__, "torch", torch.__version__)'
  git log -1 --format='tree %h %s' 2>/dev/null || true
} 2>&1 | tee -a "$summary"

if [ "${COLD:-1}" = 1 ]; then
  stamp "1. cold NVRTC (empty caches, alone)"
  timeout 150 python3 scripts/cold_compile.py --json "$OUT/cold_compile.json" > "$OUT/cold_compile.txt" 2>&1
  echo "cold_compile exit $?" >> "$summary"; cat "$OUT/cold_compile.txt" >> "$summary"
fi

stamp "2. kernel caches; FlashInfer JIT in the background"
fi_pids=()
if python3 -c 'import flashinfer' 2>/dev/null; then
  mkdir -p /tmp/fi_warm_logs
  for w in ${FI_WARM:-prefill_b4_l4096 prefill_b2_l8192_d64 prefill_b2_l8192_d256 prefill_b2_l8192_fp16}; do
    timeout ${FI_WARM_SECONDS:-300} python3 -m bench "$w" --page-size 16 --quick --no-ceilings --no-plot --launches 4 \
      --reps 2 --warmup 1 --out /tmp/fi_warm > "/tmp/fi_warm_logs/$w.log" 2>&1 &
    fi_pids+=($!)
  done
fi
python3 scripts/warm_cache.py 6 > /tmp/warm_new.log 2>&1 &
warm_new=$!
if [ -d "$old/cupy_fa" ]; then (PYTHONPATH=$old python3 scripts/warm_cache.py 4 > /tmp/warm_old.log 2>&1); fi
wait $warm_new
tail -n 1 /tmp/warm_new.log /tmp/warm_old.log 2>/dev/null >> "$summary"

stamp "3. GPU tests, and compare_trees $old --small-q beside them"
if [ -d "$old/cupy_fa" ]; then
  timeout ${COMPARE_SECONDS:-150} python3 scripts/compare_trees.py "$old" --small-q --grid ${GRID:-12} \
    --out /tmp/compare_trees > "$OUT/compare_trees.txt" 2>&1 &
  compare=$!
else
  echo "compare_trees: $old is not a tree (make it: mkdir -p exp/base && git archive a1fec95 | tar -x -C exp/base)" \
    | tee -a "$summary"
  compare=
fi
export CUPY_FA_FAILURE_LOG=$OUT/failures.log; : > "$CUPY_FA_FAILURE_LOG"
if [ "${TESTS:-}" = none ]; then
  echo "GPU tests: skipped (TESTS=none)" >> "$summary"
else
  OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout ${TEST_SECONDS:-150} \
    python3 -m pytest -v -p no:cacheprovider -n 6 -m gpu --timeout 120 -rs --durations=10 \
    ${TESTS:-tests/test_mixed_families_gpu.py tests/test_plan.py tests/test_prefill_sm90_gpu.py tests/test_invariance_gpu.py
    tests/test_modes_graph_gpu.py tests/test_attention_gpu.py} > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >> "$summary"
  grep -E "FAILED|ERROR|Timeout" "$OUT/pytest.log" | head -20 >> "$summary"
  [ -s "$CUPY_FA_FAILURE_LOG" ] && { echo "failure reasons (first lines each):"; grep -A4 "^====" "$CUPY_FA_FAILURE_LOG" | head -40; } >> "$summary"
  echo "pytest: $(tail -n 1 "$OUT/pytest.log")" >> "$summary"
fi
if [ -n "$compare" ]; then
  wait $compare; echo "compare_trees exit $?" >> "$summary"
  cp /tmp/compare_trees/*.log "$OUT/" 2>/dev/null
  grep -E "differ|shape!|ERROR|CHANGED|NaN|cases:|exited" "$OUT/compare_trees.txt" | tail -n 20 >> "$summary"
fi

stamp "4. bench beside the peers"
for pid in "${fi_pids[@]}"; do wait "$pid"; done
for f in /tmp/fi_warm_logs/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 4 "$f"; }; done > "$OUT/fi_warm.log" 2>&1
grep -h "first_use\|flashinfer" /tmp/fi_warm_logs/*.log 2>/dev/null | grep -v "^\[" | head -8 >> "$summary"
targets="prefill_b4_l4096 prefill_b2_l8192 extend_b4_q1024_l16384"
python3 -m bench ${PS1_CELLS:-$targets} --page-size 1 --no-ceilings --no-plot --budget ${BENCH1_SECONDS:-35} \
  --out "$OUT/bench_ps1" > "$OUT/bench_ps1.log" 2>&1
echo "bench page 1 exit $?" >> "$summary"
python3 -m bench ${PS16_CELLS:-$targets prefill_b2_l8192_d64 prefill_b2_l8192_d256 prefill_b2_l8192_full prefill_b2_l8192_fp16
  extend_b8_q512_l8192 mixed_q2048_d63_l4096} --page-size 16 --no-ceilings --no-plot --budget ${BENCH_SECONDS:-80} \
  --out "$OUT/bench_ps16" > "$OUT/bench_ps16.log" 2>&1
echo "bench page 16 exit $?" >> "$summary"
stamp "done"

echo; echo "================ prefill_family_check summary ================"; cat "$summary"
echo; echo "================ bench (ours beside FlashInfer and SDPA cuDNN, same run) ================"
python3 - "$OUT" <<'PY'
import glob, json, sys
paths = [sorted(glob.glob(f"{sys.argv[1]}/bench_ps{ps}/bench_*.json"))[-1:] for ps in (16, 1)]
results = [json.load(open(p[0])) for p in paths if p]
if not results:
    raise SystemExit("no bench results")
print(f"{'workload':24s} {'ps':>2s} {'unit':>7s} {'ours':>7s} {'FI':>7s} {'cuDNN':>7s} {'ours/FI':>7s} {'err':>8s} check  families")
def fig(c, unit):
    v = (c or {}).get("value")
    return "-" if v is None else (f"{v:.0f}" if unit != "TB/s" else f"{v:.2f}")
for r in [row for res in results for row in res["rows"]]:
    o, unit = r["impls"].get("ours", {}), r["metric"]
    ratio = r.get("ours_over_flashinfer")
    print(f"{r['workload'][:24]:24s} {r['page_size']:2d} {unit:>7s} {fig(o, unit):>7s} "
          f"{fig(r['impls'].get('flashinfer'), unit):>7s} {fig(r['impls'].get('sdpa_cudnn'), unit):>7s} "
          f"{(f'{ratio:.2f}' if ratio else 'n/a'):>7s} {o.get('err', float('nan')):8.1e} "
          f"{'ok' if o.get('status') == 'ok' else 'FAIL':5s}  {', '.join(o.get('families', []))}")
for s in [s for res in results for s in res.get("skipped", [])]:
    print(f"skipped (budget): {s}")
PY
