# Sourced by the lab's bounded GPU calls (lab/call_*.sh): $OUT, the package on PYTHONPATH with its
# compile caches in /tmp, and the call's time budget (CALL_SECONDS, 585 by default): `left` prints the
# seconds left, `fits N NAME` says whether a stage of N seconds still fits (and names it when not).
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
t0=$(date +%s); total=${CALL_SECONDS:-585}
left() { echo $(( total - ($(date +%s) - t0) )); }
fits() { [ "$(left)" -ge "$1" ] || { echo "== skipped $2: $(left) s left, $1 needed"; false; }; }
