"""Optimizer construction (Adam betas, decoupled decay on matrices, clipping) and RL configs."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t1jax.rl.config import RLConfig, load_rl_config, rl_config_from_dict
from t1jax.rl.optim import OptimizerConfig, make_optimizer
from t1jax.rl.reward import RewardKind

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_first_adamw_step_by_hand():
    params = {"kernel": jnp.array([[1.0, 2.0]]), "scale": jnp.array([0.5])}
    grads = {"kernel": jnp.array([[3.0, 4.0]]), "scale": jnp.array([0.0])}
    optimizer = make_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.1, max_grad_norm=1.0))
    state = optimizer.init(params)
    updates, state = optimizer.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    # Clipped to norm 1: g = (0.6, 0.8). First Adam step: m_hat / sqrt(v_hat) = sign(g) = 1.
    # Decoupled decay on the matrix only: p - lr * (1 + wd * p).
    np.testing.assert_allclose(np.asarray(new["kernel"]), [[1 - 0.1 - 0.01, 2 - 0.1 - 0.02]], rtol=1e-6)
    # (eps = 1e-8 keeps a zero gradient's step at 0.)
    np.testing.assert_allclose(np.asarray(new["scale"]), [0.5])  # vectors are not decayed
    # beta2 = 0.98: nu = (1 - 0.98) g^2 after one step; beta1 = 0.9: mu = 0.1 g.
    adam_state = state[1][0]
    np.testing.assert_allclose(np.asarray(adam_state.nu["kernel"]), [[0.02 * 0.36, 0.02 * 0.64]], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(adam_state.mu["kernel"]), [[0.06, 0.08]], rtol=1e-5)


def test_a_warmup_ramps_each_adam_step_by_hand():
    """warmup_updates=4: a constant gradient's Adam steps are exactly the rate (m_hat / sqrt(v_hat)
    = 1), so the parameter moves by lr * k / 4 at update k = 1..4, then by lr."""
    lr = 0.1
    config = OptimizerConfig(learning_rate=lr, weight_decay=0.0, max_grad_norm=0.0, warmup_updates=4)
    optimizer = make_optimizer(config)
    params = {"w": jnp.array([0.0])}
    state = optimizer.init(params)
    steps = []
    for _ in range(6):
        updates, state = optimizer.update({"w": jnp.array([2.0])}, state, params)
        new = optax.apply_updates(params, updates)
        steps.append(float(params["w"][0] - new["w"][0]))
        params = new
    expected = [lr * 1 / 4, lr * 2 / 4, lr * 3 / 4, lr, lr, lr]
    np.testing.assert_allclose(steps, expected, rtol=1e-5)
    assert [float(config.learning_rate_at(k)) for k in range(1, 7)] == pytest.approx(expected)
    constant = OptimizerConfig(learning_rate=lr)
    assert constant.warmup_updates == 0 and constant.learning_rate_at(1) == lr  # the paper's default
    with pytest.raises(ValueError, match="warmup_updates must be an integer >= 0"):
        OptimizerConfig(learning_rate=lr, warmup_updates=-1)
    config = rl_config_from_dict({"critic_optimizer": {"learning_rate": 3e-3, "warmup_updates": 8}})
    assert config.critic_optimizer.warmup_updates == 8 and config.actor_optimizer.warmup_updates == 0


def test_a_decay_to_zero_lowers_each_adam_step_by_hand():
    """decay_updates=4 after warmup_updates=2: a constant gradient's Adam step is the rate itself,
    lr * min(1, k / 2) * (1 - (k - 1) / 4) at update k, and 0 past the decay."""
    lr = 0.1
    config = OptimizerConfig(
        learning_rate=lr, weight_decay=0.0, max_grad_norm=0.0, warmup_updates=2, decay_updates=4
    )
    optimizer = make_optimizer(config)
    params = {"w": jnp.array([0.0])}
    state = optimizer.init(params)
    steps = []
    for _ in range(6):
        updates, state = optimizer.update({"w": jnp.array([-3.0])}, state, params)
        new = optax.apply_updates(params, updates)
        steps.append(float(new["w"][0] - params["w"][0]))
        params = new
    expected = [lr * 0.5 * 1.0, lr * 1.0 * 0.75, lr * 0.5, lr * 0.25, 0.0, 0.0]
    np.testing.assert_allclose(steps, expected, rtol=1e-5, atol=1e-9)
    assert [float(config.learning_rate_at(k)) for k in range(1, 7)] == pytest.approx(expected)
    with pytest.raises(ValueError, match="decay_updates must be an integer >= 0"):
        OptimizerConfig(learning_rate=lr, decay_updates=2.5)


def test_defaults_are_the_paper_values():
    config = RLConfig()
    assert config.actor_optimizer.learning_rate == pytest.approx(1e-6)
    assert config.critic_optimizer.learning_rate == pytest.approx(1.5e-5)
    assert (config.actor_optimizer.b1, config.actor_optimizer.b2, config.actor_optimizer.weight_decay) == (
        0.9,
        0.98,
        0.1,
    )
    assert (config.ppo.clip_eps, config.ppo.value_clip_eps) == (0.2, 0.2)
    assert (config.advantages.gamma, config.advantages.lam, config.advantages.normalize) == (1.0, 1.0, False)
    assert config.reward.kind is RewardKind.TEST_COUNT and config.reward.scale == 20.0


def test_shipped_yaml_files_load():
    default = load_rl_config(CONFIGS / "rl_default.yaml")
    assert default.actor_optimizer == RLConfig().actor_optimizer
    assert default.critic_optimizer == RLConfig().critic_optimizer
    assert default.ppo == RLConfig().ppo and default.advantages == RLConfig().advantages
    tiny = load_rl_config(CONFIGS / "rl_tiny.yaml")
    assert tiny.batching.row_length_buckets == (16, 32, 64)


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['gama'\] in section 'advantages'"):
        rl_config_from_dict({"advantages": {"gama": 0.9}})
    with pytest.raises(ValueError, match="unknown RL config section"):
        rl_config_from_dict({"kl": {}})
    with pytest.raises(ValueError, match="section 'ppo'.*must be >= 1"):
        rl_config_from_dict({"ppo": {"minibatches": 0}})
    with pytest.raises(ValueError, match="learning_rate must be positive"):
        rl_config_from_dict({"critic_optimizer": {"learning_rate": -1}})
