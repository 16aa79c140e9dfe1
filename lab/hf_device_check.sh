#!/usr/bin/env bash
# transformers on cupy_fa, on a GPU machine with torch, transformers and CuPy in $PYTHON
# (default python3), offline: the GPU test (every attention call of generate_batch / generate
# audited against the float64 reference, the tokens against paged|sdpa / sdpa with the
# first-difference judge, the CUDA-graph path, and the wrong mappings that must fail), the
# example, then the generate_batch throughput table (printed last, after the test's
# one-line-per-case summary). About 4 minutes on an H200.
#   bash lab/hf_device_check.sh              # logs under $LOG_DIR (default $OUT/hf, else /tmp/cupy_fa_hf)
#   bash lab/hf_device_check.sh --test-only  # the GPU test alone (HF_TEST_TIMEOUT s, default 150),
#                                                # its per-case verdict lines printed last
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PARTS=all
[ "${1:-}" = "--test-only" ] && PARTS=test
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG_DIR=${LOG_DIR:-${OUT:+$OUT/hf}}
LOG_DIR=${LOG_DIR:-/tmp/cupy_fa_hf}
mkdir -p "$LOG_DIR"
export CUPY_FA_HF_SUMMARY="$LOG_DIR/summary.jsonl" CUPY_FA_FAILURE_LOG="$LOG_DIR/failures.log"
rm -f "$CUPY_FA_HF_SUMMARY" "$CUPY_FA_FAILURE_LOG"
$PY -c 'import torch, transformers, cupy; print("torch", torch.__version__, "| transformers", transformers.__version__,
"| cupy", cupy.__version__, "|", torch.cuda.get_device_name(0))'

verdicts() {  # the test's one line per case, as each test wrote it (a run cut short keeps what finished)
    $PY -c 'import json, sys
for line in open(sys.argv[1]):
    print(json.loads(line)["line"])' "$CUPY_FA_HF_SUMMARY" 2>/dev/null || echo "(no verdicts written)"
}

echo "== GPU test (tests/test_hf_integration_gpu.py)"
timeout "${HF_TEST_TIMEOUT:-150}" $PY -m pytest -q -s -p no:cacheprovider --durations=0 tests/test_hf_integration_gpu.py \
    > "$LOG_DIR/test.log" 2>&1
test_rc=$?
[ $test_rc -eq 124 ] && echo "(the GPU test ran past ${HF_TEST_TIMEOUT:-150} s and was stopped)"
if [ "$PARTS" = test ]; then
    grep -E "^E +[A-Za-z.]*(Error|Exception)|^[A-Za-z.]*Error: " "$LOG_DIR/test.log" | cut -c1-400 | head -16
    grep -E "s (call|setup) |passed|failed|skipped|error" "$LOG_DIR/test.log" | tail -16
    if grep -qE "[0-9]+ skipped" "$LOG_DIR/test.log"; then  # on the GPU machine nothing may skip
        echo "(tests were skipped: no usable GPU, torch or transformers?)"; [ $test_rc -eq 0 ] && test_rc=1
    fi
    echo "== verdicts (exit code $test_rc; logs in $LOG_DIR)"
    verdicts
    exit $test_rc
fi
grep -E "^(generate|graphs|mutation)|passed|failed|Error|error:" "$LOG_DIR/test.log" | cut -c1-600 | tail -40

echo "== example (examples/hf_continuous_batching.py)"
timeout 30 $PY examples/hf_continuous_batching.py > "$LOG_DIR/example.log" 2>&1
example_rc=$?
grep -E "^req_" "$LOG_DIR/example.log" | head -3
tail -2 "$LOG_DIR/example.log" | grep -iE "error|Traceback" || true

timeout 100 $PY -m bench.hf_throughput --summary "$CUPY_FA_HF_SUMMARY" > "$LOG_DIR/throughput.log" 2>&1
bench_rc=$?
grep -vE "Logger - (WARNING|INFO)" "$LOG_DIR/throughput.log" | tail -24
echo "== exit codes: test $test_rc, example $example_rc, throughput $bench_rc (logs in $LOG_DIR)"
[ $test_rc -eq 0 ] && [ $example_rc -eq 0 ] && [ $bench_rc -eq 0 ]
