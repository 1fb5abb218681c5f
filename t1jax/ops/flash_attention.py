"""Blockwise (flash-style) causal attention over packed documents, in pure JAX, with its own VJP.

``blockwise_attention(query, key, value, q_segment_ids=, kv_segment_ids=, q_index=)`` computes,
for every query row, ``softmax(q k^T / sqrt(D)) v`` over the keys it may read, without ever
forming a [T, T] score matrix or mask: queries are cut into blocks of ``block_q`` rows, keys into
blocks of ``block_k``, and each query block runs an online softmax (running max, running
normaliser, float32 accumulator) over the key blocks it can see. The backward pass is blockwise
too (a ``jax.custom_vjp``): it keeps only the output and the per-row log-sum-exp of the forward
and recomputes each block's probabilities.

Mask, per (query, key): key index j <= ``q_index`` of the query (the query's row coordinate in the
key sequence, default its own index), same document (``q_segment_ids == kv_segment_ids``) and a
real key (``kv_segment_ids != 0``). Keys are in row order 0..S-1; queries may be in any order
(the context-parallel zigzag layout passes each local query's original row coordinate).

Block skipping: a query block reads only the key blocks from the one holding the start of its
earliest query's document to the one holding its latest query (documents are contiguous runs of
one segment id, the model's packing contract); inside that range the mask is applied per block.
So causal attention costs about half of dense, a row packed with n equal documents about 1/n, and
in the zigzag layout every context shard does the same work. Skipping never changes a result: a
skipped block holds no key any of the block's queries may read.

GQA: query head h reads kv head h // (heads // kv_heads); the group's heads are folded into the
rows of one matmul per kv head.

Numerics: scores, the softmax statistics and the output accumulator are float32; probabilities
are cast to the value dtype before the probability-value product (as the dense reference rounds
them). A query that may read no key (padding) returns zeros. Against the dense softmax the result
differs only by the re-association of the normaliser (float32 rounding), forward and backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from t1jax.ops.varying import varying_like

__all__ = ["blockwise_attention", "document_starts", "visited_key_blocks"]

_NEG_INF = float("-inf")


def document_starts(segment_ids: jax.Array) -> jax.Array:
    """int32 [B, T]: the row index where each token's run of equal segment ids begins."""
    length = segment_ids.shape[1]
    index = jnp.arange(length, dtype=jnp.int32)[None, :]
    first = jnp.ones_like(segment_ids[:, :1], dtype=bool)
    starts = jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return lax.cummax(jnp.where(starts, index, 0), axis=1).astype(jnp.int32)


def _check(query, key, value, q_segment_ids, kv_segment_ids, q_index):
    if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
        raise ValueError(
            f"query must be [B, T, heads, D] and key/value [B, S, kv_heads, D], got {query.shape}, "
            f"{key.shape}, {value.shape}"
        )
    batch, q_len, heads, head_dim = query.shape
    if key.shape[0] != batch or key.shape[3] != head_dim or heads % key.shape[2]:
        raise ValueError(
            f"key {key.shape} does not fit query {query.shape} (same batch and head_dim, heads a "
            "multiple of kv_heads)"
        )
    for name, array, want in (
        ("q_segment_ids", q_segment_ids, (batch, q_len)),
        ("kv_segment_ids", kv_segment_ids, key.shape[:2]),
        ("q_index", q_index, (batch, q_len)),
    ):
        if array is not None and tuple(array.shape) != want:
            raise ValueError(f"{name} must be {want}, got {tuple(array.shape)}")


