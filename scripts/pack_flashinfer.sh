#!/usr/bin/env bash
# Pack FlashInfer for the H200 (which has no internet) as one carryable archive.
#
# Run HERE (PyPI reachable), from anywhere:   bash scripts/pack_flashinfer.sh
# Makes .fi/flashinfer.tar.xz (git-ignored through .git/info/exclude) holding the unpacked
# contents of the flashinfer-python 0.7.4 wheel (py3-none-any) and of the apache-tvm-ffi
# wheel for cp312 manylinux x86_64 (the H200's python3 is 3.12), at the version range that
# flashinfer's METADATA asks for.
#
# On the device:
#   mkdir -p /tmp/fi && tar -xJf .fi/flashinfer.tar.xz -C /tmp/fi \
#     && export PYTHONPATH=/tmp/fi:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws
#
# flashinfer-python 0.7.4 Requires-Dist (non-extra), and where each comes from on the H200:
#   apache-tvm-ffi<0.2,>=0.1.11  -> in this archive (its own dep typing-extensions: in the image)
#   click, einops, ninja, numpy, nvidia-ml-py, packaging>=24.2, requests, tabulate, torch,
#   tqdm                         -> assumed present in the H200 image
#   cuda-python>=12.0            -> only a metapackage; the image has cuda-bindings, cuda-core
#                                   and cuda-pathfinder, which are what `import cuda...` loads
#   cuda-tile, nccl-extensions, nccl4py, nvidia-cudnn-frontend, nvidia-cutlass-dsl
#                                -> NOT in the image, not packed: large or binary, and used only
#                                   by paths the bench does not take (cuTile / CuTe-DSL kernels,
#                                   communication, the cuDNN backend). FlashInfer's decode and
#                                   prefill wrappers JIT-compile with the machine's nvcc.
# No small pure-python dep is missing, so nothing else is added.
set -euo pipefail

FI_VERSION=0.7.4
ROOT="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
OUTDIR="$ROOT/.fi"
ARCHIVE="$OUTDIR/flashinfer.tar.xz"
PY="$ROOT/.venv/bin/python"; [ -x "$PY" ] || PY=python3
PIP="${PIP:-$PY -m pip}"

EXCLUDE="$(git -C "$ROOT" rev-parse --git-path info/exclude)"
case "$EXCLUDE" in /*) ;; *) EXCLUDE="$ROOT/$EXCLUDE" ;; esac
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.fi/' "$EXCLUDE" 2>/dev/null || echo '/.fi/' >> "$EXCLUDE"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/whl" "$WORK/tree" "$OUTDIR"

PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

$PIP download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" "flashinfer-python==$FI_VERSION"
FI_WHL="$(ls "$WORK"/whl/flashinfer_python-*.whl)"

# The apache-tvm-ffi range, read from flashinfer's own METADATA (the non-extra line).
TVM_SPEC="$(unzip -p "$FI_WHL" '*.dist-info/METADATA' \
  | sed -n 's/^Requires-Dist: \(apache-tvm-ffi[^;]*\)$/\1/p' | head -1 | tr -d ' ')"
[ -n "$TVM_SPEC" ] || { echo "no apache-tvm-ffi requirement in METADATA" >&2; exit 1; }
echo "flashinfer-python $FI_VERSION requires: $TVM_SPEC"
$PIP download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" "$TVM_SPEC"

for w in "$WORK"/whl/*.whl; do
  echo "unpacking $(basename "$w")"
  unzip -q -o "$w" -d "$WORK/tree"
done
# Only the flashinfer package and the tvm_ffi package (+ their dist-info) are needed on the path.
rm -rf "$WORK/tree/build_backend.py" "$WORK/tree/build_utils.py" "$WORK/tree/__pycache__"

echo "compressing (xz -9, all cores)..."
tar -C "$WORK/tree" -cf - . | xz -9 -T0 > "$ARCHIVE.tmp"
mv "$ARCHIVE.tmp" "$ARCHIVE"
ls "$WORK/tree"
echo "wrote $ARCHIVE: $(du -h "$ARCHIVE" | cut -f1) ($(stat -c %s "$ARCHIVE") bytes);" \
     "unpacked $(du -sh "$WORK/tree" | cut -f1)"
