"""Pallas' TPU splash-attention kernel behind the contract of the dense reference.

``splash_attention(query, key, value, segment_ids)`` = ``attend(query, key, value,
packed_causal_mask(segment_ids))`` on the rows that may read a key, computed by
``jax.experimental.pallas.ops.tpu.splash_attention`` (a block-sparse flash kernel with its own
forward and backward kernels): one causal MQA kernel per kv head (its query group as the kernel's
heads), vmapped over rows and kv heads, documents separated by the kernel's segment ids.

Layout glue only: queries are pre-scaled by head_dim**-0.5 (the kernel applies no scale), the
sequence is padded to a whole number of blocks (padding is its own segment 0; real queries never
read it), and the kernel's block-sparsity tables are built once per (length, block sizes). On a
non-TPU backend the kernel runs only in Pallas' interpreter (``interpret=True``: for tests at
small shapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["splash_attention"]


@functools.lru_cache(maxsize=32)
def _kernel(length: int, groups: int, block_q: int, block_k: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((length, length)) for _ in range(groups)])
    sizes = splash.BlockSizes(
        block_q=block_q,
        block_kv=block_k,
        block_kv_compute=block_k,
        block_q_dkv=block_q,
        block_kv_dkv=block_k,
        block_kv_dkv_compute=block_k,
        block_q_dq=block_q,
        block_kv_dq=block_k,
    )
    # Built once and cached across traces: its tables must be concrete arrays, not tracers.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa_single_device(mask=mask, block_sizes=sizes, interpret=interpret)


def splash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    segment_ids: jax.Array,
    *,
    block_q: int = 512,
    block_k: int = 512,
    interpret: bool = False,
) -> jax.Array:
    """query [B, T, heads, D], key/value [B, T, kv_heads, D], segment_ids int32 [B, T] ->
    [B, T, heads, D] in the value dtype (rows that may read nothing: unspecified, finite)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    from t1jax.ops.pallas import require_tpu_or_interpret

    require_tpu_or_interpret(
        "splash attention (it needs a TPU; else execution.attention: blockwise)", interpret
    )
    batch, length, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    groups = heads // kv_heads
    unit = max(block_q, block_k)
    padded = -(-length // unit) * unit
    block_q, block_k = min(block_q, padded), min(block_k, padded)
    pad = padded - length

    def pad_tokens(x):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    scaled = (query.astype(jnp.float32) * head_dim**-0.5).astype(query.dtype)
    q = pad_tokens(scaled).reshape(batch, padded, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)
    k = pad_tokens(key).transpose(0, 2, 1, 3)  # [B, KV, T, D]
    v = pad_tokens(value).transpose(0, 2, 1, 3)
    ids = pad_tokens(segment_ids.astype(jnp.int32))
    kernel = _kernel(padded, groups, block_q, block_k, interpret)

    def one_row(q_row, k_row, v_row, ids_row):
        segments = splash.SegmentIds(q=ids_row, kv=ids_row)
        return jax.vmap(lambda qg, kh, vh: kernel(qg, kh, vh, segment_ids=segments))(q_row, k_row, v_row)

    out = jax.vmap(one_row)(q, k, v.astype(key.dtype), ids)  # [B, KV, G, T, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, padded, heads, head_dim)
    return out[:, :length].astype(value.dtype)
