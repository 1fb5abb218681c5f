"""The Pallas chunked gated delta rule (Pallas interpret mode on CPU): forward against the
float64 per-token loop, gradient (the hand-written reverse-scan kernel) against autodiff of the
pure-JAX reference, packed sequences and an initial state included; the kernel selection; and
that both kernels lower to Mosaic for TPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.ops import chunk_gated_delta_rule as reference
from t1jax.ops.pallas import chunk_gated_delta_rule, pallas_chunk_gated_delta_rule
from tests.ops.gdr_inputs import random_gdr_inputs, random_state, segments_from_lengths
from tests.ops.naive_reference import naive_gated_delta_rule

HEADS, DK, DV, CHUNK = 2, 8, 16, 8
T = 29  # not a multiple of the chunk: the wrapper pads
# row 0: documents starting inside a chunk (5, 7) and on a chunk edge (16), right padding;
# row 1: leading padding (drops the initial state), a document crossing chunks, padding inside.
SEGMENTS = segments_from_lengths([[(1, 5), (2, 2), (3, 9), (4, 10)], [(0, 3), (6, 12), (0, 2), (7, 9)]], T)


def _inputs(seed=0, segments=SEGMENTS):
    q, k, v, g, beta = random_gdr_inputs(seed, 2, T, HEADS, DK, DV)
    return q, k, v, g, beta, random_state(seed + 1, 2, HEADS, DK, DV), segments


@functools.cache
def _fn(kernel):
    def run(q, k, v, g, beta, state, segments):
        return chunk_gated_delta_rule(
            q, k, v, g, beta, kernel=kernel, chunk_size=CHUNK, initial_state=state, segment_ids=segments,
            interpret=kernel == "pallas",
        )  # fmt: skip

    return jax.jit(run)


def test_forward_matches_the_float64_recurrence():
    q, k, v, g, beta, state, segments = _inputs()
    out, final = _fn("pallas")(q, k, v, g, beta, state, segments)
    want_out, want_final = naive_gated_delta_rule(q, k, v, g, beta, initial_state=state, segment_ids=segments)
    assert out.dtype == final.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=2e-5)
    # padding outputs are exactly zero, as the contract says
    assert np.all(np.asarray(out)[np.asarray(segments) == 0] == 0)


def test_gradients_match_autodiff_of_the_reference():
    q, k, v, g, beta, state, segments = _inputs(seed=3)
    rng = np.random.default_rng(9)
    w_out = rng.standard_normal((2, T, HEADS, DV)).astype(np.float32)
    w_state = rng.standard_normal((2, HEADS, DK, DV)).astype(np.float32)

    def loss(kernel):
        def f(q, k, v, g, beta, state):
            out, final = _fn(kernel)(q, k, v, g, beta, state, segments)
            return jnp.sum(out * w_out) + jnp.sum(final * w_state)

        return jax.jit(jax.grad(f, argnums=range(6)))

    got = loss("pallas")(q, k, v, g, beta, state)
    want = loss("jax")(q, k, v, g, beta, state)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want, strict=True):
        scale = float(jnp.max(jnp.abs(b)))
        assert scale > 1e-3, name  # every input really receives gradient
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def test_bfloat16_inputs_are_computed_in_float32():
    q, k, v, g, beta, state, segments = _inputs(seed=5, segments=None)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out, _ = _fn("pallas")(*low, g, beta, state, None)
    want, _ = reference(*low, g, beta, chunk_size=CHUNK, initial_state=state)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-5)


def test_the_kernel_is_chosen_explicitly():
    q, k, v, g, beta, state, segments = _inputs()
    with pytest.raises(ValueError, match="compiles for TPU only .* interpret=True"):
        chunk_gated_delta_rule(q, k, v, g, beta, kernel="pallas")
    with pytest.raises(ValueError, match="kernel must be one of"):
        chunk_gated_delta_rule(q, k, v, g, beta, kernel="triton")
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, kernel="jax", chunk_size=CHUNK, segment_ids=segments)
    want, _ = reference(q, k, v, g, beta, chunk_size=CHUNK, segment_ids=segments)
    np.testing.assert_array_equal(out, want)


def test_forward_and_backward_kernels_lower_to_mosaic_for_tpu():
    """At the model's head sizes (dk = dv = 128, chunk 64): Pallas' TPU lowering accepts every op
    of both kernels (libtpu's own compile of the Mosaic module needs a TPU and is not run here)."""
    shapes = [(1, 128, 2, 128)] * 2 + [(1, 128, 2, 128)] + [(1, 128, 2)] * 2
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    state = jax.ShapeDtypeStruct((1, 2, 128, 128), jnp.float32)
    segments = jax.ShapeDtypeStruct((1, 128), jnp.int32)

    def loss(q, k, v, g, beta, state, segments):
        # the kernel function itself: the selection refuses a compiled Pallas kernel off TPU
        out, final = pallas_chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=64, initial_state=state, segment_ids=segments
        )
        return jnp.sum(out) + jnp.sum(final)

    lowered = jax.export.export(jax.jit(jax.grad(loss, argnums=range(6))), platforms=["tpu"])(
        *args, state, segments
    )
    assert lowered.mlir_module().count("tpu_custom_call") == 2  # the forward and the backward kernel
