#!/usr/bin/env bash
# transformers on cupy_fa, on a GPU machine with torch, transformers and CuPy in $PYTHON
# (default python3), offline: the GPU test (generate_batch paged|cupy_fa vs paged|sdpa, generate
# cupy_fa vs sdpa, the CUDA-graph path), the example, then the generate_batch throughput table
# (printed last, after the test's one-line-per-case summary). About 4 minutes on an H200.
#   bash scripts/hf_device_check.sh            # logs under $LOG_DIR (default $OUT/hf, else /tmp/cupy_fa_hf)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG_DIR=${LOG_DIR:-${OUT:+$OUT/hf}}
LOG_DIR=${LOG_DIR:-/tmp/cupy_fa_hf}
mkdir -p "$LOG_DIR"
export CUPY_FA_HF_SUMMARY="$LOG_DIR/summary.jsonl"
rm -f "$CUPY_FA_HF_SUMMARY"
$PY -c 'import torch, transformers, cupy; print("torch", torch.__version__, "| transformers", transformers.__version__,
"| cupy", cupy.__version__, "|", torch.cuda.get_device_name(0))'

echo "== GPU test (tests/test_hf_integration_gpu.py)"
timeout 150 $PY -m pytest -q -s -p no:cacheprovider tests/test_hf_integration_gpu.py > "$LOG_DIR/test.log" 2>&1
test_rc=$?
grep -E "^\.?(request|generate|graphs)|passed|failed|Error|error:" "$LOG_DIR/test.log" | grep -v "tokens equal$" | tail -40

echo "== example (examples/hf_continuous_batching.py)"
timeout 30 $PY examples/hf_continuous_batching.py > "$LOG_DIR/example.log" 2>&1
example_rc=$?
grep -E "^req_" "$LOG_DIR/example.log" | head -3
tail -2 "$LOG_DIR/example.log" | grep -iE "error|Traceback" || true

timeout 100 $PY -m bench.hf_throughput --summary "$CUPY_FA_HF_SUMMARY" > "$LOG_DIR/throughput.log" 2>&1
bench_rc=$?
grep -vE "Logger - (WARNING|INFO)" "$LOG_DIR/throughput.log" | tail -14
echo "== exit codes: test $test_rc, example $example_rc, throughput $bench_rc (logs in $LOG_DIR)"
[ $test_rc -eq 0 ] && [ $example_rc -eq 0 ] && [ $bench_rc -eq 0 ]
