#!/usr/bin/env bash
# Gather SGLang 0.5.17 and the wheels its attention kit's import needs, for the H200 (python3 3.12, no
# internet, torch 2.11 / triton 3.6 / transformers 5.17 already in its image), into .sgl/ (git-ignored
# through .git/info/exclude, as scripts/pack_flashinfer.sh does for .fi/).
#
# Run HERE (PyPI reachable), from anywhere:   bash scripts/pack_sglang.sh
# (SGL_ARCHIVE=0 keeps the .whl files; by default they go into .sgl/wheels.tar.xz). On the device:
#   python3 scripts/sgl_wheels.py --install /tmp/sgl-site
#   export PYTHONPATH=/tmp/sgl-site:$PYTHONPATH
# and tests/sglang_harness makes sgl_kernel / flashinfer placeholders (the kit only imports them).
#
# sglang pins torch 2.11, transformers 5.12.1 and sglang-kernel 0.4.5; none of those is packed (the
# image's torch and transformers 5.17 are used; tests/sglang_harness tolerates 5.17's qwen3_asr
# registration). Every wheel is installed with --no-deps: the list below is what `import sglang` and the
# kit need beyond the image (xgrammar 0.2.9 instead of the pinned 0.2.1: 44.7 MB, never called by the kit;
# fastapi 0.135: later ones need opentelemetry).
set -euo pipefail

ROOT="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
OUT="$ROOT/.sgl"
PY="$ROOT/.venv/bin/python"; [ -x "$PY" ] || PY=python3
EXCLUDE="$(git -C "$ROOT" rev-parse --git-path info/exclude)"
case "$EXCLUDE" in /*) ;; *) EXCLUDE="$ROOT/$EXCLUDE" ;; esac
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.sgl/' "$EXCLUDE" 2>/dev/null || echo '/.sgl/' >> "$EXCLUDE"

WHEELS=(sglang==0.5.17 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.5
        orjson==3.13.0 pybase64==1.5.1 pyzmq==27.3.0 msgspec==0.23.0 setproctitle==1.3.8 jiter==0.19.0
        starlette==1.10.0 fastapi==0.135.0 uvicorn==0.55.0 openai==2.6.1 sniffio==1.3.1 distro==1.9.0
        partial-json-parser==0.2.1.1.post7 dill==0.4.1 multiprocess==0.70.19 datasets==5.2.0
        compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 ipython==9.18.1 traitlets==5.16.1
        xgrammar==0.2.9 apache-tvm-ffi==0.1.11 einops==0.8.2 sentencepiece==0.2.3)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform any)
rm -rf "$OUT"; mkdir -p "$OUT"
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT" "$w"
done
ls "$OUT" | wc -l | xargs echo "wheels:"
if [ "${SGL_ARCHIVE:-1}" = 1 ]; then  # smaller to carry: each wheel unpacked, all in one xz tar (34 -> 22 MiB);
  STAGE="$(mktemp -d)"                 # scripts/sgl_wheels.py zips them back into the same wheels
  for w in "$OUT"/*.whl; do mkdir "$STAGE/$(basename "$w")" && "$PY" -m zipfile -e "$w" "$STAGE/$(basename "$w")"; done
  tar -C "$STAGE" -cf - . | xz -T0 -6 > "$OUT/wheels.tar.xz" && rm -f "$OUT"/*.whl; rm -rf "$STAGE"
fi
du -sh "$OUT"
