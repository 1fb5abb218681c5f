"""The depthwise causal conv against a float64 numpy loop, its one-step form, document resets,
padding and continuation from a final state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.ops import causal_conv1d, causal_conv1d_step
from tests.ops.gdr_inputs import segments_from_lengths
from tests.ops.naive_reference import naive_causal_conv1d

CHANNELS, KERNEL = 5, 4
TOL = dict(rtol=1e-6, atol=1e-6)
_conv = jax.jit(causal_conv1d)

# Row 0: documents of 1, 2, 5 tokens, then padding; row 1: padding in the middle, then a new document.
PACKED = segments_from_lengths([[(1, 1), (2, 2), (3, 5)], [(4, 6), (0, 2), (5, 4)]], 12)


def _data(seed, batch, length):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, length, CHANNELS)).astype(np.float32)
    weight = rng.standard_normal((CHANNELS, KERNEL)).astype(np.float32)
    state = rng.standard_normal((batch, KERNEL - 1, CHANNELS)).astype(np.float32)
    return x, weight, state


@pytest.mark.parametrize("with_state", [False, True])
def test_matches_numpy_loop(with_state):
    x, weight, state = _data(0, 2, 11)
    state = state if with_state else None
    y, final = _conv(x, weight, initial_state=state)
    ref_y, ref_final = naive_causal_conv1d(x, weight, initial_state=state)
    np.testing.assert_allclose(y, ref_y, **TOL)
    np.testing.assert_allclose(final, ref_final, **TOL)


def test_matches_torch_conv1d_layout():
    """Same weight layout as PyTorch's depthwise Conv1d([C, 1, K]) with K-1 left padding."""
    torch = pytest.importorskip("torch")
    x, weight, _ = _data(1, 2, 9)
    expected = torch.nn.functional.conv1d(
        torch.from_numpy(x).transpose(1, 2),
        torch.from_numpy(weight)[:, None],
        padding=KERNEL - 1,
        groups=CHANNELS,
    )[:, :, :9].transpose(1, 2)
    y, _ = _conv(x, weight)
    np.testing.assert_allclose(y, expected.numpy(), **TOL)


def test_packed_segments_reset_the_window_and_padding_outputs_zero():
    x, weight, state = _data(2, 2, 12)
    y, final = _conv(x, weight, initial_state=state, segment_ids=PACKED)
    ref_y, ref_final = naive_causal_conv1d(x, weight, initial_state=state, segment_ids=PACKED)
    np.testing.assert_allclose(y, ref_y, **TOL)
    np.testing.assert_allclose(final, ref_final, **TOL)
    assert not np.asarray(y)[PACKED == 0].any()
    # Row 0's last document (5 tokens) fills the cache; a 2-token document would leave a zero.
    np.testing.assert_array_equal(final[0], x[0, 5:8])


def test_short_last_document_leaves_zeros_in_final_state():
    x, weight, state = _data(3, 1, 6)
    ids = segments_from_lengths([[(1, 4), (2, 2)]], 6)
    _, final = _conv(x, weight, initial_state=state, segment_ids=ids)
    np.testing.assert_array_equal(final[0, 0], 0.0)
    np.testing.assert_array_equal(final[0, 1:], x[0, 4:6])


def test_all_padding_row_keeps_initial_state():
    x, weight, state = _data(4, 1, 5)
    y, final = _conv(x, weight, initial_state=state, segment_ids=np.zeros((1, 5), np.int32))
    np.testing.assert_array_equal(y, 0.0)
    np.testing.assert_array_equal(final, state)


def test_step_form_equals_full_conv():
    x, weight, state = _data(5, 2, 7)
    y, final = _conv(x, weight, initial_state=state)
    step = jax.jit(causal_conv1d_step)
    cache, outs = jnp.asarray(state), []
    for t in range(7):
        y_t, cache = step(x[:, t], weight, cache)
        outs.append(y_t)
    np.testing.assert_array_equal(np.stack(outs, axis=1), y)
    np.testing.assert_array_equal(cache, final)


@pytest.mark.parametrize("split", [1, 2, 5])
def test_continuation_from_final_state_equals_one_pass(split):
    x, weight, state = _data(6, 2, 9)
    y, final = _conv(x, weight, initial_state=state)
    y_head, head_final = _conv(x[:, :split], weight, initial_state=state)
    y_tail, tail_final = _conv(x[:, split:], weight, initial_state=head_final)
    np.testing.assert_array_equal(np.concatenate([y_head, y_tail], axis=1), y)
    np.testing.assert_array_equal(tail_final, final)


def test_gradient_is_finite_and_zero_at_padding():
    x, weight, state = _data(7, 2, 12)

    def loss(x, weight, state):
        y, final = causal_conv1d(x, weight, initial_state=state, segment_ids=PACKED)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final**2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, weight, state)
    assert all(np.isfinite(np.asarray(gr)).all() for gr in grads)
    assert not np.asarray(grads[0])[PACKED == 0].any()


def test_bad_shapes_are_named():
    x, weight, state = _data(8, 1, 4)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x, weight.T)
    with pytest.raises(ValueError, match="initial_state must be"):
        causal_conv1d(x, weight, initial_state=state[:, :2])
    with pytest.raises(ValueError, match="state must be"):
        causal_conv1d_step(x[:, 0], weight, state[:, :1])
