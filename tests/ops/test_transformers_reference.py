"""Our ops against transformers' own pure-torch Qwen3.5-MoE fallbacks on the same random inputs.

transformers' functions take raw q, k with Hk key heads, L2-normalise them in float32, repeat each
key head over Hv / Hk consecutive value heads and scale q by dk**-0.5; the test does that
preparation on the JAX side exactly as ``Qwen3_5MoeGatedDeltaNet`` asks of the model layer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.ops import causal_conv1d, causal_conv1d_step, chunk_gated_delta_rule, recurrent_gated_delta_rule

torch = pytest.importorskip("torch")
qwen = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

pytestmark = pytest.mark.ref

BATCH, LENGTH, KEY_HEADS, VALUE_HEADS, DK, DV = 2, 45, 2, 4, 16, 8


def _raw_inputs(seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, LENGTH, KEY_HEADS, DK)).astype(np.float32)
    k = rng.standard_normal((BATCH, LENGTH, KEY_HEADS, DK)).astype(np.float32)
    v = rng.standard_normal((BATCH, LENGTH, VALUE_HEADS, DV)).astype(np.float32)
    a_log = np.log(rng.uniform(0.5, 8, VALUE_HEADS)).astype(np.float32)
    a = rng.standard_normal((BATCH, LENGTH, VALUE_HEADS)).astype(np.float32)
    # The model's decay: g = -exp(A_log) * softplus(a + dt_bias), here with dt_bias = 0.
    g = (-np.exp(a_log) * np.log1p(np.exp(a))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((BATCH, LENGTH, VALUE_HEADS))))).astype(np.float32)
    state = rng.standard_normal((BATCH, VALUE_HEADS, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


def _prepare_for_ours(q, k):
    def l2norm(x):
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    repeat = VALUE_HEADS // KEY_HEADS
    q = jnp.repeat(l2norm(jnp.asarray(q)) * DK**-0.5, repeat, axis=2)
    k = jnp.repeat(l2norm(jnp.asarray(k)), repeat, axis=2)
    return q, k


def _errors(ours, theirs):
    return [float(np.abs(np.asarray(a) - b.numpy()).max()) for a, b in zip(ours, theirs, strict=True)]


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_matches_torch_chunk_gated_delta_rule(chunk_size):
    q, k, v, g, beta, state = _raw_inputs(0)
    theirs = qwen.torch_chunk_gated_delta_rule(
        *(torch.from_numpy(x) for x in (q, k, v)),
        g=torch.from_numpy(g),
        beta=torch.from_numpy(beta),
        chunk_size=chunk_size,
        initial_state=torch.from_numpy(state),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    qn, kn = _prepare_for_ours(q, k)
    ours = jax.jit(chunk_gated_delta_rule, static_argnames="chunk_size")(
        qn, kn, v, g, beta, chunk_size=chunk_size, initial_state=state
    )
    out_error, state_error = _errors(ours, theirs)
    assert out_error < 1e-5 and state_error < 1e-5, (out_error, state_error)


def test_recurrent_matches_torch_recurrent_gated_delta_rule():
    q, k, v, g, beta, state = _raw_inputs(1)
    theirs = qwen.torch_recurrent_gated_delta_rule(
        *(torch.from_numpy(x) for x in (q, k, v)),
        g=torch.from_numpy(g),
        beta=torch.from_numpy(beta),
        initial_state=torch.from_numpy(state),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    qn, kn = _prepare_for_ours(q, k)
    ours = jax.jit(recurrent_gated_delta_rule)(qn, kn, v, g, beta, initial_state=state)
    out_error, state_error = _errors(ours, theirs)
    assert out_error < 1e-5 and state_error < 1e-5, (out_error, state_error)


def test_conv_matches_torch_causal_conv1d_fn_and_update():
    rng = np.random.default_rng(2)
    channels, kernel = 6, 4
    x = rng.standard_normal((BATCH, LENGTH, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, kernel)).astype(np.float32)
    theirs = qwen.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(weight))
    y, final = jax.jit(causal_conv1d)(x, weight)
    np.testing.assert_allclose(y, theirs.transpose(1, 2).numpy(), rtol=1e-6, atol=1e-6)

    # transformers' decode update keeps a K-long cache and rolls it; ours keeps the K-1 inputs.
    cache = torch.zeros(BATCH, channels, kernel)
    cache[:, :, 1:] = torch.from_numpy(np.array(final)).transpose(1, 2)
    x_next = rng.standard_normal((BATCH, channels)).astype(np.float32)
    their_next = qwen.causal_conv1d_update(
        torch.from_numpy(x_next)[:, :, None], cache, torch.from_numpy(weight)
    )
    our_next, _ = causal_conv1d_step(x_next, weight, final)
    np.testing.assert_allclose(our_next, their_next[:, :, 0].numpy(), rtol=1e-6, atol=1e-6)
