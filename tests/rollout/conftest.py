"""Fixtures for the sampler tests: the tiny policy, a JAX engine on the last 4 of the 8 fake CPU
devices (the trainer side of the tests uses the first 4), and a per-test prompt generator.

One engine serves the whole session (compiling its steps is the expensive part). Tests that
publish other weights publish the original ones back before they end, and no test assumes a
particular policy version number."""

from __future__ import annotations

import zlib

import jax
import numpy as np
import pytest
from rollout_helpers import TEST_ENGINE_CONFIG, make_policy

from t1jax.rollout.engine import JaxEngine


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
