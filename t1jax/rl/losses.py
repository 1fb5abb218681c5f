"""PPO and SFT losses over loss-bearing rows (paper Eq. 17, Eq. 18; §4.4 on the reduction).

Reduction invariant: every loss here is a *token sum* over rows with `action_mask == 1`, divided
by `num_loss_tokens`, the number of loss-bearing rows in the **global** batch (all micro-batches,
all data-parallel shards), which the caller passes in. Summing a loss (and its gradient) over the
micro-batches of a batch therefore gives exactly the loss of the whole batch at once: gradient
accumulation and sharding do not change the objective. Normalising per micro-batch instead would
weight tokens of short micro-batches more and, for statistics, inflate them by the micro-batch
count (§4.4).

The auxiliary values each loss returns obey the same invariant (token sums / global count), so
the learner adds them across micro-batches to get batch means.

No KL term, no entropy bonus and no load-balancing term: the objective is deliberately spare
(§4.4). Paper Eq. 17 has no factor 1/2 and neither does `value_loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits: jax.Array, target_ids: jax.Array) -> jax.Array:
    """log softmax(logits)[target] per row: float32[B, T] from logits [B, T, V], targets [B, T].

    Computed as logit[target] - logsumexp(logits) so no [B, T, V] log-softmax is materialised.
    """
    logits = logits.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, target_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return target_logit - jax.nn.logsumexp(logits, axis=-1)


def _masked_mean(per_token: jax.Array, action_mask: jax.Array, num_loss_tokens: jax.Array) -> jax.Array:
    # `where`, not a product: a non-finite number on a padding row (0 * nan = nan) must not leak.
    total = jnp.sum(jnp.where(action_mask > 0, per_token.astype(jnp.float32), 0.0))
    return total / jnp.maximum(num_loss_tokens, 1.0)


def policy_loss(
    new_logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    action_mask: jax.Array,
    num_loss_tokens: jax.Array,
    *,
    clip_eps: float = 0.2,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate (Eq. 18): -E_j[min(r_j A_j, clip(r_j, 1 - eps, 1 + eps) A_j)].

    r_j = exp(new - old), with `old_logprobs` the trainer's own gradient-free recomputation under
    the same replayed routing (Eq. 26), never the sampler's. Aux (each a global-batch mean):
    `clip_fraction`: share of loss tokens where the clipped branch is strictly the smaller
    objective, i.e. where the clip removes the gradient (r > 1 + eps with A > 0, or r < 1 - eps
    with A < 0); `approx_kl`: E[(r - 1) - log r], the non-negative k3 estimator of
    KL(old || new); `ratio_mean`.
    """
    old_logprobs = jax.lax.stop_gradient(old_logprobs)
    advantages = jax.lax.stop_gradient(advantages)
    log_ratio = new_logprobs - old_logprobs
    ratio = jnp.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -jnp.minimum(unclipped, clipped)
    loss = _masked_mean(per_token, action_mask, num_loss_tokens)
    stats_ratio = jax.lax.stop_gradient(ratio)
    stats_log_ratio = jax.lax.stop_gradient(log_ratio)
    aux = {
        "clip_fraction": _masked_mean(
            (jax.lax.stop_gradient(clipped) < jax.lax.stop_gradient(unclipped)).astype(jnp.float32),
            action_mask,
            num_loss_tokens,
        ),
        "approx_kl": _masked_mean((stats_ratio - 1.0) - stats_log_ratio, action_mask, num_loss_tokens),
        "ratio_mean": _masked_mean(stats_ratio, action_mask, num_loss_tokens),
    }
    return loss, aux


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    action_mask: jax.Array,
    num_loss_tokens: jax.Array,
    *,
    clip_eps: float = 0.2,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss (Eq. 17): E_j[max((V - R)^2, (V_clip - R)^2)],
    V_clip = V_old + clip(V - V_old, -eps_v, eps_v), V_old the critic's pre-update values (Eq. 28).

    Aux: `value_clip_fraction`, the share of loss tokens where the clipped branch is strictly
    larger (the clip removes the gradient there).
    """
    old_values = jax.lax.stop_gradient(old_values)
    returns = jax.lax.stop_gradient(returns)
    clipped_values = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
    unclipped_error = jnp.square(values - returns)
    clipped_error = jnp.square(clipped_values - returns)
    loss = _masked_mean(jnp.maximum(unclipped_error, clipped_error), action_mask, num_loss_tokens)
    aux = {
        "value_clip_fraction": _masked_mean(
            jax.lax.stop_gradient(clipped_error > unclipped_error).astype(jnp.float32),
            action_mask,
            num_loss_tokens,
        )
    }
    return loss, aux


def sft_loss(
    logprobs: jax.Array, action_mask: jax.Array, num_loss_tokens: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked cross-entropy on the loss rows of stitched samples: -sum(m * log p) / global count.

    Aux: `mean_target_prob`, the mean probability given to the target token."""
    loss = _masked_mean(-logprobs, action_mask, num_loss_tokens)
    target_prob = jnp.exp(jax.lax.stop_gradient(logprobs))
    return loss, {"mean_target_prob": _masked_mean(target_prob, action_mask, num_loss_tokens)}
