"""Context-parallel gated delta rule, causal conv and zigzag relayout on the 8-device CPU mesh,
each compared with the single-device op on the gathered sequence: forward bit for bit, gradients to
1e-6 relative."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from t1jax.ops import causal_conv1d, chunk_gated_delta_rule
from t1jax.ops.context_parallel import (
    PackedSequenceDescriptor,
    context_parallel_causal_conv1d,
    context_parallel_gated_delta_rule,
    relayout,
)
from tests.ops.gdr_inputs import random_gdr_inputs, random_state, segments_from_lengths

BATCH, LENGTH, HEADS, DK, DV, CHUNK = 2, 64, 2, 8, 6, 4
DEGREES = [2, 4, 8]
# Row 0: a start inside shard 0, starts exactly on the shard edges of D = 4 (16) and of every D (32),
# trailing padding that fills the last shard of D = 8. Row 1: a document crossing shard edges,
# padding in the middle (40..47), then a new document.
PACKED = segments_from_lengths(
    [[(1, 5), (2, 11), (3, 16), (4, 24)], [(5, 24), (6, 16), (0, 8), (7, 16)]], LENGTH
)


def _mesh(degree, axis_type=AxisType.Explicit):
    return jax.make_mesh((degree,), ("context",), axis_types=(axis_type,), devices=jax.devices()[:degree])


@functools.cache
def _single_gdr(chunk_size):
    return jax.jit(functools.partial(chunk_gated_delta_rule, chunk_size=chunk_size))


def _cp_gdr(mesh, chunk_size, **kw):
    return jax.jit(
        functools.partial(context_parallel_gated_delta_rule, mesh=mesh, chunk_size=chunk_size, **kw)
    )


def _gdr_case(seed, batch=BATCH, length=LENGTH, heads=HEADS, dk=DK, dv=DV):
    inputs = random_gdr_inputs(seed, batch, length, heads, dk, dv)
    return inputs, random_state(seed + 1, batch, heads, dk, dv)


@pytest.mark.parametrize("degree", DEGREES)
def test_gdr_forward_is_bit_exact(degree):
    inputs, state = _gdr_case(0)
    expected = _single_gdr(CHUNK)(*inputs, initial_state=state, segment_ids=PACKED)
    got = _cp_gdr(_mesh(degree), CHUNK)(*inputs, initial_state=state, segment_ids=PACKED)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_gdr_without_segments_or_state_is_bit_exact():
    inputs, _ = _gdr_case(2)
    expected = _single_gdr(CHUNK)(*inputs)
    got = _cp_gdr(_mesh(4), CHUNK)(*inputs)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def _weighted_loss(fn, weights_out, weights_final):
    def loss(q, k, v, g, beta, state):
        out, final = fn(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
        return jnp.sum(out * weights_out) + jnp.sum(final * weights_final)

    return loss


@pytest.mark.parametrize("degree", [2, 8])  # D = 4 gradients: the wavefront test below
def test_gdr_gradients_match_single_device(degree):
    inputs, state = _gdr_case(4)
    rng = np.random.default_rng(5)
    weights_out = rng.standard_normal((BATCH, LENGTH, HEADS, DV)).astype(np.float32)
    weights_final = rng.standard_normal((BATCH, HEADS, DK, DV)).astype(np.float32)
    single = functools.partial(chunk_gated_delta_rule, chunk_size=CHUNK)
    cp = functools.partial(context_parallel_gated_delta_rule, mesh=_mesh(degree), chunk_size=CHUNK)
    grads = [
        jax.jit(jax.grad(_weighted_loss(fn, weights_out, weights_final), argnums=range(6)))(*inputs, state)
        for fn in (single, cp)
    ]
    for name, expected, got in zip("q k v g beta state".split(), *grads, strict=True):
        expected, got = np.asarray(expected), np.asarray(got)
        relative = np.abs(got - expected).max() / np.abs(expected).max()
        assert relative <= 1e-6, (name, relative)


@pytest.mark.parametrize("heads,degree,groups", [(8, 8, None), (8, 4, 2), (2, 4, 1)])
def test_gdr_wavefront_head_groups_are_bit_exact_with_matching_gradients(heads, degree, groups):
    """Head groups flowing through the shards as a wavefront (G = 1 is the plain relay)."""
    (q, k, v, g, beta), state = _gdr_case(19, heads=heads)
    rng = np.random.default_rng(20)
    weights_out = rng.standard_normal((BATCH, LENGTH, heads, DV)).astype(np.float32)
    weights_final = rng.standard_normal((BATCH, heads, DK, DV)).astype(np.float32)
    single = functools.partial(chunk_gated_delta_rule, chunk_size=CHUNK)
    cp = functools.partial(
        context_parallel_gated_delta_rule, mesh=_mesh(degree), chunk_size=CHUNK, pipeline_groups=groups
    )
    expected = jax.jit(single)(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
    got = jax.jit(cp)(q, k, v, g, beta, initial_state=state, segment_ids=PACKED)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    grads = [
        jax.jit(jax.grad(_weighted_loss(fn, weights_out, weights_final), argnums=range(6)))(
            q, k, v, g, beta, state
        )
        for fn in (single, cp)
    ]
    for name, e, c in zip("q k v g beta state".split(), *grads, strict=True):
        e, c = np.asarray(e), np.asarray(c)
        assert np.abs(c - e).max() <= 1e-6 * np.abs(e).max(), name


def test_gdr_composes_with_data_and_tensor_axes():
    """Batch over ``data``, heads over ``tensor``, sequence over ``context`` (2 x 2 x 2 devices)."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "context", "tensor"), axis_types=(AxisType.Explicit,) * 3)
    inputs, state = _gdr_case(6)
    expected = _single_gdr(CHUNK)(*inputs, initial_state=state, segment_ids=PACKED)
    got = _cp_gdr(mesh, CHUNK, batch_axis="data", head_axis="tensor")(
        *inputs, initial_state=state, segment_ids=PACKED
    )
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_gdr_on_auto_axes_mesh_is_bit_exact():
    inputs, state = _gdr_case(8)
    expected = _single_gdr(CHUNK)(*inputs, initial_state=state, segment_ids=PACKED)
    got = _cp_gdr(_mesh(4, AxisType.Auto), CHUNK)(*inputs, initial_state=state, segment_ids=PACKED)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_gdr_rejects_shards_not_aligned_to_chunks():
    inputs, _ = _gdr_case(9)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        context_parallel_gated_delta_rule(*inputs, mesh=_mesh(8), chunk_size=16)
    with pytest.raises(ValueError, match="pipeline_groups must divide the 2 heads"):
        context_parallel_gated_delta_rule(*inputs, mesh=_mesh(2), chunk_size=4, pipeline_groups=3)
    with pytest.raises(ValueError, match="no axis 'context'"):
        context_parallel_gated_delta_rule(*inputs, mesh=jax.make_mesh((2,), ("data",)), chunk_size=4)


