"""Blockwise attention (and Pallas' splash kernel, interpreted) against a dense softmax attention
written out plainly here: values and gradients, GQA, packed documents, padding, blocks that do
not divide the sequence, queries in a permuted (zigzag) order, queries continuing a cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.ops.flash_attention import blockwise_attention, document_starts


def plain_attention(query, key, value, allowed):
    """softmax(q k^T / sqrt(D)) v over allowed keys; query head h reads kv head h // groups.
    query [B, T, H, D], key/value [B, S, KV, D], allowed bool [B, T, S]."""
    heads, kv_heads = query.shape[2], key.shape[2]
    key = jnp.repeat(key, heads // kv_heads, axis=2)
    value = jnp.repeat(value, heads // kv_heads, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", query, key) / np.sqrt(query.shape[-1])
    allowed = allowed[:, None]
    top = jnp.max(jnp.where(allowed, scores, -jnp.inf), axis=-1, keepdims=True)
    weights = jnp.where(allowed, jnp.exp(scores - jnp.where(allowed.any(-1, keepdims=True), top, 0.0)), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", weights / jnp.where(total > 0, total, 1.0), value)


def allowed_keys(q_segments, kv_segments, q_index):
    key_index = np.arange(kv_segments.shape[1])
    return (
        (key_index[None, None, :] <= q_index[:, :, None])
        & (q_segments[:, :, None] == kv_segments[:, None, :])
        & (kv_segments[:, None, :] != 0)
    )


def packed_segments():
    """Two rows of 200: three documents then padding; one document then padding."""
    segments = np.ones((2, 200), np.int32)
    segments[0, 50:120], segments[0, 120:190], segments[0, 190:] = 2, 3, 0
    segments[1, 150:] = 0
    return segments


def inputs(shape_q, shape_kv, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(np.float32)
    k, v = (rng.standard_normal(shape_kv).astype(np.float32) for _ in range(2))
    return q, k, v


def compare(ours, reference, q, k, v, real_queries):
    """Forward on real queries and the gradient of a random projection of the real outputs."""
    out, want = jax.jit(ours)(q, k, v), jax.jit(reference)(q, k, v)
    scale = float(np.max(np.abs(np.asarray(want)[real_queries])))
    assert np.max(np.abs(np.asarray(out) - np.asarray(want))[real_queries]) < 1e-5 * scale
    weight = np.random.default_rng(9).standard_normal(np.shape(want)).astype(np.float32)
    weight *= real_queries[..., None, None]

    def grads(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * weight), argnums=(0, 1, 2)))(q, k, v)

    for got, expected in zip(grads(ours), grads(reference), strict=True):
        got, expected = np.asarray(got), np.asarray(expected)
        assert np.max(np.abs(got - expected)) < 2e-5 * np.max(np.abs(expected))


@pytest.mark.parametrize("block_q, block_k", [(32, 48), (64, 64), (512, 512), (7, 200)])
def test_packed_causal_gqa_matches_plain_softmax(block_q, block_k):
    segments = packed_segments()
    q, k, v = inputs((2, 200, 4, 16), (2, 200, 2, 16))
    allowed = allowed_keys(segments, segments, np.broadcast_to(np.arange(200), (2, 200)))

    def ours(q, k, v):
        return blockwise_attention(
            q, k, v, q_segment_ids=segments, kv_segment_ids=segments, block_q=block_q, block_k=block_k
        )

    compare(ours, lambda q, k, v: plain_attention(q, k, v, allowed), q, k, v, segments != 0)


def test_queries_in_zigzag_order_read_by_original_position():
    """Queries permuted as a context shard holds them (chunks s and 2D-1-s), keys contiguous."""
    length, degree = 256, 4
    segments = np.ones((1, length), np.int32)
    segments[0, 100:] = 2
    chunk = length // (2 * degree)
    order = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in (1, 2 * degree - 2)])
    q_index = order[None].astype(np.int32)
    q, k, v = inputs((1, len(order), 4, 8), (1, length, 1, 8), seed=1)
    q_segments = segments[:, order]
    allowed = allowed_keys(q_segments, segments, q_index)

    def ours(q, k, v):
        return blockwise_attention(
            q,
            k,
            v,
            q_segment_ids=q_segments,
            kv_segment_ids=segments,
            q_index=q_index,
            block_q=16,
            block_k=32,
        )

    compare(ours, lambda q, k, v: plain_attention(q, k, v, allowed), q, k, v, q_segments != 0)


def test_queries_continuing_a_cache():
    """Prefill form: 24 new queries at positions 40..63 of a 100-slot cache (one sequence per row;
    later slots hold garbage that must not be read)."""
    q, k, v = inputs((2, 24, 4, 16), (2, 100, 2, 16), seed=2)
    q_index = (40 + np.arange(24))[None].repeat(2, 0).astype(np.int32)
    ones_q, ones_kv = np.ones((2, 24), np.int32), np.ones((2, 100), np.int32)
    allowed = allowed_keys(ones_q, ones_kv, q_index)

    def ours(q, k, v):
        return blockwise_attention(
            q, k, v, q_segment_ids=ones_q, kv_segment_ids=ones_kv, q_index=q_index, block_q=8, block_k=16
        )

    compare(ours, lambda q, k, v: plain_attention(q, k, v, allowed), q, k, v, np.ones((2, 24), bool))


def test_padding_queries_are_finite_and_bfloat16_rounds_like_the_reference():
    segments = packed_segments()
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in inputs((2, 200, 4, 16), (2, 200, 2, 16)))
    out = blockwise_attention(
        q, k, v, q_segment_ids=segments, kv_segment_ids=segments, block_q=64, block_k=64
    )
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert not np.asarray(out, np.float32)[segments == 0].any()  # padding reads nothing: zeros
    allowed = allowed_keys(segments, segments, np.broadcast_to(np.arange(200), (2, 200)))
    want = plain_attention(*(x.astype(jnp.float32) for x in (q, k, v)), allowed)
    real = segments != 0
    error = np.abs(np.asarray(out, np.float32) - np.asarray(want))[real]
    assert error.max() < 2e-2 * np.abs(np.asarray(want)[real]).max()


def test_document_starts():
    segments = np.array([[1, 1, 2, 2, 2, 0, 0, 3]], np.int32)
    np.testing.assert_array_equal(document_starts(jnp.asarray(segments)), [[0, 0, 2, 2, 2, 5, 5, 7]])


def test_bad_shapes_are_named():
    q, k, v = inputs((1, 8, 4, 16), (1, 8, 3, 16))
    with pytest.raises(ValueError, match="kv_heads"):
        blockwise_attention(q, k, v, q_segment_ids=np.ones((1, 8)), kv_segment_ids=np.ones((1, 8)))
    q, k, v = inputs((1, 8, 4, 16), (1, 9, 2, 16))
    with pytest.raises(ValueError, match="q_index is required"):
        blockwise_attention(q, k, v, q_segment_ids=np.ones((1, 8)), kv_segment_ids=np.ones((1, 9)))


def test_splash_kernel_in_interpret_mode_matches_plain_softmax():
    """Pallas' TPU splash kernel through the interpreter (CPU), forward and gradient."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    from t1jax.ops.splash_attention import splash_attention

    segments = np.ones((1, 200), np.int32)
    segments[0, 70:] = 2
    segments[0, 180:] = 0
    q, k, v = inputs((1, 200, 4, 16), (1, 200, 2, 16), seed=3)
    allowed = allowed_keys(segments, segments, np.arange(200)[None])

    def ours(q, k, v):
        return splash_attention(q, k, v, segments, block_q=128, block_k=128, interpret=True)

    compare(ours, lambda q, k, v: plain_attention(q, k, v, allowed), q, k, v, segments != 0)


def test_splash_kernel_refuses_to_run_off_tpu_uninterpreted():
    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU the kernel runs")
    from t1jax.ops.splash_attention import splash_attention

    q, k, v = inputs((1, 128, 2, 16), (1, 128, 1, 16))
    with pytest.raises(ValueError, match="needs a TPU"):
        splash_attention(q, k, v, np.ones((1, 128), np.int32), block_q=128, block_k=128)
