# cupy_fa developer targets. `make demo` and `make test` work on a fresh machine.
#   CUPY_FA_CUDA=13 make venv   -> install the CUDA 13 extra instead of CUDA 12
#   PYTHON=python3.12 make venv -> build the venv with another interpreter

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

ifeq ($(CUPY_FA_CUDA),13)
CUDA_EXTRA := cuda13
OTHER_CUPY := cupy-cuda12x
else
CUDA_EXTRA := cuda12
OTHER_CUPY := cupy-cuda13x
endif
# One stamp per CUDA flavour; reinstalls when pyproject.toml changes. Never installs torch.
STAMP := $(VENV)/.installed-$(CUDA_EXTRA)

# Single-threaded BLAS for the float64 reference: on a small shared machine OpenBLAS
# threads turn many small matmuls from milliseconds into seconds.
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: venv torch-venv sglang-site test demo compile-check clean

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip uninstall -y -q $(OTHER_CUPY) 2>/dev/null || true
	$(PY) -m pip install -e '.[$(CUDA_EXTRA),test]'
	rm -f $(VENV)/.installed-*
	touch $@

# Tests that need torch run in a venv of their own, so the package's venv never holds torch:
# the CPU tests marked cpu_torch (the example engine on its pure-torch backend, torch tensors
# into the reference and the serving modes, the transformers integration's argument mapping)
# and the GPU tests that drive cupy_fa from torch (marker `torch`, and TORCH_GPU_TESTS).
# .venv runs everything else and deselects those, so a GPU machine without torch in .venv
# passes; the torch venv runs them, and there they skip with "no CUDA device" on a CPU machine.
#
# The torch it installs (TORCH_REQ overrides all of this):
#   a GPU machine (nvidia-smi lists one): PyPI's default torch, a CUDA build, beside the package
#     with its CUDA extra, for the GPU tests;
#   else a CPU torch wheel on local disk (TORCH_WHEEL: CI machines have one), else the CPU build
#     from PyTorch's CPU index (TORCH_CPU_INDEX), else PyPI's default torch: on Linux x86_64 that
#     is the multi-GB CUDA build (it runs on the CPU too). CUPY_FA_NO_CUDA_TORCH=1 (CI sets it)
#     refuses that last step instead of downloading it.
TORCH_VENV      := .venv-torch
TORCH_PY        := $(TORCH_VENV)/bin/python
TORCH_STAMP     := $(TORCH_VENV)/.installed
HAVE_GPU        ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1)
PY_TAG          := $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null)
TORCH_WHEEL     ?= $(lastword $(sort $(wildcard /opt/wheels/torch-*+cpu-$(PY_TAG)-*.whl)))
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_REQ       ?=
TRANSFORMERS_REQ ?= transformers==5.17.*
TORCH_EXTRAS    := $(if $(HAVE_GPU),[$(CUDA_EXTRA)],)
TORCH_DEPS      := $(TRANSFORMERS_REQ) numpy ml_dtypes pytest psutil

# tests that import torch (or transformers) at module level: never collected in .venv
TORCH_CPU_FILES := tests/test_engine_cpu.py tests/test_kinds_torch_cpu.py tests/test_hf_integration_cpu.py \
                   tests/test_tp_engine_cpu.py
# The SGLang backend's tests (marker sglang) run with .venv-torch's python and sglang 0.5.17 installed
# --no-deps into .sglang-site (tests/sglang_harness/requirements-cpu.txt: sglang, triton and the few
# packages its attention kit's import needs; never sglang's pinned torch). On a CPU machine the GPU
# file skips with "no CUDA device".
SGL_SITE        := .sglang-site
SGL_STAMP       := $(SGL_SITE)/.installed
SGL_REQ         := tests/sglang_harness/requirements-cpu.txt
SGL_FILES       := tests/test_sglang_cpu.py tests/test_sglang_graph_gpu.py
# GPU tests that import torch inside (older than the `torch` marker): run with torch, deselected in .venv
TORCH_GPU_TESTS := tests/test_attention_gpu.py::test_torch_interop_zero_copy \
                   tests/test_modes_graph_gpu.py::test_inside_torch_cuda_graph tests/test_engine_gpu.py

$(TORCH_STAMP): pyproject.toml
	rm -rf $(TORCH_VENV)
	$(PYTHON) -m venv $(TORCH_VENV)
	@set -e; pip="$(TORCH_PY) -m pip install -q"; \
	if [ -n "$(TORCH_REQ)" ]; then echo "torch venv: $(TORCH_REQ)"; $$pip $(TORCH_REQ); \
	elif [ -n "$(HAVE_GPU)" ]; then echo "torch venv: a GPU is here, PyPI's default (CUDA) torch"; $$pip torch; \
	elif [ -n "$(TORCH_WHEEL)" ]; then echo "torch venv: CPU torch from $(TORCH_WHEEL)"; $$pip "$(TORCH_WHEEL)"; \
	elif $$pip --retries 1 --timeout 20 --index-url "$(TORCH_CPU_INDEX)" torch; then echo "torch venv: CPU torch from $(TORCH_CPU_INDEX)"; \
	elif [ -n "$$CUPY_FA_NO_CUDA_TORCH" ]; then \
	    echo "torch venv: no CPU torch wheel on disk and $(TORCH_CPU_INDEX) unreachable; CUPY_FA_NO_CUDA_TORCH is set," \
	         "so PyPI's multi-GB CUDA torch is not installed. Give TORCH_WHEEL=/path/to/torch-*+cpu-*.whl." >&2; exit 1; \
	else echo "torch venv: no CPU torch at hand, PyPI's default torch (on x86_64 the multi-GB CUDA build)"; $$pip torch; fi
	$(TORCH_PY) -m pip install -q -e '.$(TORCH_EXTRAS)' $(TORCH_DEPS)
	touch $@

torch-venv: $(TORCH_STAMP)

$(SGL_STAMP): $(SGL_REQ) $(TORCH_STAMP)
	rm -rf $(SGL_SITE)
	$(TORCH_PY) -m pip install -q --no-deps --target $(SGL_SITE) -r $(SGL_REQ)
	touch $@

sglang-site: $(SGL_STAMP)

test: venv $(TORCH_STAMP) $(SGL_STAMP)
	$(PY) -m pytest -q -m "not cpu_torch and not torch and not sglang" \
	    $(addprefix --ignore=,$(TORCH_CPU_FILES) $(SGL_FILES)) $(addprefix --deselect=,$(TORCH_GPU_TESTS)) tests
	$(TORCH_PY) -m pytest -q -m "cpu_torch or torch" $(TORCH_CPU_FILES) tests/test_reference.py \
	    tests/test_hf_integration_gpu.py
	$(TORCH_PY) -m pytest -q $(TORCH_GPU_TESTS)
	PYTHONPATH=$(CURDIR)/$(SGL_SITE) $(TORCH_PY) -m pytest -q -W ignore::UserWarning $(SGL_FILES)

demo: venv
	$(PY) -m cupy_fa.demo

compile-check: venv
	$(PY) -m cupy_fa.compile_check

# Build outputs and caches; keeps .venv (rm -rf .venv to start over).
clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
