"""The TPU contract suite runs only in the Python 3.12 environment that `make setup-tpu` builds
(vllm-tpu 0.32, tpu-inference 0.32, jax 0.11.2, pathwaysutils), on CPU, through `make
test-tpu-contract`. Elsewhere (the default 3.11 suite) this directory is not collected, since the
packages it checks against cannot be installed there; `T1JAX_TPU_CONTRACT=1` (set by the make
target) turns a missing package into a collection error instead of a silent skip."""

from __future__ import annotations

import importlib.util
import os

import pytest

_INSTALLED = all(importlib.util.find_spec(name) for name in ("vllm", "tpu_inference", "pathwaysutils"))
if not _INSTALLED:
    if os.environ.get("T1JAX_TPU_CONTRACT") == "1":
        raise pytest.UsageError(
            "the TPU contract suite needs vllm-tpu, tpu-inference and pathwaysutils: run `make setup-tpu`"
        )
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.tpu_contract)
