"""The gated delta rule's chunked, recurrent and one-step forms against a float64 per-token loop,
against each other, and on packed sequences (document resets, padding, continuation)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.ops import chunk_gated_delta_rule, gated_delta_rule_step, recurrent_gated_delta_rule
from t1jax.ops.gated_delta_rule import unit_lower_triangular_inverse
from tests.ops.gdr_inputs import random_gdr_inputs, random_state, segments_from_lengths
from tests.ops.naive_reference import naive_gated_delta_rule

HEADS, DK, DV = 2, 8, 6
TOL = dict(rtol=1e-5, atol=2e-5)


@functools.cache
def _chunk_fn(chunk_size):
    return jax.jit(functools.partial(chunk_gated_delta_rule, chunk_size=chunk_size))


_recurrent_fn = jax.jit(recurrent_gated_delta_rule)


def _inputs(seed, batch, length, **kw):
    return random_gdr_inputs(seed, batch, length, HEADS, DK, DV, **kw)


# Packed rows for T = 40 with chunk 8: row 0 has three documents inside one chunk (starts at 9, 11,
# 13), a start on a chunk edge (16) and right padding; row 1 has a start on a chunk edge (8), a
# document longer than a chunk, and a padding run in the middle followed by a new document.
PACKED_T = 40
PACKED = segments_from_lengths(
    [[(1, 9), (2, 2), (3, 2), (4, 3), (5, 17)], [(7, 8), (8, 19), (0, 3), (9, 6)]], PACKED_T
)


@pytest.mark.parametrize(
    "length,chunk_size,with_state",
    [(37, 8, False), (37, 8, True), (64, 16, True), (50, 64, True), (13, 4, False)],
)
def test_chunked_matches_naive_float64(length, chunk_size, with_state):
    q, k, v, g, beta = _inputs(0, 2, length)
    state = random_state(1, 2, HEADS, DK, DV) if with_state else None
    out, final = _chunk_fn(chunk_size)(q, k, v, g, beta, initial_state=state)
    ref_out, ref_final = naive_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    assert out.dtype == jnp.float32 and final.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(final, ref_final, **TOL)


def test_strong_decay_stays_finite_and_exact():
    """log-decays of -30 per token underflow exp() within a chunk; masking before exp keeps it finite."""
    q, k, v, g, beta = _inputs(2, 1, 24, decay_scale=30.0)
    out, final = _chunk_fn(8)(q, k, v, g, beta)
    ref_out, ref_final = naive_gated_delta_rule(q, k, v, g, beta)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(final, ref_final, **TOL)


@pytest.mark.parametrize("chunk_size", [4, 8, 64])
def test_packed_segments_match_naive(chunk_size):
    q, k, v, g, beta = _inputs(3, 2, PACKED_T)
    state = random_state(4, 2, HEADS, DK, DV)
    out, final = _chunk_fn(chunk_size)(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
    ref_out, ref_final = naive_gated_delta_rule(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(final, ref_final, **TOL)
    assert not np.asarray(out)[PACKED == 0].any(), "padding positions must output exact zeros"


def test_packed_row_equals_each_document_alone():
    """Every document of the packed rows, run alone (right-padded to the same length so that one
    compiled function serves all), gives the same outputs; the packed final state is the last
    document's."""
    q, k, v, g, beta = _inputs(5, 2, PACKED_T)
    state = random_state(6, 2, HEADS, DK, DV)
    out, final = _chunk_fn(8)(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
    alone_rows, alone_states, spans = [], [], []
    for row in range(2):
        ids = PACKED[row]
        starts = [0] + [t for t in range(1, PACKED_T) if ids[t] != ids[t - 1]]
        for start, end in zip(starts, starts[1:] + [PACKED_T], strict=True):
            if ids[start] == 0:
                continue
            shifted = [np.zeros_like(x[row]) for x in (q, k, v, g, beta)]
            for piece, x in zip(shifted, (q, k, v, g, beta), strict=True):
                piece[: end - start] = x[row, start:end]
            alone_rows.append(shifted)
            alone_states.append(state[row] if start == 0 else np.zeros_like(state[row]))
            spans.append((row, start, end))
    alone_ids = np.zeros((len(spans), PACKED_T), np.int32)
    for i, (_, start, end) in enumerate(spans):
        alone_ids[i, : end - start] = 1
    batched = [np.stack(parts) for parts in zip(*alone_rows, strict=True)]
    alone_out, alone_final = _chunk_fn(8)(
        *batched, initial_state=np.stack(alone_states), segment_ids=alone_ids
    )
    for i, (row, start, end) in enumerate(spans):
        np.testing.assert_allclose(out[row, start:end], alone_out[i, : end - start], **TOL)
    for row in range(2):
        last = max(i for i, span in enumerate(spans) if span[0] == row)
        np.testing.assert_allclose(final[row], alone_final[last], **TOL)


def test_garbage_in_padding_never_leaks():
    q, k, v, g, beta = _inputs(7, 2, PACKED_T)
    out, final = _chunk_fn(8)(q, k, v, g, beta, segment_ids=PACKED)
    pad = PACKED == 0
    poisoned = []
    for x in (q, k, v, g, beta):
        x = x.copy()
        x[pad] = np.nan
        poisoned.append(x)
    out_p, final_p = _chunk_fn(8)(*poisoned, segment_ids=PACKED)
    np.testing.assert_array_equal(out_p, out)
    np.testing.assert_array_equal(final_p, final)


def test_recurrent_matches_chunked_and_naive():
    q, k, v, g, beta = _inputs(8, 2, PACKED_T)
    state = random_state(9, 2, HEADS, DK, DV)
    rec_out, rec_final = _recurrent_fn(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
    chunk_out, chunk_final = _chunk_fn(16)(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
    ref_out, ref_final = naive_gated_delta_rule(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
    np.testing.assert_allclose(rec_out, ref_out, **TOL)
    np.testing.assert_allclose(rec_final, ref_final, **TOL)
    np.testing.assert_allclose(rec_out, chunk_out, **TOL)
    np.testing.assert_allclose(rec_final, chunk_final, **TOL)


def test_step_by_step_equals_recurrent():
    q, k, v, g, beta = _inputs(10, 2, 12)
    state = jnp.asarray(random_state(11, 2, HEADS, DK, DV))
    rec_out, rec_final = _recurrent_fn(q, k, v, g, beta, initial_state=state)
    step = jax.jit(gated_delta_rule_step)
    outs = []
    for t in range(12):
        out_t, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out_t)
    np.testing.assert_allclose(np.stack(outs, axis=1), rec_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state, rec_final, rtol=1e-6, atol=1e-6)


def test_final_state_with_right_padding_is_state_after_last_real_token():
    q, k, v, g, beta = _inputs(12, 2, 30)
    ids = segments_from_lengths([[(1, 19)], [(1, 30)]], 30)
    _, final = _chunk_fn(8)(q, k, v, g, beta, segment_ids=ids)
    _, unpadded_final = _chunk_fn(8)(*(x[:, :19] for x in (q, k, v, g, beta)))
    _, full_final = _chunk_fn(8)(q, k, v, g, beta)
    np.testing.assert_allclose(final[0], unpadded_final[0], **TOL)
    np.testing.assert_allclose(final[1], full_final[1], **TOL)


def test_prefill_then_continue_equals_one_pass():
    """Chunked prefill of x[:a], then chunked or recurrent continuation from its final state."""
    q, k, v, g, beta = _inputs(13, 2, 40)
    state = random_state(14, 2, HEADS, DK, DV)
    full_out, full_final = _chunk_fn(8)(q, k, v, g, beta, initial_state=state)
    split = 21  # not a multiple of the chunk: the continuation starts mid-chunk
    head = [x[:, :split] for x in (q, k, v, g, beta)]
    tail = [x[:, split:] for x in (q, k, v, g, beta)]
    head_out, head_final = _chunk_fn(8)(*head, initial_state=state)
    for continue_fn in (_chunk_fn(8), _recurrent_fn):
        tail_out, tail_final = continue_fn(*tail, initial_state=head_final)
        np.testing.assert_allclose(np.concatenate([head_out, tail_out], axis=1), full_out, **TOL)
        np.testing.assert_allclose(tail_final, full_final, **TOL)


def test_bfloat16_inputs_compute_in_float32():
    q, k, v, g, beta = _inputs(15, 1, 20)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g, beta)]
    out, final = _chunk_fn(8)(*bf16)
    ref_out, ref_final = naive_gated_delta_rule(*[np.asarray(x.astype(jnp.float32)) for x in bf16])
    assert out.dtype == jnp.float32 and final.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, **TOL)


