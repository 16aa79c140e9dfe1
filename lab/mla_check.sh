#!/usr/bin/env bash
# One GPU run for multi-head latent attention (cupy_fa.mla), 2026-12-05: the first MLA call's
# compile on an empty cache, the GPU tests on the mma.sync tile alone (CUPY_FA_MLA_WGMMA=0) and then
# with the sm_90a seesaw kernel (so a fault of one kernel leaves the other's results), the bench
# beside FlashInfer's MLA wrapper, and the 128-head cells on the mma.sync tile for comparison.
# Run from the repository root; $OUT collects the JSON and junit files.
set -u
OUT=${OUT:-/tmp/mla_out}
mkdir -p "$OUT"
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-4}
nvidia-smi -L || true
python3 -c "import cupy, sys; print('cupy', cupy.__version__, 'python', sys.version.split()[0])"

echo "== cold compile: the first MLA call of each kernel, empty kernel cache"
COLD=$(mktemp -d)
CUPY_FA_CACHE_DIR=$COLD timeout 120 python3 - <<'PY'
import time
import numpy as np
import cupy
import cupy_fa
for heads, label in ((128, "H=128 decode (wgmma)"), (16, "H=16 decode (mma.sync)")):
    cache = cupy_fa.PagedLatentCache.allocate(64, 64)
    attn = cupy_fa.MLAAttention(heads)
    q = cupy.zeros((4, heads, 576), cupy_fa._arrays.DTYPES["bfloat16"])
    t0 = time.perf_counter()
    attn.plan([1] * 4, [1000] * 4, np.arange(64, dtype=np.int32).reshape(4, 16))
    attn.run(q, cache)
    cupy.cuda.Device().synchronize()
    print(f"first call {label}: {time.perf_counter() - t0:.2f} s (plan, attention and merge kernels compiled)")
PY
rm -rf "$COLD"

echo "== tests, mma.sync tile only (CUPY_FA_MLA_WGMMA=0)"
CUPY_FA_MLA_WGMMA=0 CUPY_FA_FAILURE_LOG=$OUT/failures_mma.txt timeout 200 \
    python3 -m pytest -q -ra -p no:cacheprovider tests/test_mla_gpu.py --junitxml=$OUT/mla_tests_mma.xml 2>&1 | tail -45
echo "== tests, default kernels (the seesaw kernel at 128 heads and for long requests)"
CUPY_FA_FAILURE_LOG=$OUT/failures_default.txt timeout 200 \
    python3 -m pytest -q -ra -p no:cacheprovider tests/test_mla_gpu.py --junitxml=$OUT/mla_tests_default.xml 2>&1 | tail -45

echo "== bench (FlashInfer beside)"
source /work-fi.sh || echo "no FlashInfer"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
timeout 240 python3 -m bench.mla --only "H=16" --json $OUT/mla_bench_h16.json 2>&1 | grep -v "^$" | tail -20
timeout 200 python3 -m bench.mla --only "H=128" --json $OUT/mla_bench_h128.json 2>&1 | grep -v "^$" | tail -20
echo "== the 128-head cells on the mma.sync tile (CUPY_FA_MLA_WGMMA=0), ours only"
CUPY_FA_MLA_WGMMA=0 timeout 90 python3 -m bench.mla --only "H=128" --no-peers --json $OUT/mla_bench_h128_mma.json 2>&1 | tail -8
echo "== the 128-head cells at larger small-q splits (CUPY_FA_MLA_SPLIT_SIZE), ours only, interleaved rounds"
for round in 1 2; do
  for split in 512 1024 2048; do
    echo "-- split $split round $round"
    CUPY_FA_MLA_SPLIT_SIZE=$split timeout 60 python3 -m bench.mla --only "H=128" --no-peers 2>&1 | grep -E "^(decode|verify|fp8)" | cut -c1-110
  done
done
