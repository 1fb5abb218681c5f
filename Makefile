# t1jax developer entry points. `make setup` makes a fresh machine ready; `make test` is what CI runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Tests and benchmarks see 8 fake CPU devices unless the caller already chose (the demo gives its
# stages only the CPU devices its configs use: t1jax.demo.driver.host_device_flags).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
PYTEST_WORKERS ?= 2

# The TPU environment: vllm-tpu 0.32 (tpu-inference, jax 0.11.2, torch) and pathwaysutils need
# Python 3.12, so they live in a second venv that the default suite never touches: 11 GB (torch
# with CUDA libraries comes with vllm-tpu), about 5 minutes on 2 cores. Built under `nice`.
# tpu-inference installs a top-level `tests` package there, which shadows ours: only
# tests/tpu_contract (which imports no `tests.*` module) is meant to run in it.
TPU_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
TPU_VENV ?= .venv-tpu
TPU_PY := $(TPU_VENV)/bin/python

# What the sandboxes need from the host (Debian 12): bubblewrap and util-linux for the local backend,
# podman + runc for the container backend, mmdebstrap to build stand-in base images, tmux, CA certs;
# docker-registry (distribution): the tests' registry on localhost (tests/sandbox_service/test_registry.py).
SYSTEM_PACKAGES := bubblewrap util-linux tmux podman runc mmdebstrap ca-certificates python3-venv \
	docker-registry
# The base images the default test suite's tasks name; their stand-ins are built (mmdebstrap, ~1 min
# each) into ~/.cache/t1jax/stand-ins and imported into podman. `make setup-containers` adds those
# of the fidelity corpus (tests/data/fidelity_tasks).
DEFAULT_STAND_INS := python:3.11-slim python:3.11 debian:bookworm python:3.12-slim-bookworm \
	ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624
CORPUS_STAND_INS := golang:1.24-bookworm eclipse-temurin:21-jdk gcc:14 buildpack-deps:jammy

.PHONY: setup setup-system setup-containers test test-slow test-wheel test-containers bench bench-all lint setup-tpu \
	test-tpu-contract demo ablation setup-harbor test-harbor

setup: setup-system
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[ref,k8s,modal,wandb,dev]"
	$(PY) -m sandbox_service.verifier --setup
	$(PY) -m sandbox_service stand-ins --import $(DEFAULT_STAND_INS)

# System packages (as root, with apt); installs only what is missing.
setup-system:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "apt-get install $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# After `make setup`: the stand-ins the fidelity corpus needs too.
setup-containers:
	$(PY) -m sandbox_service stand-ins --import $(DEFAULT_STAND_INS) $(CORPUS_STAND_INS)

test:
	$(PY) -m pytest -m "not slow" -n $(PYTEST_WORKERS) -q

# The demo (README "The demo"): base -> SFT -> critic warm-up -> RL on a generated suite, held-out
# evaluation of all three, the Table-1-style result in DEMO_OUT/summary.md. Re-running continues
# where it stopped. `make ablation`: the binary-reward RL campaign next to the demo's test-count one,
# from the same SFT and warm-up (it reuses DEMO_OUT's stages).
DEMO_OUT ?= runs/demo
# DEMO_SEED is added to every training / eval seed, not the suite's: make demo DEMO_SEED=1 DEMO_OUT=runs/demo-seed1
# (then RL over SFT over both seeds: t1jax compare --pool A/eval/rl-greedy B/eval/rl-greedy --against
# A/eval/sft-greedy B/eval/sft-greedy)
DEMO_SEED ?= 0
# SUITE_SEED draws another suite (other train and held-out families): make demo SUITE_SEED=1
# DEMO_OUT=runs/demo-suite1. Empty: demo.yaml's tasks.seed.
SUITE_SEED ?=
DEMO_ARGS = --config configs/demo/demo.yaml --out $(DEMO_OUT) --seed $(DEMO_SEED) $(if $(SUITE_SEED),--suite-seed $(SUITE_SEED))
demo:
	$(PY) -m t1jax.cli demo $(DEMO_ARGS)

