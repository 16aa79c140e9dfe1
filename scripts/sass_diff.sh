#!/usr/bin/env bash
# SASS of every kernel variant at git revision BASE_REV against this working tree (CPU only):
# identical bytes / same instructions / different per variant, registers and spills.
# Usage: bash scripts/sass_diff.sh BASE_REV [scripts/sass_diff.py options, e.g. --only merge --diff 40]
# Needs nvcc 13.0 ($NVCC) and cuobjdump + nvdisasm on PATH ($CUDA_TOOLS_BIN is prepended when set).
set -euo pipefail
cd "$(dirname "$0")/.."
base_rev=$1; shift
base=$(mktemp -d /tmp/sass_base.XXXXXX); trap 'rm -rf "$base"' EXIT
git archive "$base_rev" kernels cupy_fa | tar -x -C "$base"
PATH=${CUDA_TOOLS_BIN:+$CUDA_TOOLS_BIN:}$PATH ${PYTHON:-python3} scripts/sass_diff.py "$base" . "$@"
