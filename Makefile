# t1jax developer entry points. `make setup` makes a fresh machine ready; `make test` is what CI runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Tests and benchmarks see 8 fake CPU devices unless the caller already chose.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
PYTEST_WORKERS ?= 2

.PHONY: setup test test-slow bench lint

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