def _random_packing(rng, rows, length):
    ids = np.zeros((rows, length), np.int32)
    for row in range(rows):
        position, next_id = 0, 1
        while position < length:
            run = int(rng.integers(1, 20))
            is_padding = rng.random() < 0.25
            ids[row, position : position + run] = 0 if is_padding else next_id
            next_id += 0 if is_padding else 1
            position += run
    return ids


def test_random_packings_are_bit_exact():
    """Random document / padding layouts (boundaries anywhere, including shard edges) through one
    compiled CP gated delta rule and conv at D = 4."""
    rng = np.random.default_rng(17)
    inputs, state = _gdr_case(18)
    x = rng.standard_normal((BATCH, LENGTH, CHANNELS)).astype(np.float32)
    weight = rng.standard_normal((CHANNELS, KERNEL)).astype(np.float32)
    conv_state = rng.standard_normal((BATCH, KERNEL - 1, CHANNELS)).astype(np.float32)
    mesh = _mesh(4)
    cp_gdr = _cp_gdr(mesh, CHUNK)
    cp_conv = jax.jit(functools.partial(context_parallel_causal_conv1d, mesh=mesh))
    single_conv = jax.jit(causal_conv1d)
    for _ in range(5):
        ids = _random_packing(rng, BATCH, LENGTH)
        expected = _single_gdr(CHUNK)(*inputs, initial_state=state, segment_ids=ids)
        got = cp_gdr(*inputs, initial_state=state, segment_ids=ids)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
        expected = single_conv(x, weight, initial_state=conv_state, segment_ids=ids)
        got = cp_conv(x, weight, initial_state=conv_state, segment_ids=ids)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


# --------------------------------------------------------------------------------------------------
# causal conv with halo
# --------------------------------------------------------------------------------------------------

CONV_LENGTH, CHANNELS, KERNEL = 32, 5, 4
# Row 0: a document continuing across every shard edge, then trailing padding covering whole shards
# (the final state must come from an earlier shard). Row 1: a start 1 token before a D = 8 edge,
# padding in the middle, a 2-token last document.
CONV_PACKED = segments_from_lengths([[(1, 3), (2, 17)], [(3, 11), (4, 9), (0, 6), (5, 2)]], CONV_LENGTH)


