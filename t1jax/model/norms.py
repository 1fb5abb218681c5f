"""RMS norms of Qwen3.5: the zero-centred `RMSNorm` and the Gated DeltaNet's `GatedRMSNorm`.

Invariants: statistics are computed in float32 whatever the compute dtype; `RMSNorm` scales by
`(1 + weight)` with weight initialised to 0 (used for the residual-stream norms, the final norm
and the attention q/k norms); `GatedRMSNorm` scales by a *plain* `weight` (initialised to 1) and
multiplies by `silu(gate)`, as transformers' `Qwen3_5MoeRMSNormGated` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from t1jax.model.axes import NORM
from t1jax.model.params import make_param, ones, zeros


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: `rmsnorm(x) * (1 + weight)`, computed in float32, returned in x's dtype."""

    def __init__(self, size: int, *, eps: float, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = make_param(rngs, zeros, (size,), param_dtype, (NORM,))

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = 1.0 + self.weight[...].astype(jnp.float32)
        return (rms_normalize(x, self.eps) * scale).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """`weight * rmsnorm(x) * silu(gate)` over the last axis (one head's values)."""

    def __init__(self, size: int, *, eps: float, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = make_param(rngs, ones, (size,), param_dtype, (NORM,))

    def __call__(self, x: jax.Array, gate: jax.Array, *, dtype) -> jax.Array:
        # transformers rounds the normalised value to the compute dtype before the scale; we
        # follow it so bf16 runs match the reference's rounding points.
        normalized = rms_normalize(x, self.eps).astype(dtype)
        scaled = self.weight[...].astype(dtype) * normalized
        return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)
