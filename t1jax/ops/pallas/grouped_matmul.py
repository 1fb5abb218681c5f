"""The grouped expert matmul through megablox `gmm` (JAX's Pallas TPU kernel, with its own
`custom_vjp`: `gmm` for the input gradient, `tgmm` for the weight gradient).

Contract: exactly `jax.lax.ragged_dot(lhs, rhs, group_sizes)`: rows of `lhs` [m, k] are grouped
consecutively by `group_sizes` [g] and group i is multiplied by `rhs[i]` [k, n]; rows past
`sum(group_sizes)` belong to no group and give zero (and get zero gradient). What this module
adds around `gmm`: padding `m` to the row tile (the kernel tiles rows in fixed blocks), the mask
for rows outside every group (the kernel never writes them), and a tiling that fits small
dimensions (a tile larger than a dimension is clipped to it, which keeps the TPU rule that a
block either divides into (8, 128) tiles or spans the whole axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

__all__ = ["megablox_grouped_matmul"]


def _clip_tiling(tiling: tuple[int, int, int], m: int, k: int, n: int) -> tuple[int, int, int]:
    tm, tk, tn = tiling
    return min(tm, m), min(tk, k), min(tn, n)


def megablox_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    tiling: tuple[int, int, int] = (128, 128, 128),
    interpret: bool = False,
) -> jax.Array:
    """`ragged_dot(lhs, rhs, group_sizes)` computed by megablox `gmm` (see the module docstring).
    The output dtype is `preferred_element_type` or, as for `ragged_dot`, the inputs' dtype."""
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"expected lhs [m, k], rhs [g, k, n], group_sizes [g]; got {lhs.shape}, {rhs.shape}, "
            f"{group_sizes.shape}"
        )
    if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"lhs {lhs.shape}, rhs {rhs.shape} and group_sizes {group_sizes.shape} disagree")
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
    m, k = lhs.shape
    n = rhs.shape[2]
    tm, tk, tn = _clip_tiling(tiling, m, k, n)
    pad = -m % tm
    group_sizes = group_sizes.astype(jnp.int32)
    rows = jnp.arange(m + pad, dtype=jnp.int32)[:, None]
    grouped = rows < jnp.sum(group_sizes)
    padded = jnp.pad(lhs, ((0, pad), (0, 0)))
    # Rows outside every group are never written by the kernel: give them (and their gradient) 0.
    padded = jnp.where(grouped, padded, jnp.zeros((), lhs.dtype))
    out = gmm(padded, rhs, group_sizes, out_dtype, (tm, tk, tn), None, None, False, bool(interpret))
    return jnp.where(grouped, out, jnp.zeros((), out.dtype))[:m]