def _conv_case(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, CONV_LENGTH, CHANNELS)).astype(np.float32)
    weight = rng.standard_normal((CHANNELS, KERNEL)).astype(np.float32)
    state = rng.standard_normal((BATCH, KERNEL - 1, CHANNELS)).astype(np.float32)
    return x, weight, state


@pytest.mark.parametrize("degree", DEGREES)
@pytest.mark.parametrize("segmented", [False, True])
def test_conv_forward_is_bit_exact(degree, segmented):
    x, weight, state = _conv_case(10)
    ids = CONV_PACKED if segmented else None
    expected = jax.jit(causal_conv1d)(x, weight, initial_state=state, segment_ids=ids)
    cp = jax.jit(functools.partial(context_parallel_causal_conv1d, mesh=_mesh(degree)))
    got = cp(x, weight, initial_state=state, segment_ids=ids)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_conv_gradients_match_single_device():
    x, weight, state = _conv_case(11)

    def loss(fn):
        def value(x, weight, state):
            y, final = fn(x, weight, initial_state=state, segment_ids=CONV_PACKED)
            return jnp.sum(jnp.sin(y)) + jnp.sum(final**2)

        return jax.jit(jax.grad(value, argnums=(0, 1, 2)))

    expected = loss(causal_conv1d)(x, weight, state)
    got = loss(functools.partial(context_parallel_causal_conv1d, mesh=_mesh(8)))(x, weight, state)
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6 * np.abs(np.asarray(e)).max())


def test_conv_rejects_shards_shorter_than_the_halo():
    x, weight, _ = _conv_case(12)
    with pytest.raises(ValueError, match="at least K-1"):
        context_parallel_causal_conv1d(x[:, :16], weight, mesh=_mesh(8))


# --------------------------------------------------------------------------------------------------
# interleaved <-> contiguous relayout and the packed-sequence descriptor
# --------------------------------------------------------------------------------------------------


def _relayout_fn(mesh):
    return jax.jit(functools.partial(relayout, mesh=mesh))


def _zigzag_numpy(row, sample_lengths, degree):
    """Reference interleaving of one row: each sample cut into 2D pieces, shard i takes pieces i and
    2D-1-i of every sample in order, shards concatenated."""
    shards = [[] for _ in range(degree)]
    start = 0
    for length in sample_lengths:
        pieces = np.split(row[start : start + length], 2 * degree)
        for i in range(degree):
            shards[i] += [pieces[i], pieces[2 * degree - 1 - i]]
        start += length
    return np.concatenate([np.concatenate(s) for s in shards])


def _descriptor(degree):
    """Row 0: a 5-token document padded to 2D, a 2D-long document, filler; row 1: one document
    filling the row exactly, no padding."""
    return PackedSequenceDescriptor.from_documents(
        [[5, 2 * degree], [8 * degree]], row_length=8 * degree, context_degree=degree
    )


@pytest.mark.parametrize("degree", DEGREES)
def test_relayout_round_trip_matches_numpy_zigzag(degree):
    descriptor = _descriptor(degree)
    length = descriptor.row_length
    contiguous = np.random.default_rng(13).standard_normal((2, length, 3)).astype(np.float32)
    interleaved = np.stack(
        [_zigzag_numpy(contiguous[r], descriptor.sample_lengths()[r], degree) for r in range(2)]
    )
    move = _relayout_fn(_mesh(degree))
    to_contiguous = move(interleaved, descriptor.interleaved_position())
    np.testing.assert_array_equal(to_contiguous, contiguous)
    back = move(to_contiguous, descriptor.contiguous_position())
    np.testing.assert_array_equal(back, interleaved)
    # The gradient of a relayout is the inverse relayout of the cotangent.
    cotangent = np.random.default_rng(14).standard_normal(contiguous.shape).astype(np.float32)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(move(x, descriptor.interleaved_position()) * cotangent)))(
        interleaved
    )
    np.testing.assert_array_equal(grad, _permute_rows(cotangent, descriptor.contiguous_position()))


def test_descriptor_counts_segments_per_sample_when_real_and_padding_have_equal_length():
    """Real 8 + padding 8 as one sample of 16, or as two samples of 8: same offsets, different
    layouts. Interleaved data produced with the first grouping is only recovered with it."""
    degree = 2
    lengths = ((8, 8, 16),)
    padding = ((False, True, False),)
    grouped = PackedSequenceDescriptor(lengths, padding, ((2, 1),), degree)
    split = PackedSequenceDescriptor(lengths, padding, ((1, 1, 1),), degree)
    np.testing.assert_array_equal(grouped.segment_ids(), split.segment_ids())
    assert not np.array_equal(grouped.contiguous_position(), split.contiguous_position())

    contiguous = np.arange(32, dtype=np.float32)[None, :, None]
    interleaved = _zigzag_numpy(contiguous[0], [16, 16], degree)[None]
    mesh = _mesh(degree)
    move = _relayout_fn(mesh)
    np.testing.assert_array_equal(move(interleaved, grouped.interleaved_position()), contiguous)
    wrong = move(interleaved, split.interleaved_position())
    assert not np.array_equal(wrong, contiguous)


