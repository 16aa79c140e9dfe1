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

.PHONY: venv test demo compile-check clean

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip uninstall -y -q $(OTHER_CUPY) 2>/dev/null || true
	$(PY) -m pip install -e '.[$(CUDA_EXTRA),test]'
	rm -f $(VENV)/.installed-*
	touch $@

# The CPU tests that need torch and transformers (marker cpu_torch: the example engine on
# its pure-torch backend, torch tensors into the reference) run in a venv of their own, so
# the package's venv never holds torch. It takes the CPU torch wheel on local disk when
# there is one, else the CPU build from PyTorch's index (never the multi-GB CUDA build).
TORCH_VENV  := .venv-torch
TORCH_STAMP := $(TORCH_VENV)/.installed
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl))
TORCH_REQ   := $(if $(TORCH_WHEEL),$(TORCH_WHEEL),torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)

$(TORCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q $(TORCH_REQ)
	$(TORCH_VENV)/bin/python -m pip install -q transformers numpy ml_dtypes pytest
	touch $@

test: venv $(TORCH_STAMP)
	$(PY) -m pytest -q -m "not cpu_torch" --ignore=tests/test_engine_cpu.py tests
	$(TORCH_VENV)/bin/python -m pytest -q -m cpu_torch tests/test_engine_cpu.py tests/test_reference.py

demo: venv
	$(PY) -m cupy_fa.demo

compile-check: venv
	$(PY) -m cupy_fa.compile_check

# Build outputs and caches; keeps .venv (rm -rf .venv to start over).
clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
