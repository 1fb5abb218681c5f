"""The sampler's forms: chunked prefill in pieces with per-row valid lengths, then token-by-token
decode, must reproduce the full forward's logits and routing at every position."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from t1jax.model import init_cache, take_rows

PIECE = 16  # the prefill bucket
MAX_LEN = 96


@functools.cache
def _compiled(graphdef):
    @jax.jit
    def extend(state, ids, cache, valid_lengths):
        return nnx.merge(graphdef, state).extend(ids, cache, valid_lengths=valid_lengths)

    @jax.jit
    def decode(state, tokens, cache, active):
        return nnx.merge(graphdef, state).decode_step(tokens, cache, active=active)

    return extend, decode


def test_prefill_in_pieces_then_decode_equals_full_forward(tiny_model, padded_batch, jit_forward):
    ids, segments, lengths = padded_batch
    lengths = np.asarray(lengths)
    full = jit_forward(tiny_model, ids, segments)
    full_logits, full_routing = np.asarray(full.logits), np.asarray(full.routing)
    scale = np.abs(full_logits).max()

    graphdef, state = nnx.split(tiny_model)
    extend, decode = _compiled(graphdef)
    cache = init_cache(tiny_model.config, len(lengths), MAX_LEN, jnp.float32)
    logits = np.full(full_logits.shape, np.nan, np.float32)
    routing = np.full(full_routing.shape, -1, np.int32)

    # Two prefill pieces of one bucket shape; rows run out of prompt at different points.
    prompt_lengths = np.minimum(lengths, [32, 28, 9])
    for start in (0, PIECE):
        valid = np.clip(prompt_lengths - start, 0, PIECE).astype(np.int32)
        piece = np.zeros((len(lengths), PIECE), np.int32)
        for row, count in enumerate(valid):
            piece[row, :count] = ids[row, start : start + count]
        out, cache = extend(state, jnp.asarray(piece), cache, jnp.asarray(valid))
        for row, count in enumerate(valid):
            logits[row, start : start + count] = np.asarray(out.logits)[row, :count]
            routing[row, start : start + count] = np.asarray(out.routing)[row, :count]
    np.testing.assert_array_equal(np.asarray(cache.lengths), prompt_lengths)

    finished_row = take_rows(cache, jnp.asarray([2]))
    position = prompt_lengths.copy()
    while (position < lengths).any():
        active = position < lengths
        tokens = np.where(active, ids[np.arange(len(lengths)), np.minimum(position, ids.shape[1] - 1)], 0)
        out, cache = decode(state, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(active))
        for row in np.flatnonzero(active):
            logits[row, position[row]] = np.asarray(out.logits)[row]
            routing[row, position[row]] = np.asarray(out.routing)[row]
        position = position + active
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)

    for row, length in enumerate(lengths):
        np.testing.assert_allclose(logits[row, :length], full_logits[row, :length], atol=2e-5 * scale, rtol=0)
        np.testing.assert_array_equal(routing[row, :length], full_routing[row, :length])
    # The row that finished during prefill was never touched by the decode steps.
    for kept, now in zip(
        jax.tree.leaves(finished_row), jax.tree.leaves(take_rows(cache, jnp.asarray([2]))), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(now))


def test_cache_overflow_and_mismatch_are_rejected(tiny_model):
    cache = init_cache(tiny_model.config, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match="would hold 9 tokens, more than its max_len 8"):
        tiny_model.extend(np.zeros((2, 9), np.int32), cache)
    with pytest.raises(ValueError, match="cache holds 2 rows but the input has 3"):
        tiny_model.extend(np.zeros((3, 4), np.int32), cache)
    with pytest.raises(ValueError, match=r"valid_lengths \[5, 1\] must lie in \[0, 4\]"):
        tiny_model.extend(np.zeros((2, 4), np.int32), cache, valid_lengths=np.asarray([5, 1]))