def blockwise_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    q_index: jax.Array | None = None,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """query [B, T, heads, D], key/value [B, S, kv_heads, D], segment ids int32 [B, T] / [B, S],
    ``q_index`` int32 [B, T] (default ``arange(T)``, then T must equal S). Returns [B, T, heads, D]
    in the value dtype. See the module docstring for the mask and the numerics."""
    _check(query, key, value, q_segment_ids, kv_segment_ids, q_index)
    batch, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    if q_index is None:
        if q_len != kv_len:
            raise ValueError(f"q_index is required when T ({q_len}) differs from S ({kv_len})")
        q_index = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32), (batch, q_len))
    block_q = max(1, min(block_q, q_len))
    block_k = max(1, min(block_k, kv_len))
    groups = heads // kv_heads

    # Pad both sequences to whole blocks: padded queries read nothing, padded keys are padding.
    q_pad, k_pad = -q_len % block_q, -kv_len % block_k
    q_segment_ids = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, q_pad)))
    q_index = jnp.pad(q_index.astype(jnp.int32), ((0, 0), (0, q_pad)), constant_values=-1)
    kv_segment_ids = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, k_pad)))
    # [B, T, H, D] -> [B, KV, T, G, D]: a query block of one kv head is one [bq * G, D] matrix.
    q = jnp.pad(query, ((0, 0), (0, q_pad), (0, 0), (0, 0)))
    q = q.reshape(batch, q_len + q_pad, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    k = jnp.pad(key, ((0, 0), (0, k_pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    v = jnp.pad(value, ((0, 0), (0, k_pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    out = _attention(q, k, v, q_segment_ids, kv_segment_ids, q_index, block_q, block_k)
    out = out.transpose(0, 2, 1, 3, 4).reshape(batch, q_len + q_pad, heads, head_dim)
    return out[:, :q_len]


# --------------------------------------------------------------------------------------------------
# block bookkeeping
# --------------------------------------------------------------------------------------------------


def _key_block_ranges(q_segment_ids, kv_segment_ids, q_index, block_q, block_k):
    """Per query block i, the key blocks [lo_i, hi_i) it may read (int32 [nq] each), and the
    boolean [nq, nk] table of (query block, key block) pairs inside those ranges."""
    batch, q_total = q_index.shape
    num_q, num_k = q_total // block_q, kv_segment_ids.shape[1] // block_k
    kv_len = kv_segment_ids.shape[1]
    starts = document_starts(kv_segment_ids)  # in key (row) coordinates
    real = (q_index >= 0) & (q_segment_ids != 0)
    clipped = jnp.clip(q_index, 0, kv_len - 1)
    q_start = jnp.take_along_axis(starts, clipped, axis=1)
    # Over the whole batch: one range per query block (the rows of a block run together).
    first = jnp.where(real, q_start, kv_len).reshape(batch, num_q, block_q).min(axis=(0, 2))
    last = jnp.where(real, q_index, -1).reshape(batch, num_q, block_q).max(axis=(0, 2))
    lo = (first // block_k).astype(jnp.int32)
    hi = jnp.where(last >= 0, last // block_k + 1, 0).astype(jnp.int32)
    hi = jnp.maximum(hi, lo)
    blocks = jnp.arange(num_k, dtype=jnp.int32)
    needed = (blocks[None, :] >= lo[:, None]) & (blocks[None, :] < hi[:, None])
    return lo, jnp.minimum(hi, num_k), needed


def visited_key_blocks(q_segment_ids, kv_segment_ids, q_index, *, block_q: int, block_k: int) -> jax.Array:
    """int32 [num query blocks]: how many key blocks each query block of ``blockwise_attention``
    reads (the work it does), for T a multiple of ``block_q`` and S of ``block_k``."""
    lo, hi, _ = _key_block_ranges(
        q_segment_ids.astype(jnp.int32),
        kv_segment_ids.astype(jnp.int32),
        q_index.astype(jnp.int32),
        block_q,
        block_k,
    )
    return hi - lo


def _block_mask(q_seg, q_idx, kv_seg, k_first, block_k, groups):
    """bool [B, 1, bq * G, bk] for one block pair (q_seg, q_idx [B, bq]; kv_seg [B, bk]; keys
    k_first .. k_first + bk - 1)."""
    k_idx = k_first + jnp.arange(block_k, dtype=jnp.int32)
    allowed = (
        (k_idx[None, None, :] <= q_idx[:, :, None])
        & (q_seg[:, :, None] == kv_seg[:, None, :])
        & (kv_seg[:, None, :] != 0)
    )
    allowed = jnp.repeat(allowed, groups, axis=1)  # rows are (query, group) pairs
    return allowed[:, None]


def _scores(q_blk, k_blk, scale):
    """[B, KV, R, D] x [B, KV, bk, D] -> float32 [B, KV, R, bk], scaled."""
    s = jnp.einsum("bhrd,bhsd->bhrs", q_blk, k_blk, preferred_element_type=jnp.float32)
    return s * scale


# --------------------------------------------------------------------------------------------------
# forward and backward
# --------------------------------------------------------------------------------------------------


def _forward(q, k, v, q_segment_ids, kv_segment_ids, q_index, block_q, block_k):
    """q [B, KV, Tq, G, D]; k, v [B, KV, S, D] (both padded to whole blocks).
    Returns out [B, KV, Tq, G, D] (value dtype) and lse float32 [B, KV, Tq * G]."""
    batch, kv_heads, q_total, groups, head_dim = q.shape
    num_q = q_total // block_q
    rows = block_q * groups
    scale = head_dim**-0.5
    lo, hi, _ = _key_block_ranges(q_segment_ids, kv_segment_ids, q_index, block_q, block_k)
    q_blocks = q.reshape(batch, kv_heads, num_q, rows, head_dim).transpose(2, 0, 1, 3, 4)
    seg_blocks = q_segment_ids.reshape(batch, num_q, block_q).transpose(1, 0, 2)
    idx_blocks = q_index.reshape(batch, num_q, block_q).transpose(1, 0, 2)

    def query_block(_, xs):
        q_blk, q_seg, q_idx, lo_i, hi_i = xs

        def key_block(j, carry):
            m, l, acc = carry
            k_first = j * block_k
            k_blk = lax.dynamic_slice_in_dim(k, k_first, block_k, axis=2)
            v_blk = lax.dynamic_slice_in_dim(v, k_first, block_k, axis=2)
            kv_seg = lax.dynamic_slice_in_dim(kv_segment_ids, k_first, block_k, axis=1)
            s = _scores(q_blk, k_blk, scale)
            s = jnp.where(_block_mask(q_seg, q_idx, kv_seg, k_first, block_k, groups), s, _NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            correction = jnp.exp(m - m_safe)
            l = l * correction + p.sum(axis=-1)
            pv = jnp.einsum("bhrs,bhsd->bhrd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, l, acc * correction[..., None] + pv

        init = (
            jnp.full((batch, kv_heads, rows), _NEG_INF, jnp.float32),
            jnp.zeros((batch, kv_heads, rows), jnp.float32),
            jnp.zeros((batch, kv_heads, rows, head_dim), jnp.float32),
        )
        init = varying_like(init, (q_blk, k, v, kv_segment_ids, q_seg, q_idx))
        m, l, acc = lax.fori_loop(lo_i, hi_i, key_block, init)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        # +inf for a row that read nothing: exp(s - lse) is then 0 for every (masked) score.
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return None, (out.astype(v.dtype), lse)

    _, (out, lse) = lax.scan(query_block, None, (q_blocks, seg_blocks, idx_blocks, lo, hi))
    out = out.transpose(1, 2, 0, 3, 4).reshape(batch, kv_heads, q_total, groups, head_dim)
    lse = lse.transpose(1, 2, 0, 3).reshape(batch, kv_heads, q_total * groups)
    return out, lse


def _backward(q, k, v, q_segment_ids, kv_segment_ids, q_index, out, lse, d_out, block_q, block_k):
    """Cotangents of q, k, v (their dtypes) from d_out [B, KV, Tq, G, D]."""
    batch, kv_heads, q_total, groups, head_dim = q.shape
    num_q, num_k = q_total // block_q, k.shape[2] // block_k
    rows = block_q * groups
    scale = head_dim**-0.5
    _, _, needed = _key_block_ranges(q_segment_ids, kv_segment_ids, q_index, block_q, block_k)
    # For key block j, the query blocks [q_lo_j, q_hi_j) whose ranges contain it.
    blocks = jnp.arange(num_q, dtype=jnp.int32)
    any_needed = needed.any(axis=0)
    q_lo = jnp.where(any_needed, jnp.argmax(needed, axis=0), 0).astype(jnp.int32)
    q_hi = jnp.where(any_needed, jnp.max(jnp.where(needed, blocks[:, None] + 1, 0), axis=0), 0)
    q_hi = q_hi.astype(jnp.int32)

    q_rows = q.reshape(batch, kv_heads, q_total * groups, head_dim)
    do_rows = d_out.reshape(batch, kv_heads, q_total * groups, head_dim)
    # delta_r = sum_d dO_rd O_rd, the softmax-Jacobian term of each row.
    delta = jnp.einsum(
        "bhrd,bhrd->bhr",
        do_rows.astype(jnp.float32),
        out.reshape(do_rows.shape).astype(jnp.float32),
    )
    k_blocks = k.reshape(batch, kv_heads, num_k, block_k, head_dim).transpose(2, 0, 1, 3, 4)
    v_blocks = v.reshape(batch, kv_heads, num_k, block_k, head_dim).transpose(2, 0, 1, 3, 4)
    kv_seg_blocks = kv_segment_ids.reshape(batch, num_k, block_k).transpose(1, 0, 2)

    def key_block(d_q, xs):
        k_blk, v_blk, kv_seg, j, lo_j, hi_j = xs
        k_first = j * block_k

        def query_block(i, carry):
            d_q, d_k, d_v = carry
            r_first = i * rows
            q_blk = lax.dynamic_slice_in_dim(q_rows, r_first, rows, axis=2)
            do_blk = lax.dynamic_slice_in_dim(do_rows, r_first, rows, axis=2)
            lse_blk = lax.dynamic_slice_in_dim(lse, r_first, rows, axis=2)
            delta_blk = lax.dynamic_slice_in_dim(delta, r_first, rows, axis=2)
            q_seg = lax.dynamic_slice_in_dim(q_segment_ids, i * block_q, block_q, axis=1)
            q_idx = lax.dynamic_slice_in_dim(q_index, i * block_q, block_q, axis=1)
            s = _scores(q_blk, k_blk, scale)
            allowed = _block_mask(q_seg, q_idx, kv_seg, k_first, block_k, groups)
            p = jnp.where(allowed, jnp.exp(s - lse_blk[..., None]), 0.0)
            d_v = d_v + jnp.einsum(
                "bhrs,bhrd->bhsd", p.astype(do_blk.dtype), do_blk, preferred_element_type=jnp.float32
            )
            d_p = jnp.einsum("bhrd,bhsd->bhrs", do_blk, v_blk, preferred_element_type=jnp.float32)
            d_s = p * (d_p - delta_blk[..., None]) * scale
            d_k = d_k + jnp.einsum(
                "bhrs,bhrd->bhsd", d_s.astype(q_blk.dtype), q_blk, preferred_element_type=jnp.float32
            )
            d_q_blk = jnp.einsum(
                "bhrs,bhsd->bhrd", d_s.astype(k_blk.dtype), k_blk, preferred_element_type=jnp.float32
            )
            current = lax.dynamic_slice_in_dim(d_q, r_first, rows, axis=2)
            d_q = lax.dynamic_update_slice_in_dim(d_q, current + d_q_blk, r_first, axis=2)
            return d_q, d_k, d_v

        zeros = jnp.zeros((batch, kv_heads, block_k, head_dim), jnp.float32)
        zeros = varying_like(zeros, (q_rows, do_rows, lse, k_blk, v_blk, kv_seg, q_segment_ids, q_index))
        d_q, d_k, d_v = lax.fori_loop(lo_j, hi_j, query_block, (d_q, zeros, zeros))
        return d_q, (d_k, d_v)

    d_q0 = varying_like(jnp.zeros(q_rows.shape, jnp.float32), (q_rows, do_rows, k, v, lse))
    steps = jnp.arange(num_k, dtype=jnp.int32)
    d_q, (d_k, d_v) = lax.scan(key_block, d_q0, (k_blocks, v_blocks, kv_seg_blocks, steps, q_lo, q_hi))

    def unblock(x):  # [nk, B, KV, bk, D] -> [B, KV, S, D]
        return x.transpose(1, 2, 0, 3, 4).reshape(batch, kv_heads, num_k * block_k, head_dim)

    d_q = d_q.reshape(q.shape).astype(q.dtype)
    return d_q, unblock(d_k).astype(k.dtype), unblock(d_v).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, q_segment_ids, kv_segment_ids, q_index, block_q, block_k):
    out, _ = _forward(q, k, v, q_segment_ids, kv_segment_ids, q_index, block_q, block_k)
    return out


def _attention_fwd(q, k, v, q_segment_ids, kv_segment_ids, q_index, block_q, block_k):
    out, lse = _forward(q, k, v, q_segment_ids, kv_segment_ids, q_index, block_q, block_k)
    return out, (q, k, v, q_segment_ids, kv_segment_ids, q_index, out, lse)


def _attention_bwd(block_q, block_k, residuals, d_out):
    q, k, v, q_segment_ids, kv_segment_ids, q_index, out, lse = residuals
    d_q, d_k, d_v = _backward(
        q, k, v, q_segment_ids, kv_segment_ids, q_index, out, lse, d_out, block_q, block_k
    )
    return d_q, d_k, d_v, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
