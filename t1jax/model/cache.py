"""The decoding cache: everything a sampler keeps per sequence between forward calls.

Layout (a pytree; every leaf has the batch row as its leading axis, so a prefix cache can copy a
sequence's state with `take_rows` / `put_rows`, or `jax.tree.map(lambda a: a[row], cache)`):

  DecodeCache
    lengths        int32 [B]            tokens already in the cache for each row (its next position)
    layers         tuple, one entry per decoder layer, in layer order:
      AttentionLayerCache   (layer_types[i] == "full_attention")
        key, value [B, max_len, num_key_value_heads, head_dim]   compute dtype, after k_norm + RoPE;
                   slot s holds position s; slots >= lengths[b] are garbage and never read
      LinearLayerCache      (layer_types[i] == "linear_attention")
        conv_state      [B, linear_conv_kernel_dim - 1, conv_dim]  compute dtype: the last K-1
                        pre-conv qkv rows, oldest first (zeros before a sequence starts)
        recurrent_state [B, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]
                        float32: the delta-rule state S after the last cached token

Invariants: one sequence per row (no packing in a cache); the state of a row depends only on the
tokens fed to that row; a fresh row is all zeros with length 0. Routing records are not part of
the cache: `extend` / `decode_step` return them for the caller to keep.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from t1jax.model.config import FULL_ATTENTION, Qwen35MoeConfig


@struct.dataclass
class AttentionLayerCache:
    key: jax.Array
    value: jax.Array


@struct.dataclass
class LinearLayerCache:
    conv_state: jax.Array
    recurrent_state: jax.Array


@struct.dataclass
class DecodeCache:
    lengths: jax.Array
    layers: tuple[AttentionLayerCache | LinearLayerCache, ...]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        for layer in self.layers:
            if isinstance(layer, AttentionLayerCache):
                return layer.key.shape[1]
        return 2**31 - 1  # no attention layer: a pure recurrence has no length limit


def init_cache(config: Qwen35MoeConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> DecodeCache:
    """An empty cache for `batch_size` rows of up to `max_len` tokens."""
    layers: list[AttentionLayerCache | LinearLayerCache] = []
    for kind in config.layer_types:
        if kind == FULL_ATTENTION:
            shape = (batch_size, max_len, config.num_key_value_heads, config.head_dim)
            layers.append(AttentionLayerCache(key=jnp.zeros(shape, dtype), value=jnp.zeros(shape, dtype)))
        else:
            conv_shape = (batch_size, config.linear_conv_kernel_dim - 1, config.linear_conv_dim)
            state_shape = (
                batch_size,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
            )
            layers.append(
                LinearLayerCache(
                    conv_state=jnp.zeros(conv_shape, dtype),
                    recurrent_state=jnp.zeros(state_shape, jnp.float32),
                )
            )
    return DecodeCache(lengths=jnp.zeros((batch_size,), jnp.int32), layers=tuple(layers))


def take_rows(cache: DecodeCache, rows: jax.Array) -> DecodeCache:
    """The cache of the given rows (int [R]), e.g. to store a prefix."""
    return jax.tree.map(lambda leaf: leaf[rows], cache)


def put_rows(cache: DecodeCache, rows: jax.Array, source: DecodeCache) -> DecodeCache:
    """`cache` with rows `rows` (int [R]) replaced by the R rows of `source` (same max_len)."""
    return jax.tree.map(lambda leaf, src: leaf.at[rows].set(src.astype(leaf.dtype)), cache, source)
