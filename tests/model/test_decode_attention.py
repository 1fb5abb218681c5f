"""The decode attention: one query per row over its cache, read chunk by chunk only up to the
longest live row. Against the dense masked softmax (`attend`), and bit-exact whatever the other
rows make it read."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.model.attention import attend, decode_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _inputs(batch, max_len, seed=0):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(batch, HEADS, HEAD_DIM)).astype(np.float32)
    key = rng.normal(size=(batch, max_len, KV_HEADS, HEAD_DIM)).astype(np.float32) * 2
    value = rng.normal(size=(batch, max_len, KV_HEADS, HEAD_DIM)).astype(np.float32)
    return query, key, value


@functools.cache
def _decode(chunk):
    return jax.jit(functools.partial(decode_attention, chunk=chunk))


@pytest.mark.parametrize("max_len,chunk", [(100, 32), (96, 32), (20, 64), (130, 128)])
def test_matches_the_dense_masked_softmax(max_len, chunk):
    batch = 5
    query, key, value = _inputs(batch, max_len)
    positions = np.asarray([0, 31, 32, max_len // 2, max_len - 1], np.int32)
    live = np.ones(batch, bool)
    got = np.asarray(_decode(chunk)(query, key, value, positions, live))
    mask = np.arange(max_len)[None, None, :] <= positions[:, None, None]  # [B, 1, S]
    want = np.asarray(attend(query[:, None], key, value, jnp.asarray(mask)))[:, 0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_a_row_is_bit_identical_whatever_the_other_rows_make_it_read():
    """Row 0 at position 10, alone and next to live rows whose positions make the loop read 1,
    2, 3 or all 4 chunks (a dead row sits at the end of the cache)."""
    max_len, chunk = 128, 32
    query, key, value = _inputs(3, max_len, seed=1)
    decode = _decode(chunk)
    alone = np.asarray(decode(query[:1], key[:1], value[:1], np.asarray([10], np.int32), np.ones(1, bool)))
    for other in (5, 40, 70, 127):
        positions = np.asarray([10, other, 127], np.int32)
        live = np.asarray([True, True, False])
        together = np.asarray(decode(query, key, value, positions, live))
        np.testing.assert_array_equal(together[:1], alone)
