"""PPO, value and SFT losses on a 5-token toy, against numbers worked by hand."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.rl.losses import policy_loss, sft_loss, token_logprobs, value_loss

# Five rows; the last is not loss-bearing (its wild numbers must not matter).
MASK = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0])
NEW = jnp.array([-1.0, -0.2, -2.0, -0.3, -5.0])
OLD = jnp.array([-1.1, -0.6, -1.5, -0.6, -1.0])
ADV = jnp.array([0.5, 1.0, -2.0, -0.4, 3.0])
# ratios r = exp(new - old): e^0.1, e^0.4, e^-0.5, e^0.3
#   row 0: r = 1.1051709 inside the band             -> -r A = -0.5525855
#   row 1: r = 1.4918247 > 1.2 with A > 0: CLIPPED   -> -1.2 * 1.0 = -1.2
#   row 2: r = 0.6065307 < 0.8 with A < 0: CLIPPED   -> -0.8 * -2.0 = 1.6
#   row 3: r = 1.3498588 > 1.2 but A < 0: not clipped (the pessimistic min keeps r A) -> 0.5399435
# sum = 0.3873581; the global batch holds 4 loss tokens -> 0.0968395, or 8 -> 0.0484198


def test_policy_loss_hand_numbers():
    loss, aux = policy_loss(NEW, OLD, ADV, MASK, jnp.float32(4), clip_eps=0.2)
    assert float(loss) == pytest.approx(0.3873581 / 4, abs=1e-6)
    assert float(aux["clip_fraction"]) == pytest.approx(0.5)
    # k3: (r - 1) - log r = 0.0051709, 0.0918247, 0.1065307, 0.0498588
    assert float(aux["approx_kl"]) == pytest.approx(
        (0.0051709 + 0.0918247 + 0.1065307 + 0.0498588) / 4, abs=1e-6
    )
    # Normalised by the global loss-token count, not this micro-batch's: twice the count, half the loss.
    loss_global, _ = policy_loss(NEW, OLD, ADV, MASK, jnp.float32(8), clip_eps=0.2)
    assert float(loss_global) == pytest.approx(0.3873581 / 8, abs=1e-6)


def test_policy_gradient_is_zero_exactly_where_the_clip_engages():
    grad = jax.grad(lambda new: policy_loss(new, OLD, ADV, MASK, jnp.float32(4))[0])(NEW)
    # d/dnew of -r A = -A r (unclipped rows), 0 on clipped rows and off the mask.
    expected = [-0.5 * math.exp(0.1) / 4, 0.0, 0.0, 0.4 * math.exp(0.3) / 4, 0.0]
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-7)


def test_clip_engagement_grid():
    eps = 0.2
    log_ratios = np.log([0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0])
    for log_ratio, advantage in itertools.product(log_ratios, [-1.5, 1.5]):
        new, old = jnp.array([log_ratio - 1.0]), jnp.array([-1.0])
        adv, mask = jnp.array([advantage]), jnp.array([1.0])
        grad = jax.grad(lambda n, o, a, m: policy_loss(n, o, a, m, jnp.float32(1), clip_eps=eps)[0])(
            new, old, adv, mask
        )
        _, aux = policy_loss(new, old, adv, mask, jnp.float32(1), clip_eps=eps)
        ratio = math.exp(log_ratio)
        should_clip = (advantage > 0 and ratio > 1 + eps) or (advantage < 0 and ratio < 1 - eps)
        assert (float(grad[0]) == 0.0) == should_clip, (ratio, advantage)
        assert float(aux["clip_fraction"]) == float(should_clip)


def test_old_logprobs_and_advantages_carry_no_gradient():
    grads = jax.grad(lambda old, adv: policy_loss(NEW, old, adv, MASK, jnp.float32(4))[0], argnums=(0, 1))(
        OLD, ADV
    )
    assert all(float(jnp.abs(g).sum()) == 0.0 for g in grads)


V_NEW = jnp.array([0.5, 0.9, 0.1, 1.5, 2.0])
V_OLD = jnp.array([0.4, 0.5, 0.4, 0.4, 0.0])
RETURNS = jnp.array([1.0, 1.0, 0.0, 1.0, 1.0])
# eps_v = 0.2, V_clip = V_old + clip(V - V_old, -0.2, 0.2):
#   row 0: V_clip = 0.5 (inside)  -> (0.5-1)^2 = 0.25 both
#   row 1: V_clip = 0.7           -> max(0.01, 0.09) = 0.09   (clipped branch: no gradient)
#   row 2: V_clip = 0.2           -> max(0.01, 0.04) = 0.04   (clipped branch: no gradient)
#   row 3: V_clip = 0.6           -> max(0.25, 0.16) = 0.25   (unclipped branch: gradient flows)
# sum 0.63 over 4 loss tokens -> 0.1575


def test_value_loss_hand_numbers():
    loss, aux = value_loss(V_NEW, V_OLD, RETURNS, MASK, jnp.float32(4), clip_eps=0.2)
    assert float(loss) == pytest.approx(0.1575, abs=1e-6)
    assert float(aux["value_clip_fraction"]) == pytest.approx(0.5)
    grad = jax.grad(lambda v: value_loss(v, V_OLD, RETURNS, MASK, jnp.float32(4))[0])(V_NEW)
    # 2 (V - R) / 4 on unclipped-branch rows: row 0 -> -0.25, row 3 -> 0.25
    np.testing.assert_allclose(np.asarray(grad), [-0.25, 0.0, 0.0, 0.25, 0.0], atol=1e-6)


def test_token_logprobs_and_sft_loss():
    logits = jnp.array([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    targets = jnp.array([[2, 1]])
    logprobs = token_logprobs(logits, targets)
    lse = math.log(math.e + math.e**2 + math.e**3)
    np.testing.assert_allclose(np.asarray(logprobs), [[3.0 - lse, -math.log(3.0)]], atol=1e-6)
    loss, aux = sft_loss(jnp.array([-1.0, -2.0, -3.0]), jnp.array([0.0, 1.0, 1.0]), jnp.float32(2))
    assert float(loss) == pytest.approx(2.5)
    assert float(aux["mean_target_prob"]) == pytest.approx((math.exp(-2) + math.exp(-3)) / 2)


def test_nan_on_a_padding_row_does_not_poison_the_loss():
    new = NEW.at[4].set(jnp.nan)
    loss, aux = policy_loss(new, OLD, ADV, MASK, jnp.float32(4))
    assert float(loss) == pytest.approx(0.3873581 / 4, abs=1e-6)
    assert all(np.isfinite(float(v)) for v in aux.values())