# Exits 0 only when the demo's verdict holds and the paper's choices (the critic's advantages, the
# test-count reward) beat their ablated alternatives beyond the noise.
ablation:
	$(PY) -m t1jax.cli demo $(DEMO_ARGS) --ablation

test-slow:
	$(PY) -m pytest -m "slow" -q

# The wheel built, installed in a fresh venv (dependencies from $(VENV), no network) and run from
# another directory: t1jax plan and t1jax eval --agent oracle (tests/test_wheel.py, ~1 min).
test-wheel:
	$(PY) -m pytest -m wheel -q -n 0 tests/test_wheel.py

# The fidelity corpus through check-tasks on the local and the container backend.
test-containers: setup-containers
	$(PY) -m pytest -m containers -n $(PYTEST_WORKERS) -q tests/sandbox/test_fidelity_corpus.py \
		tests/sandbox_service/test_load.py

# The speed figures of the embedded default in one table (bench/table.py); bench-all runs every
# bench script alone, each printing its own ratios.
bench:
	$(PY) bench/table.py

bench-all:
	@for script in $(filter-out bench/table.py,$(wildcard bench/*.py)); do echo "== $$script"; $(PY) $$script || exit 1; done

lint:
	$(PY) -m ruff check t1jax sandbox_service tests bench

setup-tpu:
	@test -n "$(TPU_PYTHON)" || { echo "setup-tpu: no Python 3.12 found; pass TPU_PYTHON=/path/to/python3.12"; exit 2; }
	nice -n 10 $(TPU_PYTHON) -m venv $(TPU_VENV)
	nice -n 10 $(TPU_PY) -m pip install --upgrade pip
	nice -n 10 $(TPU_PY) -m pip install -e ".[tpu,dev]"

# Harbor interoperability (docs/harbor.md): a Python 3.12 venv with the pinned `harbor` from PyPI
# (its own pydantic models, job reader and viewer), t1jax installed there without its dependencies;
# the jobs Harbor reads are written by `t1jax eval` in $(VENV). ~1 min to build.
HARBOR_VERSION ?= 0.26.0
HARBOR_PYTHON ?= $(TPU_PYTHON)
HARBOR_VENV ?= .venv-harbor
HARBOR_PY := $(HARBOR_VENV)/bin/python

setup-harbor:
	@test -n "$(HARBOR_PYTHON)" || { echo "setup-harbor: no Python 3.12 found; pass HARBOR_PYTHON=/path/to/python3.12"; exit 2; }
	nice -n 10 $(HARBOR_PYTHON) -m venv $(HARBOR_VENV)
	nice -n 10 $(HARBOR_PY) -m pip install -q --upgrade pip
	nice -n 10 $(HARBOR_PY) -m pip install -q "harbor==$(HARBOR_VERSION)" pytest
	nice -n 10 $(HARBOR_PY) -m pip install -q --no-deps -e .

# Harbor's own code reading our jobs, tasks and trajectories (tests/harbor).
test-harbor:
	@test -x $(HARBOR_PY) || { echo "test-harbor: $(HARBOR_VENV) is missing; run 'make setup-harbor' first"; exit 2; }
	@test -x $(PY) || { echo "test-harbor: $(VENV) is missing; run 'make setup' first"; exit 2; }
	T1JAX_HARBOR=1 T1JAX_PYTHON=$(PY) $(HARBOR_PY) -m pytest -m harbor tests/harbor -q -p no:cacheprovider

# Contract tests against the installed vLLM-TPU / tpu-inference / pathwaysutils, on CPU.
test-tpu-contract:
	@test -x $(TPU_PY) || { echo "test-tpu-contract: $(TPU_VENV) is missing; run 'make setup-tpu' first"; exit 2; }
	T1JAX_TPU_CONTRACT=1 JAX_PLATFORMS=cpu $(TPU_PY) -m pytest -m tpu_contract tests/tpu_contract -q -n 0 -p no:cacheprovider
