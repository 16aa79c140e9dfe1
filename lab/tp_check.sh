#!/usr/bin/env bash
# The multi-GPU check in one call, on a machine of 2 or more GPUs, from the repository root:
#   bash lab/tp_check.sh
# 1. the device-binding tests: tests/test_multi_gpu.py (marker multi_gpu: inputs on device 1 while
#    CuPy's current device is 0 and the reverse, against float64, nothing allocated on the current
#    device, refusals, a module per device) and tests/test_devices_gpu.py; a skip is an error here;
# 2. the tensor-parallel example engine, correctness: examples/tp_engine.py --tp 2 on its default
#    model (bf16, page size 16, 4 drafts), tp=1 on GPU 0 then 2 ranks over NCCL, plain and
#    speculative, eager and with CUDA graphs (the all-gathers captured): every rank's tokens must
#    be the tokens of one GPU ("ALL PASS");
# 3. throughput: the same on a larger model (TP_MODEL, default hidden 4096, 32 q / 8 kv heads of
#    128, 4 layers, vocab 32000), tokens/s of 1 and 2 GPUs for each run, graphs on.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1; examples/tp_engine.py sets them again for its ranks).
# Keeps within TP_CHECK_SECONDS (default 560); logs under $OUT (or ./device_out), summary last.
# Exit 1 when a stage failed, a test failed, errored or skipped, or fewer than 2 GPUs are visible.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s); limit=${TP_CHECK_SECONDS:-560}
summary=$OUT/tp_summary.txt; : > "$summary"
failed=0
left() { echo $(( limit - ($(date +%s) - t0) )); }

{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -n 4
  python3 -c 'import cupy, torch; v = torch.cuda.nccl.version(); v = v if isinstance(v, int) else ".".join(map(str, v))
print("cupy", cupy.__version__, "torch", torch.__version__, "nccl", v, "devices", torch.cuda.device_count())'
  git log -1 --format='tree: %h %s' 2>/dev/null | cut -c1-120
} 2>&1 | tee -a "$summary"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "ERROR: $gpus CUDA device(s) visible; this check needs 2" | tee -a "$summary"; exit 1
fi

# the kernels of head dim 128 into the disk cache once, 16 processes (the tests and every rank then
# load them; the rest compile at first use)
timeout 150 python3 scripts/warm_cache.py 16 --head-dims 128 --no-fp8 2>&1 | tail -n 1 | sed "s/^/warm: /" \
  | tee -a "$summary"

# 1. the device-binding tests
start=$(date +%s)
timeout $(( $(left) > 200 ? 200 : $(left) )) python3 -m pytest -v -p no:cacheprovider -m "multi_gpu or gpu" \
  tests/test_multi_gpu.py tests/test_devices_gpu.py -rs --junitxml="$OUT/tp_junit.xml" > "$OUT/tp_pytest.log" 2>&1
test_rc=$?
echo "pytest: $(tail -n 1 "$OUT/tp_pytest.log") ($(( $(date +%s) - start )) s)" | tee -a "$summary"
grep -E "FAILED|ERROR|SKIPPED" "$OUT/tp_pytest.log" | head -20 | tee -a "$summary"
counts=$(python3 - "$OUT/tp_junit.xml" <<'EOF' 2>/dev/null
import sys, xml.etree.ElementTree as ET
s = ET.parse(sys.argv[1]).getroot()
s = s if s.tag == "testsuite" else s.find("testsuite")
print(s.get("tests"), s.get("failures"), s.get("errors"), s.get("skipped"))
EOF
)
read -r n_tests n_fail n_err n_skip <<< "${counts:-0 0 0 0}"
if [ "$test_rc" -ne 0 ] || [ "${n_tests:-0}" -eq 0 ] || [ "${n_skip:-0}" -ne 0 ]; then
  echo "ERROR: the device-binding tests did not all pass (exit $test_rc; tests $n_tests, failures $n_fail," \
       "errors $n_err, skipped $n_skip: a skip on this machine is a broken setup)" | tee -a "$summary"; failed=1
fi

# 2. tp=1 vs tp=2, the default model: tokens identical, graphs on
engine_stage() {  # name, seconds, flags...
  local name=$1 seconds=$2; shift 2
  if [ "$(left)" -lt 30 ]; then echo "$name: not run (time left $(left) s)" | tee -a "$summary"; failed=1; return; fi
  start=$(date +%s)
  timeout $(( $(left) < seconds ? $(left) : seconds )) python3 examples/tp_engine.py --tp 2 "$@" \
    > "$OUT/tp_$name.log" 2>&1
  rc=$?
  { echo "$name ($(( $(date +%s) - start )) s, exit $rc):"; grep -E "tokens ==|ALL PASS|FAILED|Error|error" "$OUT/tp_$name.log" \
      | head -20 | sed 's/^/    /'; } | tee -a "$summary"
  grep -q "^ALL PASS" "$OUT/tp_$name.log" || { echo "ERROR: $name did not pass (exit $rc; 124: timed out)" \
      | tee -a "$summary"; failed=1; }
}
engine_stage engine 200 --new-tokens 64 --timing-runs 1

# 3. tokens/s of 1 and 2 GPUs on a larger model, graphs on
TP_MODEL=${TP_MODEL:---hidden 4096 --intermediate 11008 --heads 32 --kv-heads 8 --head-dim 128 --layers 4 --draft-layers 2 --vocab 32000}
# shellcheck disable=SC2086
engine_stage throughput 240 $TP_MODEL --new-tokens 128 --timing-runs 2

echo "---- summary ($(( $(date +%s) - t0 )) s) ----"
cat "$summary"
exit $failed
