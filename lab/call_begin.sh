# Sourced first by the device-call scripts (lab/call_final.sh, call_probe.sh, call_fp8_deep.sh; 2026-12-07):
# lab/call_budget.sh (OUT, the call's clock: t0, total = CALL_SECONDS or the caller's CALL_DEFAULT, left,
# fits; the environment every stage runs in; unpack_flashinfer, patched_tree), the card's name in $gpu
# (printed), and host_bench: `python -m bench.host` on an H200 (issue 41's bars are H200 figures; HOST_ANY=1:
# on any card), first, on a machine nothing else has run on yet, in HOST_PASSES passes (default 2: a fresh
# machine's first seconds read high, 2026-12-07).
. lab/call_budget.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "== $gpu"
host_bench() {
  if echo "$gpu" | grep -q H200 || [ "${HOST_ANY:-0}" = 1 ]; then
    timeout ${HOST_SECONDS:-90} python3 -m bench.host --no-flashinfer --passes ${HOST_PASSES:-2} --json "$OUT/host.json" 2>&1 | grep -v "^\[" | tail -n $(( 23 * ${HOST_PASSES:-2} ))
    echo "== bench.host at $(( $(date +%s) - t0 )) s"
  fi
}
