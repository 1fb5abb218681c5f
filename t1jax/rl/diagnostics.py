"""Batch-level diagnostics reduced over the whole batch (paper §4.4 Eq. 15, §4.5 Eq. 19).

Invariant: every statistic is a function of the *global* batch. A quantity computed per
micro-batch or per data-parallel shard and then averaged is biased (explained variance) or
inflated (a mean normalised by micro-batch count instead of token count, §4.4), so:
- means are token sums divided by the global number of loss-bearing rows;
- variances are carried as `Moments` (count, mean, sum of squared deviations) and merged exactly
  with Chan's parallel update, so uneven shards combine to the variance numpy would compute on
  the concatenated data.

The functions on arrays (`masked_moments`, `explained_variance`) reduce over every axis: under
`jit` on sharded arrays XLA performs the cross-device reduction, so the result is global too.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Moments:
    """Count, mean and M2 = sum of squared deviations of a masked sample (population variance
    = M2 / count)."""

    count: jax.Array
    mean: jax.Array
    m2: jax.Array

    @property
    def variance(self) -> jax.Array:
        return self.m2 / jnp.maximum(self.count, 1.0)

    def merge(self, other: Moments) -> Moments:
        """Exact moments of the union of the two samples (Chan et al.)."""
        count = self.count + other.count
        safe_count = jnp.maximum(count, 1.0)
        delta = other.mean - self.mean
        mean = self.mean + delta * other.count / safe_count
        m2 = self.m2 + other.m2 + jnp.square(delta) * self.count * other.count / safe_count
        return Moments(count, mean, m2)

    @staticmethod
    def empty() -> Moments:
        zero = jnp.zeros((), jnp.float32)
        return Moments(zero, zero, zero)


def masked_moments(x: jax.Array, mask: jax.Array) -> Moments:
    """Moments of x over positions where mask > 0 (two-pass: mean first, then deviations)."""
    selected = mask > 0
    x = jnp.where(selected, x.astype(jnp.float32), 0.0)  # non-finite padding must not leak
    count = jnp.sum(selected.astype(jnp.float32))
    mean = jnp.sum(x) / jnp.maximum(count, 1.0)
    m2 = jnp.sum(jnp.where(selected, jnp.square(x - mean), 0.0))
    return Moments(count, mean, m2)


# Smallest return spread EV resolves, relative to the magnitudes of R and V (128 float32 ulps).
_RESOLVABLE_RELATIVE_STD = 2.0**-16


def explained_variance_from_moments(returns: Moments, residuals: Moments) -> jax.Array:
    """EV = 1 - Var[R - V] / Var[R] (Eq. 19); NaN when Var[R] is 0 (EV is undefined then).

    "0" includes float32 rounding: GAE returns are computed as A + V, so a batch whose samples
    all share one reward (every trial failed, say) has a return spread of a few ulps of |V|, not
    0, and the ratio would read -1e13. A spread below `_RESOLVABLE_RELATIVE_STD` of the scale of
    R and V counts as none."""
    scale = jnp.square(returns.mean) + jnp.square(residuals.mean) + residuals.variance
    resolvable = returns.variance > (_RESOLVABLE_RELATIVE_STD**2) * scale
    safe_variance = jnp.where(resolvable, returns.variance, 1.0)
    return jnp.where(resolvable, 1.0 - residuals.variance / safe_variance, jnp.nan)


def explained_variance(returns: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    """EV over the loss-bearing rows of (possibly sharded) arrays, variances taken globally."""
    return explained_variance_from_moments(
        masked_moments(returns, mask), masked_moments(returns - values, mask)
    )


def logprob_gap_sum(trainer_logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """sum over loss rows of |trainer - sampler| log-prob (Eq. 15's d_j); divide by the global
    number of loss rows to get the paper's |Δlogp|."""
    return jnp.sum(jnp.where(mask > 0, jnp.abs(trainer_logprobs - sampler_logprobs), 0.0))
