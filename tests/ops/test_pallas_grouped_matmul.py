"""The megablox grouped matmul (Pallas interpret mode on CPU) against `jax.lax.ragged_dot` and a
dense per-group numpy loop, forward and gradient, with empty groups and rows outside every
group; the kernel selection; and its lowering to Mosaic for TPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.ops.pallas import grouped_matmul

M, K, N = 40, 32, 24
GROUPS = np.array([7, 0, 13, 9, 0, 6], np.int32)  # sums to 35 < M: five rows belong to no group
TILING = (16, 16, 8)  # several row tiles, partial tiles at group edges, a partial last row tile


def _operands(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((M, K)).astype(dtype)
    rhs = rng.standard_normal((len(GROUPS), K, N)).astype(dtype)
    return lhs, rhs


def _dense_loop(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for group, size in enumerate(sizes):
        out[start : start + size] = lhs[start : start + size].astype(np.float64) @ rhs[group].astype(
            np.float64
        )
        start += size
    return out


def _megablox(lhs, rhs, sizes):
    return grouped_matmul(lhs, rhs, sizes, kernel="megablox", tiling=TILING, interpret=True)


def test_forward_matches_a_dense_loop_and_ragged_dot():
    lhs, rhs = _operands()
    got = jax.jit(_megablox)(lhs, rhs, GROUPS)
    np.testing.assert_allclose(got, _dense_loop(lhs, rhs, GROUPS), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got, jax.lax.ragged_dot(lhs, rhs, GROUPS), rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(got)[GROUPS.sum() :] == 0)


def test_gradients_match_ragged_dot():
    lhs, rhs = _operands(seed=1)
    weight = np.random.default_rng(2).standard_normal((M, N)).astype(np.float32)

    def grads(kernel):
        def loss(lhs, rhs):
            return jnp.sum(
                grouped_matmul(lhs, rhs, GROUPS, kernel=kernel, tiling=TILING, interpret=True) * weight
            )

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)

    (d_lhs, d_rhs), (want_lhs, want_rhs) = grads("megablox"), grads("ragged_dot")
    np.testing.assert_allclose(d_lhs, want_lhs, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d_rhs, want_rhs, rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(d_lhs)[GROUPS.sum() :] == 0)  # rows outside every group
    assert np.all(np.asarray(d_rhs)[[1, 4]] == 0)  # empty groups


def test_bfloat16_output_dtype_follows_the_inputs_as_ragged_dot():
    lhs, rhs = (jnp.asarray(x, jnp.bfloat16) for x in _operands(seed=3))
    got = _megablox(lhs, rhs, GROUPS)
    want = jax.lax.ragged_dot(lhs, rhs, GROUPS)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=5e-2
    )


def test_the_kernel_is_chosen_explicitly():
    lhs, rhs = _operands()
    with pytest.raises(ValueError, match="compiles for TPU only"):
        grouped_matmul(lhs, rhs, GROUPS, kernel="megablox")
    with pytest.raises(ValueError, match="kernel must be one of"):
        grouped_matmul(lhs, rhs, GROUPS, kernel="gmm")
    np.testing.assert_array_equal(grouped_matmul(lhs, rhs, GROUPS), jax.lax.ragged_dot(lhs, rhs, GROUPS))


def test_forward_and_backward_lower_to_mosaic_for_tpu():
    from t1jax.ops.pallas import megablox_grouped_matmul

    lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((8, 256, 384), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

    def loss(lhs, rhs, sizes):
        return jnp.sum(megablox_grouped_matmul(lhs, rhs, sizes).astype(jnp.float32))

    lowered = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["tpu"])(lhs, rhs, sizes)
    assert lowered.mlir_module().count("tpu_custom_call") >= 2  # gmm for d_lhs, tgmm for d_rhs
