"""GAE over stitched streams with masked observation gaps, against hand-worked numbers."""

import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.rl.advantages import gae_advantages, leave_one_out_baselines, normalize_advantages

# One sample, 8 prediction rows: two assistant turns (rows 1-2 and 5-6) around a two-row
# observation (rows 3-4) and a trailing masked row. Values at masked rows are deliberately wild:
# they must never be read.
MASK = np.array([[0, 1, 1, 0, 0, 1, 1, 0]], np.float32)
VALUES = np.array([[9.0, 0.5, 0.4, 7.0, -3.0, 0.2, 0.1, 5.0]], np.float32)
REWARD = np.array([[0, 0, 0, 0, 0, 0, 1.0, 0]], np.float32)  # on the last action row
SEGMENTS = np.ones((1, 8), np.int32)


def gae(rewards, values, mask, segments, **kw):
    a, r = gae_advantages(
        jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), jnp.asarray(segments), **kw
    )
    return np.asarray(a), np.asarray(r)


def test_gamma_lambda_one_telescopes_across_the_observation_gap():
    advantages, returns = gae(REWARD, VALUES, MASK, SEGMENTS)
    # A_i = r - V_i on every action row, R_i = r: piecewise-constant returns (§4.5).
    np.testing.assert_allclose(advantages, [[0, 0.5, 0.6, 0, 0, 0.8, 0.9, 0]], atol=1e-6)
    np.testing.assert_allclose(returns, [[0, 1, 1, 0, 0, 1, 1, 0]], atol=1e-6)


def test_discounting_counts_actions_not_observation_tokens():
    # gamma = 0.9, lambda = 0.5 (gamma * lambda = 0.45), worked by hand:
    # delta6 = 1 + 0.9*0 - 0.1 = 0.9;  delta5 = 0.9*0.1 - 0.2 = -0.11
    # delta2 = 0.9*0.2 - 0.4 = -0.22 (row 5 bootstraps row 2: the masked rows 3-4 are skipped)
    # delta1 = 0.9*0.4 - 0.5 = -0.14
    # A6 = 0.9; A5 = -0.11 + 0.45*0.9 = 0.295; A2 = -0.22 + 0.45*0.295 = -0.08725
    # A1 = -0.14 + 0.45*(-0.08725) = -0.1792625;  R = A + V
    advantages, returns = gae(REWARD, VALUES, MASK, SEGMENTS, gamma=0.9, lam=0.5)
    np.testing.assert_allclose(advantages, [[0, -0.1792625, -0.08725, 0, 0, 0.295, 0.9, 0]], atol=1e-6)
    np.testing.assert_allclose(returns, [[0, 0.3207375, 0.31275, 0, 0, 0.495, 1.0, 0]], atol=1e-6)


def test_values_and_rewards_at_masked_rows_are_never_read():
    rng = np.random.default_rng(0)
    for gamma, lam in [(1.0, 1.0), (0.9, 0.5)]:
        expected = gae(REWARD, VALUES, MASK, SEGMENTS, gamma=gamma, lam=lam)
        noisy_values = np.where(MASK > 0, VALUES, rng.normal(size=VALUES.shape) * 100).astype(np.float32)
        noisy_rewards = np.where(MASK > 0, REWARD, rng.normal(size=REWARD.shape)).astype(np.float32)
        got = gae(noisy_rewards, noisy_values, MASK, SEGMENTS, gamma=gamma, lam=lam)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_packed_samples_do_not_leak_into_each_other():
    # Row of two packed samples (segments 1 and 2) and padding (segment 0).
    segments = np.array([[1, 1, 1, 2, 2, 2, 0, 0]], np.int32)
    mask = np.array([[0, 1, 1, 0, 1, 1, 1, 1]], np.float32)  # mask on padding must not count
    values = np.array([[0, 0.25, 0.5, 3, 0.125, 0.75, 4, 4]], np.float32)
    rewards = np.array([[0, 0, 0.5, 0, 0, 1.0, 9, 9]], np.float32)
    advantages, returns = gae(rewards, values, mask, segments)
    np.testing.assert_allclose(advantages, [[0, 0.25, 0.0, 0, 0.875, 0.25, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(returns, [[0, 0.5, 0.5, 0, 1.0, 1.0, 0, 0]], atol=1e-6)
    # With gamma < 1 the first sample's last action is terminal (no bootstrap from sample 2):
    advantages, _ = gae(rewards, values, mask, segments, gamma=0.5, lam=1.0)
    assert advantages[0, 2] == pytest.approx(0.5 - 0.5)  # r - V, no 0.5 * V(row 4) term
    assert advantages[0, 1] == pytest.approx((0.5 * 0.5 - 0.25) + 0.5 * 0.0)


def test_matches_a_sequential_loop_on_random_streams():
    rng = np.random.default_rng(1)
    batch, length = 3, 23
    rewards = rng.normal(size=(batch, length)).astype(np.float32)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    mask = (rng.random((batch, length)) < 0.6).astype(np.float32)
    segments = np.array(
        [[1] * 7 + [2] * 9 + [3] * 4 + [0] * 3, [1] * 23, [1] * 3 + [2] * 15 + [0] * 5], np.int32
    )
    for gamma, lam in [(1.0, 1.0), (0.95, 0.9), (0.5, 0.0)]:
        advantages, returns = gae(rewards, values, mask, segments, gamma=gamma, lam=lam)
        expected_a = np.zeros_like(rewards)
        for b in range(batch):
            for seg in set(segments[b]) - {0}:
                next_value = next_advantage = 0.0
                for i in reversed([i for i in range(length) if segments[b, i] == seg and mask[b, i]]):
                    delta = rewards[b, i] + gamma * next_value - values[b, i]
                    expected_a[b, i] = next_advantage = delta + gamma * lam * next_advantage
                    next_value = values[b, i]
        np.testing.assert_allclose(advantages, expected_a, atol=2e-5)
        np.testing.assert_allclose(
            returns, np.where(mask * (segments > 0) > 0, expected_a + values, 0), atol=2e-5
        )


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match="shapes differ"):
        gae(REWARD, VALUES[:, :4], MASK, SEGMENTS)


def test_normalisation_uses_the_given_global_statistics():
    advantages = jnp.array([[0.0, 1.0, 3.0, 7.0]])
    mask = jnp.array([[0, 1, 1, 0]])
    out = normalize_advantages(advantages, mask, mean=jnp.float32(2.0), std=jnp.float32(4.0), eps=0.0)
    np.testing.assert_allclose(np.asarray(out), [[0, -0.25, 0.25, 0]])


def test_leave_one_out_baselines_by_hand():
    # task a: trajectories x (1.0), y (0.0, two compaction segments), z (0.5); task b: w alone.
    tasks = ["a", "a", "a", "b", "a"]
    trajectories = ["x", "y", "y", "w", "z"]
    rewards = [1.0, 0.0, 0.0, 0.3, 0.5]
    baselines = leave_one_out_baselines(tasks, trajectories, rewards)
    np.testing.assert_allclose(baselines[[0, 1, 2, 4]], [0.25, 0.75, 0.75, 0.5])  # y counted once
    assert np.isnan(baselines[3])
    with pytest.raises(ValueError, match="trajectory y: its samples disagree"):
        leave_one_out_baselines(tasks, trajectories, [1.0, 0.0, 0.2, 0.3, 0.5])
