"""The MoE's grouped matmul: ``lax.ragged_dot`` where the backend has a kernel for it, a tiled
gather-matmul-scatter on CPU.

``grouped_matmul(lhs, rhs, group_sizes)``: lhs [M, K] holds rows sorted by group (group g is the
``group_sizes[g]`` rows after the previous groups' rows), rhs [G, K, N]; row r of group g gives
``lhs[r] @ rhs[g]``. Rows past the last group are 0 here and unspecified for ``ragged_dot``.

Why a CPU form: XLA:CPU lowers ``ragged_dot`` densely, every row against every group's matrix
and a select (G x the work and a [G, M, N] temporary), which is most of a CPU MoE step. The
tiled form cuts each group into tiles of ``tile`` rows (the last one padded), multiplies each tile
by its group's matrix in one batched matmul, and scatters the rows back: (M + G * tile) x K x N
work. Each output row is the same K-term dot product in both forms. The choice is made per
lowering platform (``lax.platform_dependent``), so a program lowered on a CPU host for TPU keeps
``ragged_dot``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["grouped_matmul", "tiled_grouped_matmul"]


def tiled_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, tile: int = 64):
    """The tiled form of ``grouped_matmul`` (see the module docstring), for any backend."""
    rows = lhs.shape[0]
    groups = rhs.shape[0]
    tile = max(1, min(tile, rows))
    num_tiles = -(-rows // tile) + groups  # enough for any split of the rows into groups
    sizes = jnp.asarray(group_sizes, jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    tiles_per_group = -(-sizes // tile)
    first_tile = jnp.cumsum(tiles_per_group) - tiles_per_group
    tile_index = jnp.arange(num_tiles, dtype=jnp.int32)
    # The group of each tile (tiles past the last group's land on group G and are masked out).
    group = jnp.sum(tile_index[:, None] >= (first_tile + tiles_per_group)[None, :], axis=1)
    used = group < groups
    group = jnp.minimum(group, groups - 1)
    offset = (tile_index - first_tile[group]) * tile
    row = starts[group][:, None] + offset[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]
    valid = used[:, None] & (offset[:, None] + jnp.arange(tile)[None, :] < sizes[group][:, None])
    gathered = jnp.where(valid[..., None], jnp.take(lhs, jnp.where(valid, row, 0), axis=0), 0)
    products = jnp.einsum(
        "tbk,tkn->tbn", gathered, jnp.take(rhs, group, axis=0), preferred_element_type=jnp.float32
    ).astype(lhs.dtype)
    # Padding slots of the tiles go to distinct out-of-range rows (dropped), so every index of the
    # scatter is unique, as it promises.
    slot = jnp.arange(num_tiles * tile, dtype=jnp.int32).reshape(num_tiles, tile)
    target = jnp.where(valid, row, rows + slot).reshape(-1)
    out = jnp.zeros((rows, rhs.shape[2]), lhs.dtype)
    return out.at[target].set(products.reshape(-1, rhs.shape[2]), mode="drop", unique_indices=True)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [M, K] sorted by group, rhs [G, K, N], group_sizes int [G] -> [M, N] (lhs dtype)."""
    return lax.platform_dependent(
        lhs,
        rhs,
        group_sizes,
        cpu=lambda a, b, s: tiled_grouped_matmul(a, b, s),
        default=lambda a, b, s: lax.ragged_dot(a, b, s),
    )
