"""Fixtures for the parallel tests: the tiny config and a randomised tiny model."""

from __future__ import annotations

import pytest
from flax import nnx

from t1jax.model import Qwen35MoeForCausalLM, load_config
from tests.model.model_helpers import TINY_YAML, randomize_all


@pytest.fixture(scope="session")
def tiny_config():
    return load_config(TINY_YAML)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    model = Qwen35MoeForCausalLM(tiny_config, rngs=nnx.Rngs(11))
    randomize_all(model, seed=11)
    return model