@pytest.mark.parametrize("degree", DEGREES)
def test_interleaved_pipeline_equals_single_device(degree):
    """Zigzag inputs -> contiguous -> CP conv and CP gated delta rule -> zigzag, against the
    single-device ops on the contiguous sequence, bit for bit."""
    descriptor = PackedSequenceDescriptor(
        ((8 * degree, 8 * degree, 16 * degree),), ((False, True, False),), ((2, 1),), degree
    )
    length = descriptor.row_length
    ids = descriptor.segment_ids()
    (q, k, _, g, beta), state = _gdr_case(14, batch=1, length=length)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((1, length, HEADS * DV)).astype(np.float32)
    weight = rng.standard_normal((HEADS * DV, KERNEL)).astype(np.float32)

    def single(x, q, k, g, beta):
        v, _ = causal_conv1d(x, weight, segment_ids=ids)
        return chunk_gated_delta_rule(
            q,
            k,
            v.reshape(1, length, HEADS, DV),
            g,
            beta,
            chunk_size=CHUNK,
            initial_state=state,
            segment_ids=ids,
        )[0]

    mesh = _mesh(degree)
    to_contiguous, to_interleaved = descriptor.interleaved_position(), descriptor.contiguous_position()
    interleaved_ids = _permute_rows(ids, to_interleaved)  # the ids as the trainer holds them

    def context_parallel(x, q, k, g, beta):
        x, q, k, g, beta, seg = (
            relayout(a, to_contiguous, mesh=mesh) for a in (x, q, k, g, beta, interleaved_ids)
        )
        v, _ = context_parallel_causal_conv1d(x, weight, mesh=mesh, segment_ids=seg)
        out, _ = context_parallel_gated_delta_rule(
            q,
            k,
            v.reshape(1, length, HEADS, DV),
            g,
            beta,
            mesh=mesh,
            chunk_size=CHUNK,
            initial_state=state,
            segment_ids=seg,
        )
        return relayout(out, to_interleaved, mesh=mesh)

    expected = jax.jit(single)(x, q, k, g, beta)
    got = jax.jit(context_parallel)(*(_permute_rows(a, to_interleaved) for a in (x, q, k, g, beta)))
    np.testing.assert_array_equal(got, _permute_rows(np.asarray(expected), to_interleaved))


def _permute_rows(a, index):
    """a[b, index[b, t]] for every row b (any trailing dims)."""
    return np.asarray(a)[np.arange(a.shape[0])[:, None], index]


def test_descriptor_rejects_bad_grouping():
    with pytest.raises(ValueError, match="not a multiple of 2 \\* context_degree"):
        PackedSequenceDescriptor(((6, 10),), ((False, True),), ((1, 1),), 2)
    with pytest.raises(ValueError, match="covers 1 segments, the row has 2"):
        PackedSequenceDescriptor(((8, 8),), ((False, True),), ((1,),), 2)
    with pytest.raises(ValueError, match="same total length"):
        PackedSequenceDescriptor(((8,), (16,)), ((False,), (False,)), ((1,), (1,)), 2)


# --------------------------------------------------------------------------------------------------
# longer sequences
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("degree", DEGREES)
def test_long_sequence_bit_exact_with_gradients(degree):
    length, chunk, heads, dk, dv = 1024, 64, 2, 32, 32
    inputs, state = _gdr_case(16, batch=1, length=length, heads=heads, dk=dk, dv=dv)
    ids = segments_from_lengths([[(1, 300), (2, 212), (3, 400)]], length)
    single = functools.partial(chunk_gated_delta_rule, chunk_size=chunk, segment_ids=ids)
    cp = functools.partial(
        context_parallel_gated_delta_rule, mesh=_mesh(degree), chunk_size=chunk, segment_ids=ids
    )
    expected = jax.jit(single)(*inputs, initial_state=state)
    got = jax.jit(cp)(*inputs, initial_state=state)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])

    def loss(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a[:5], initial_state=a[5])[0] ** 2), argnums=range(6)))

    for e, g in zip(loss(single)(*inputs, state), loss(cp)(*inputs, state), strict=True):
        e, g = np.asarray(e), np.asarray(g)
        assert np.abs(g - e).max() <= 1e-6 * np.abs(e).max()
