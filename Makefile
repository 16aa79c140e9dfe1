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

test: venv
	$(PY) -m pytest -q tests

demo: venv
	$(PY) -m cupy_fa.demo

compile-check: venv
	$(PY) -m cupy_fa.compile_check

# Build outputs and caches; keeps .venv (rm -rf .venv to start over).
clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
