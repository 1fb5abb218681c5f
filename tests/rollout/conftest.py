"""Fixtures for the sampler tests: the tiny policy, a JAX engine on the last 4 of the 8 fake CPU
devices (the trainer side of the tests uses the first 4), and request helpers.

One engine serves the whole session (compiling its steps is the expensive part). Tests that
publish other weights publish the original ones back before they end, and no test assumes a
particular policy version number."""

from __future__ import annotations

import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from t1jax.model import Qwen35MoeForCausalLM, load_config
from t1jax.rollout.engine import EngineConfig, JaxEngine

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
TEST_ENGINE_CONFIG = EngineConfig(max_batch=4, max_context=192, block_size=16)


def sharpen(model: nnx.Module, seed: int) -> None:
    """Make the random policy look like a trained one where it matters to a sampler: peaked
    next-token distributions (so top-k / top-p cut real mass) and router scores spread out (so
    top-k expert choice has no float-rounding ties). Every parameter is also perturbed."""
    rng = np.random.default_rng(seed)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(p) for p in path)
        value = np.asarray(variable.get_value(), np.float32)
        value = value + rng.standard_normal(value.shape).astype(np.float32) * 0.3 * max(
            float(value.std()), 0.1
        )
        if name == "lm_head":
            value = value * 30.0
        elif name.endswith("mlp.gate"):
            value = value * 20.0
        variable.set_value(jax.numpy.asarray(value, variable.get_value().dtype))


def make_policy(seed: int) -> Qwen35MoeForCausalLM:
    model = Qwen35MoeForCausalLM(load_config(TINY_YAML), rngs=nnx.Rngs(seed))
    sharpen(model, seed)
    return model


@pytest.fixture(scope="session")
def policy():
    return make_policy(11)


@pytest.fixture(scope="session")
def engine(policy):
    with JaxEngine(policy, jax.devices()[4:], TEST_ENGINE_CONFIG) as served:
        served.warmup()
        yield served


@pytest.fixture()
def prompt_rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def random_prompt(rng: np.random.Generator, length: int, vocab: int = 2048) -> np.ndarray:
    return rng.integers(0, vocab, length).astype(np.int32)