def _loss(fn, q, k, v, g, beta, state, segment_ids, weights_out, weights_final):
    out, final = fn(q, k, v, g, beta, initial_state=state, segment_ids=segment_ids)
    return jnp.sum(out * weights_out) + jnp.sum(final * weights_final)


def test_gradients_finite_and_equal_between_chunked_and_recurrent():
    q, k, v, g, beta = _inputs(16, 2, PACKED_T)
    state = random_state(17, 2, HEADS, DK, DV)
    ids = PACKED
    rng = np.random.default_rng(18)
    weights_out = rng.standard_normal((2, PACKED_T, HEADS, DV)).astype(np.float32)
    weights_final = rng.standard_normal((2, HEADS, DK, DV)).astype(np.float32)
    args = (q, k, v, g, beta, state)

    def grads(fn):
        loss = functools.partial(_loss, fn)
        return jax.jit(jax.grad(loss, argnums=range(6)))(
            *args, segment_ids=ids, weights_out=weights_out, weights_final=weights_final
        )

    chunk_grads = grads(functools.partial(chunk_gated_delta_rule, chunk_size=8))
    rec_grads = grads(recurrent_gated_delta_rule)
    for name, gc, gr in zip("q k v g beta state".split(), chunk_grads, rec_grads, strict=True):
        assert np.isfinite(np.asarray(gc)).all(), name
        scale = np.abs(np.asarray(gr)).max()
        np.testing.assert_allclose(gc, gr, rtol=1e-4, atol=1e-4 * scale, err_msg=name)
    for x in chunk_grads[:5]:
        assert not np.asarray(x)[PACKED == 0].any(), "padding inputs get no gradient"


