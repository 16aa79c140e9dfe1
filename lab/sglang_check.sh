#!/usr/bin/env bash
# One GPU call for the SGLang backend (2026-12-05): SGLang 0.5.17's attention kit for triton and
# cupy_fa over the matrix (head dims 64 / 128 / 256, fp16 / bf16, the kit's pages and page 64), the
# captured-graph tests, and the bench beside triton's backend. Needs the wheels of
# scripts/pack_sglang.sh at .sgl/ in the repository root (carried to a machine without internet).
# Run from the repository root; $OUT collects the JSON and the kit's tables. About 5 minutes.
set -u
OUT=${OUT:-/tmp/sglang_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 TRITON_CACHE_DIR=/tmp/triton_cache
timeout 60 python3 scripts/sgl_wheels.py --install /tmp/sgl-site > /dev/null || echo "PIP INSTALL FAILED"
export PYTHONPATH=/tmp/sgl-site:$PYTHONPATH
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "== cupy_fa warmup $(date -u +%T)"; timeout 60 python3 -m cupy_fa warmup 2>&1 | tail -1
echo "== graph tests $(date -u +%T)"; timeout 90 python3 -m pytest -q -p no:cacheprovider -s -W ignore tests/test_sglang_graph_gpu.py 2>&1 | grep -vi warn | tail -30
echo "== kit A $(date -u +%T)"; timeout 120 python3 tests/sglang_harness/run_kit.py --backends triton,cupy_fa --configs d128-fp16-kit --json $OUT/kit_a.json > $OUT/kit_a.txt 2>&1; echo "rc=$?"; grep -E "^(FAIL|SKIP|NOT|TOTAL|placeholder)|passed" $OUT/kit_a.txt
echo "== kit B $(date -u +%T)"; timeout 150 python3 tests/sglang_harness/run_kit.py --backends cupy_fa --configs d64-bf16-kit,d256-bf16-kit,d64-fp16-p64,d256-fp16-p64,d128-bf16-p64 --budget 130 --json $OUT/kit_b.json > $OUT/kit_b.txt 2>&1; echo "rc=$?"; grep -E "^(FAIL|SKIP|NOT|TOTAL|placeholder)|passed" $OUT/kit_b.txt
echo "== kit C (triton at the other configs) $(date -u +%T)"; timeout 150 python3 tests/sglang_harness/run_kit.py --backends triton --configs d64-bf16-kit,d256-bf16-kit,d128-bf16-p64 --budget 130 --json $OUT/kit_c.json > $OUT/kit_c.txt 2>&1; echo "rc=$?"; grep -E "^(FAIL|SKIP|NOT|TOTAL|placeholder)|passed" $OUT/kit_c.txt
echo "== bench $(date -u +%T)"; timeout 120 python3 -m bench.sglang --json $OUT/bench.json 2>&1 | grep -vi warn | tail -12
echo "== end $(date -u +%T)"
