#!/usr/bin/env bash
# Host time and cold start on one GPU machine (2026-12-05), bounded to about 4-5 minutes:
#   1. cold start, each in a fresh process over an empty cache (scripts/cold_compile.py): the first
#      prefill call, then decode, then a mixed step; a decode call first; warmup() on every core; a
#      warm start over what it filled;
#   2. every kernel of the catalog into that cache (every core), for what follows;
#   3. eight processes compiling into one empty cache at once (tests/test_cache_gpu.py);
#   4. side by side, on disjoint cores: warmup(jobs=1) pinned to one core (the single-core time),
#      FlashInfer's JIT builds for the host table (two cells), the GPU tests of the paths this
#      change touched;
#   5. the host-time table, ours beside FlashInfer (python -m bench.host), and cProfile of the calls.
# Usage on the GPU machine from the repo root: bash lab/host_gpu_run.sh   (FlashInfer: source /work-fi.sh first)
set -uo pipefail
OUT=${OUT:-$PWD/host_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}; mkdir -p "$FLASHINFER_WORKSPACE_BASE"
WARM=/tmp/cupy_fa_warm; rm -rf "$WARM"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c 'import cupy, torch, os; from cupy_backends.cuda.libs import nvrtc; print("cupy", cupy.__version__, "nvrtc", nvrtc.getVersion(), "torch", torch.__version__, "cores", len(os.sched_getaffinity(0)))'
git log --oneline -1 2>/dev/null || true

stamp "1. cold start"
timeout 90 python3 scripts/cold_compile.py --keep "$WARM" --no-serial --json "$OUT/cold.json" 2>&1 | tail -n 30

stamp "2. the whole catalog into the warm cache"
CUPY_FA_CACHE_DIR=$WARM timeout 45 python3 -c '
from cupy_fa import _compile, catalog
s = _compile.compile_many(catalog.all_kernels("sm_90a"), "sm_90a", progress=False)
print({k: s[k] for k in ("kernels", "compiled", "cached", "seconds", "jobs")})'

stamp "3. eight processes, one empty cache"
CUPY_FA_CACHE_DIR=/tmp/unused timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/test_cache_gpu.py 2>&1 | tail -n 6

stamp "4. side by side: warmup(jobs=1) on core 15 | FlashInfer JIT on cores 10-14 | GPU tests on cores 0-9"
( rm -rf /tmp/cupy_fa_serial; CUPY_FA_CACHE_DIR=/tmp/cupy_fa_serial CUPY_CACHE_DIR=/tmp/cupy_serial \
  pin 15 timeout 150 python3 -c '
import json, time, cupy
cupy.cuda.Device(0).use(); cupy.zeros(1).sum()
import cupy_fa
rows, last = [], [time.perf_counter()]
def progress(done, total, kernel, status):
    now = time.perf_counter(); rows.append((kernel.source, now - last[0])); last[0] = now
start = time.perf_counter()
n = cupy_fa.warmup(jobs=1, progress=progress)
by = {}
for source, s in rows:
    by.setdefault(source, []).append(s)
print(f"warmup(jobs=1), one pinned core: {n} kernels in {time.perf_counter() - start:.2f} s; "
      + "; ".join(f"{k}: {len(v)} x {sum(v) / len(v):.2f} s" for k, v in sorted(by.items())))' > "$OUT/serial.txt" 2>&1 ) &
serial=$!
( CUPY_FA_CACHE_DIR=$WARM MAX_JOBS=5 pin 10-14 timeout 150 python3 -m bench.host decode_b1_l4096 prefill_b4_l4096 \
  --repeats 3 --no-graph > "$OUT/fi_prebuild.txt" 2>&1 ) &
prebuild=$!
CUPY_FA_CACHE_DIR=$WARM OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 pin 0-9 timeout 140 python3 -m pytest -v \
  -p no:cacheprovider -n 8 -m gpu --timeout 130 --maxfail 25 -rfE tests/test_attention_gpu.py tests/test_modes_graph_gpu.py \
  tests/test_concurrency_gpu.py tests/test_plan.py tests/test_devices_gpu.py tests/test_errors_gpu.py \
  tests/test_engine_gpu.py tests/test_fp8_gpu.py tests/test_variants_gpu.py > "$OUT/pytest.txt" 2>&1
echo "pytest exit $? (124: stopped at its time limit): $(grep -c ' PASSED' "$OUT/pytest.txt") passed, $(grep -c ' FAILED' \
  "$OUT/pytest.txt") failed, $(grep -c ' ERROR' "$OUT/pytest.txt") errors"
grep -E "^(FAILED|ERROR) " "$OUT/pytest.txt" | head -n 30; tail -n 1 "$OUT/pytest.txt"
wait $serial; cat "$OUT/serial.txt" | tail -n 3
wait $prebuild; tail -n 4 "$OUT/fi_prebuild.txt"

stamp "5. host time, ours beside FlashInfer"
CUPY_FA_CACHE_DIR=$WARM timeout 100 python3 -m bench.host --json "$OUT/host.json" 2>&1 | tail -n 30
CUPY_FA_CACHE_DIR=$WARM timeout 40 python3 lab/host_profile_gpu.py > "$OUT/profile.txt" 2>&1
grep -A 16 "^== " "$OUT/profile.txt" | head -n 80
stamp "done"
