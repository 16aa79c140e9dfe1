# Sourced by the lab's bounded GPU calls (lab/call_*.sh, and through lab/call_begin.sh): $OUT, the package
# on PYTHONPATH with its compile caches in /tmp, and the call's time budget (CALL_SECONDS, else the
# caller's CALL_DEFAULT, else 585): `left` prints the seconds left, `fits N NAME` says whether a stage of N
# seconds still fits (and names it when not). Helpers the calls share:
#   unpack_flashinfer   .fi/flashinfer.tar.xz (scripts/pack_flashinfer.sh) into /tmp/fi, FlashInfer's JIT
#                       cache in /tmp/fiws (FLASHINFER_WORKSPACE_BASE, as scripts/device_check.sh sets it);
#                       status 1 when .fi/ holds no archive (the caller adds /tmp/fi to its PYTHONPATH)
#   tree_copy DIR [PATHS...]
#                       DIR made afresh: a copy of this tree's PATHS (default cupy_fa kernels bench tests
#                       pyproject.toml)
#   patched_tree DIR PATCH [PATHS...]
#                       tree_copy with lab/patches/PATCH applied; status 1 (and a line) when it fails
#   tree_tests TREE NAME SECONDS FILES...
#                       the GPU tests FILES of tree TREE (8 workers, compile cache /tmp/cupy_fa_$(basename TREE)), bounded by
#                       SECONDS, into $OUT/NAME.log; one line with the exit and the summary, then any failures
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_FA_CACHE_DIR=/tmp/cupy_fa_cache CUPY_CACHE_DIR=/tmp/cupy_cache
t0=$(date +%s); total=${CALL_SECONDS:-${CALL_DEFAULT:-585}}
left() { echo $(( total - ($(date +%s) - t0) )); }
fits() { [ "$(left)" -ge "$1" ] || { echo "== skipped $2: $(left) s left, $1 needed"; false; }; }
unpack_flashinfer() {
  [ -f .fi/flashinfer.tar.xz ] || return 1
  mkdir -p /tmp/fi /tmp/fiws && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
}
tree_copy() {
  local dir=$1; shift
  [ $# -gt 0 ] || set -- cupy_fa kernels bench tests pyproject.toml
  rm -rf "$dir" && mkdir -p "$dir" && cp -r "$@" "$dir"/
}
patched_tree() {
  local dir=$1 patch=$2; shift 2
  tree_copy "$dir" "$@" && (cd "$dir" && patch -s -p1 < "$OLDPWD/lab/patches/$patch") \
    || { echo "== $patch does not apply"; return 1; }
}
tree_tests() {
  local tree=$1 name=$2 seconds=$3; shift 3
  (cd "$tree" && PYTHONPATH=$PWD CUPY_FA_CACHE_DIR=/tmp/cupy_fa_$(basename "$tree") OMP_NUM_THREADS=2 \
    timeout "$seconds" python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --timeout $(( seconds - 10 )) "$@") \
    > "$OUT/$name.log" 2>&1
  echo "== $tree $*: exit $?: $(tail -n 1 "$OUT/$name.log") at $(( $(date +%s) - t0 )) s"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | head -10
}