@pytest.mark.parametrize(
    "fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=["chunked", "recurrent"]
)
def test_bad_shapes_are_named(fn):
    q, k, v, g, beta = _inputs(19, 1, 8)
    with pytest.raises(ValueError, match="k must have q's shape"):
        fn(q, k[..., :4], v, g, beta)
    with pytest.raises(ValueError, match="g must be"):
        fn(q, k, v, g[:, :4], beta)
    with pytest.raises(ValueError, match="initial_state must be"):
        fn(q, k, v, g, beta, initial_state=np.zeros((1, HEADS, DV, DK), np.float32))
    with pytest.raises(ValueError, match="segment_ids must be"):
        fn(q, k, v, g, beta, segment_ids=np.ones((1, 9), np.int32))


@pytest.mark.parametrize("size", [1, 5, 8, 64])
def test_unit_lower_triangular_inverse_matches_float64_inverse(size):
    rng = np.random.default_rng(20)
    matrix = (0.3 * rng.standard_normal((3, size, size))).astype(np.float32)
    expected = np.linalg.inv(np.eye(size) + np.tril(matrix.astype(np.float64), -1))
    got = jax.jit(unit_lower_triangular_inverse)(matrix)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

    cotangent = rng.standard_normal((3, size, size)).astype(np.float32)
    grad = jax.jit(jax.grad(lambda m: jnp.sum(unit_lower_triangular_inverse(m) * cotangent)))(matrix)
    # d<G, M^-1> / dM = -M^-T G M^-T, on the strictly lower entries only (the rest is ignored).
    expected_grad = np.tril(-np.swapaxes(expected, -1, -2) @ cotangent @ np.swapaxes(expected, -1, -2), -1)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-5 * np.abs(expected_grad).max())


def test_random_packings_match_naive():
    """Many random document / padding layouts through one compiled function."""
    rng = np.random.default_rng(21)
    length = 48
    q, k, v, g, beta = _inputs(22, 2, length)
    state = random_state(23, 2, HEADS, DK, DV)
    for _ in range(6):
        ids = np.zeros((2, length), np.int32)
        for row in range(2):
            position, next_id = 0, 1
            while position < length:
                run = int(rng.integers(1, 12))
                is_padding = rng.random() < 0.25
                ids[row, position : position + run] = 0 if is_padding else next_id
                next_id += 0 if is_padding else 1
                position += run
        out, final = _chunk_fn(8)(q, k, v, g, beta, initial_state=state, segment_ids=ids)
        ref_out, ref_final = naive_gated_delta_rule(q, k, v, g, beta, initial_state=state, segment_ids=ids)
        np.testing.assert_allclose(out, ref_out, **TOL)
        np.testing.assert_allclose(final, ref_final, **TOL)
