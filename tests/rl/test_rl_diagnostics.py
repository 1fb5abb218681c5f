"""Explained variance and |Δlogp| are global statistics (paper Eq. 15, Eq. 19)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from t1jax.rl.advantages import gae_advantages
from t1jax.rl.diagnostics import (
    Moments,
    explained_variance,
    explained_variance_from_moments,
    logprob_gap_sum,
    masked_moments,
)


def numpy_ev(returns, values):
    return 1.0 - np.var(returns - values) / np.var(returns)


def random_batch(rng, rows, length):
    returns = rng.normal(1.0, 2.0, size=(rows, length)).astype(np.float32)
    values = (returns + rng.normal(0.5, 1.0, size=(rows, length))).astype(np.float32)
    return returns, values


def test_ev_merged_over_uneven_shards_equals_numpy_on_the_whole_batch():
    rng = np.random.default_rng(0)
    returns, values = random_batch(rng, 8, 64)
    # Uneven shards: each row keeps a different number of loss tokens (3 ... 64).
    mask = np.zeros_like(returns)
    for row, keep in enumerate([3, 64, 10, 1, 40, 7, 25, 2]):
        mask[row, rng.choice(64, keep, replace=False)] = 1
    selected = mask > 0
    expected = numpy_ev(returns[selected], values[selected])

    merged_r, merged_e = Moments.empty(), Moments.empty()
    per_shard = []
    for row in range(8):
        r, v, m = (jnp.asarray(x[row : row + 1]) for x in (returns, values, mask))
        merged_r = merged_r.merge(masked_moments(r, m))
        merged_e = merged_e.merge(masked_moments(r - v, m))
        if row != 3:  # a one-token shard has zero variance
            per_shard.append(numpy_ev(returns[row][selected[row]], values[row][selected[row]]))
    assert float(explained_variance_from_moments(merged_r, merged_e)) == pytest.approx(expected, rel=1e-5)
    # The biased alternative (mean of per-shard EVs) is measurably different on this data.
    assert abs(np.mean(per_shard) - expected) > 1e-2


def test_ev_on_arrays_sharded_over_eight_devices_equals_numpy():
    devices = jax.devices()
    assert len(devices) == 8
    mesh = jax.make_mesh((8,), ("data",), devices=devices)
    rng = np.random.default_rng(1)
    returns, values = random_batch(rng, 8, 32)
    mask = (rng.random((8, 32)) < np.linspace(0.05, 0.95, 8)[:, None]).astype(np.float32)
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    args = [jax.device_put(jnp.asarray(x), sharding) for x in (returns, values, mask)]
    got = jax.jit(explained_variance)(*args)
    selected = mask > 0
    assert float(got) == pytest.approx(numpy_ev(returns[selected], values[selected]), rel=1e-5)
    # One device, same numbers.
    single = explained_variance(*(jnp.asarray(x) for x in (returns, values, mask)))
    assert float(got) == pytest.approx(float(single), rel=1e-6)


def test_ev_edge_cases():
    mask = jnp.ones((1, 4))
    returns = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    assert float(explained_variance(returns, jnp.full((1, 4), 2.5), mask)) == pytest.approx(0.0)
    # EV < 0: the critic adds variance (the cold-start regime of Fig. 7).
    assert float(explained_variance(returns, -returns, mask)) == pytest.approx(-3.0)
    assert np.isnan(float(explained_variance(jnp.ones((1, 4)), jnp.zeros((1, 4)), mask)))


@pytest.mark.parametrize("reward", [0.0, 0.1, 0.35])
def test_ev_is_undefined_when_every_sample_has_the_same_reward(reward):
    """GAE returns equal the reward at every action row in exact arithmetic, but float32 A + V
    leaves a spread of a few ulps of |V|: EV must say "undefined", not -1e13."""
    rng = np.random.default_rng(3)
    length = 300
    values = jnp.asarray(rng.normal(0.1, 0.2, (3, length)).astype(np.float32))
    mask = np.zeros((3, length), np.float32)
    mask[:, 100:130] = mask[:, 200:260] = 1  # two assistant turns per sample
    rewards = np.zeros((3, length), np.float32)
    rewards[:, 259] = reward
    _, returns = gae_advantages(
        jnp.asarray(rewards), values, jnp.asarray(mask), jnp.ones((3, length), jnp.int32)
    )
    assert float(np.ptp(np.asarray(returns)[mask > 0])) < 1e-6  # rounding spread only
    assert np.isnan(float(explained_variance(returns, values, jnp.asarray(mask))))
    # One sample with another reward makes EV defined again.
    rewards[0, 259] = reward + 0.05
    _, returns = gae_advantages(
        jnp.asarray(rewards), values, jnp.asarray(mask), jnp.ones((3, length), jnp.int32)
    )
    assert np.isfinite(float(explained_variance(returns, values, jnp.asarray(mask))))


def test_moments_merge_matches_numpy():
    rng = np.random.default_rng(2)
    chunks = [rng.normal(size=n).astype(np.float32) * 3 + 100 for n in (1, 17, 5, 200)]
    merged = Moments.empty()
    for chunk in chunks:
        merged = merged.merge(masked_moments(jnp.asarray(chunk), jnp.ones(len(chunk))))
    everything = np.concatenate(chunks)
    assert float(merged.count) == len(everything)
    assert float(merged.mean) == pytest.approx(everything.mean(), rel=1e-6)
    assert float(merged.variance) == pytest.approx(everything.var(), rel=1e-4)


def test_logprob_gap_is_mask_weighted():
    trainer = jnp.array([[-1.0, -0.5, -2.0, -9.0]])
    sampler = jnp.array([[-1.1, -0.5, -1.7, 0.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    total = logprob_gap_sum(trainer, sampler, mask)
    assert float(total) / 3 == pytest.approx((0.1 + 0.0 + 0.3) / 3, abs=1e-6)
