# t1jax developer entry points. `make setup` makes a fresh machine ready; `make test` is what CI runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Tests and benchmarks see 8 fake CPU devices unless the caller already chose.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
PYTEST_WORKERS ?= 2

.PHONY: setup test test-slow bench lint setup-tpu test-tpu-contract

# The TPU environment: vllm-tpu 0.32 (tpu-inference, jax 0.11.2, torch) and pathwaysutils need
# Python 3.12, so they live in a second venv that the default suite never touches: 11 GB (torch
# with CUDA libraries comes with vllm-tpu), about 5 minutes on 2 cores. Built under `nice`.
# tpu-inference installs a top-level `tests` package there, which shadows ours: only
# tests/tpu_contract (which imports no `tests.*` module) is meant to run in it.
TPU_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
TPU_VENV ?= .venv-tpu
TPU_PY := $(TPU_VENV)/bin/python

setup:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[ref,k8s,modal,dev]"
	$(PY) -m sandbox_service.verifier --setup

test:
	$(PY) -m pytest -m "not slow" -n $(PYTEST_WORKERS) -q

test-slow:
	$(PY) -m pytest -m "slow" -q

bench:
	@for script in bench/*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

lint:
	$(PY) -m ruff check t1jax sandbox_service tests bench

setup-tpu:
	@test -n "$(TPU_PYTHON)" || { echo "setup-tpu: no Python 3.12 found; pass TPU_PYTHON=/path/to/python3.12"; exit 2; }
	nice -n 10 $(TPU_PYTHON) -m venv $(TPU_VENV)
	nice -n 10 $(TPU_PY) -m pip install --upgrade pip
	nice -n 10 $(TPU_PY) -m pip install -e ".[tpu,dev]"

# Contract tests against the installed vLLM-TPU / tpu-inference / pathwaysutils, on CPU.
test-tpu-contract:
	@test -x $(TPU_PY) || { echo "test-tpu-contract: $(TPU_VENV) is missing; run 'make setup-tpu' first"; exit 2; }
	T1JAX_TPU_CONTRACT=1 JAX_PLATFORMS=cpu $(TPU_PY) -m pytest -m tpu_contract tests/tpu_contract -q -n 0 -p no:cacheprovider
