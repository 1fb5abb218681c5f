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
    """Router scores spread out (as trained routers have them) so that top-k has no near-ties: a
    sharded run re-associates sums (the MoE runs per shard, on another row count), and a tie
    flipped by the last bit would change a routing choice and everything after it."""
    model = Qwen35MoeForCausalLM(tiny_config, rngs=nnx.Rngs(11))
    randomize_all(model, seed=11)
    for layer in model.model.layers:
        layer.mlp.gate.set_value(layer.mlp.gate[...] * 20.0)
    return model
