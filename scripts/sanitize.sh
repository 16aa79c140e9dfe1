#!/usr/bin/env bash
# compute-sanitizer over cupy_fa's kernels: memcheck, racecheck, initcheck and synccheck on
# scripts/sanitize_cases.py (a representative step of every kernel path, good and garbage
# metadata) and memcheck / synccheck on the example engine (examples/engine.py, a small model).
# In the engine only cupy_fa's kernels are instrumented (--kernel-name: torch's run as they are), so
# the whole stage takes about two to three minutes on an H200.
# Usage: bash scripts/sanitize.sh [OUT_DIR]   (SANITIZE_TOOLS, SANITIZE_ENGINE=0, SANITIZE_SECONDS)
# Prints one line per (tool, target): errors found, exit status, seconds; exits 1 on any error.
set -uo pipefail
out=${1:-${OUT:-$PWD/device_out}}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
san=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | tail -n 1)}
if [ -z "$san" ] || [ ! -x "$san" ]; then echo "sanitizer: compute-sanitizer not found"; exit 1; fi
tools=${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}
limit=${SANITIZE_SECONDS:-120}  # per run
# the engine: only our kernels instrumented (mangled names in namespace cupy_fa), torch's run as
# they are; the cases run every kernel checked (ours and CuPy's few fills and copies)
engine_filter=(--kernel-name kns=cupy_fa)
if ! "$san" "${engine_filter[@]}" --tool memcheck true > /dev/null 2>&1; then
  engine_filter=(); echo "sanitizer: this compute-sanitizer refuses --kernel-name kns=: the engine runs every kernel checked"
fi
status=0
run() {  # tool, name, filter (0 / 1), command...
  local tool=$1 name=$2 filtered=$3; shift 3
  local filter=(); [ "$filtered" = 1 ] && filter=("${engine_filter[@]}")
  local log="$out/sanitize_${tool}_${name}.log" extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  local t0; t0=$(date +%s)
  timeout "$limit" "$san" --tool "$tool" "${filter[@]}" "${extra[@]}" --error-exitcode 17 --print-limit 20 \
    --log-file "$log.san" "$@" > "$log" 2>&1
  local rc=$?
  local summary; summary=$(grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$log.san" "$log" 2>/dev/null | tail -n 1)
  local errors; errors=$(echo "$summary" | grep -oE "[0-9]+ (errors|hazards)" | head -n 1 | grep -oE "^[0-9]+")
  local verdict=ok
  if [ "$rc" -ne 0 ] || [ "${errors:-0}" != 0 ] || [ -z "$summary" ]; then verdict=FAIL; status=1; fi
  [ "$rc" -eq 124 ] && verdict="FAIL (timed out after ${limit} s)"
  printf "sanitizer %-9s %-7s %-4s errors=%s exit=%s %ss  %s\n" "$tool" "$name" "$verdict" "${errors:-?}" "$rc" \
    "$(( $(date +%s) - t0 ))" "${summary:-no summary (see $log)}"
  if [ "$verdict" != ok ]; then grep -m 12 -E "=========" "$log.san" 2>/dev/null | head -n 12 | sed 's/^/    /'; tail -n 5 "$log" | sed 's/^/    /'; fi
}
python3 scripts/warm_cache.py > /dev/null 2>&1  # compiled before the sanitizer slows everything down
for tool in $tools; do
  run "$tool" cases 0 python3 scripts/sanitize_cases.py
done
if [ "${SANITIZE_ENGINE:-1}" = 1 ]; then
  for tool in memcheck synccheck; do
    run "$tool" engine 1 python3 examples/engine.py --new-tokens 6 --layers 2 --draft-layers 1 --vocab 256 \
      --hidden 256 --intermediate 512
  done
fi
exit $status
