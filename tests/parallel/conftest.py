"""Fixtures for the parallel tests: the jaxlib 0.10 CPU trsm workaround around every test (see
``t1jax.parallel.cpu_compat``), the tiny config and a randomised tiny model."""

from __future__ import annotations

import pytest
from flax import nnx

from t1jax.model import Qwen35MoeForCausalLM, load_config
from t1jax.parallel.cpu_compat import xla_triangular_solve_on_cpu
from tests.model.model_helpers import TINY_YAML, randomize_all


@pytest.fixture(autouse=True)
def _no_lapack_trsm_deadlock():
    with xla_triangular_solve_on_cpu():
        yield


@pytest.fixture(scope="session")
def tiny_config():
    return load_config(TINY_YAML)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    model = Qwen35MoeForCausalLM(tiny_config, rngs=nnx.Rngs(11))
    randomize_all(model, seed=11)
    return model
