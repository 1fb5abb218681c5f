"""The MoE's grouped matmul: the CPU tiled form against a per-group numpy matmul (values and
gradients; empty groups, groups shorter and longer than a tile, rows past the last group), and the
platform choice (a TPU lowering keeps ``ragged_dot``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.ops.grouped_matmul import grouped_matmul, tiled_grouped_matmul

SIZES = np.array([100, 0, 300, 1, 64, 65, 200, 250], np.int32)  # 980 rows of 1000 in groups
ROWS, K, N = 1000, 24, 16


def numpy_reference(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    start = 0
    for group, size in enumerate(sizes):
        out[start : start + size] = lhs[start : start + size].astype(np.float64) @ rhs[group]
        start += size
    return out


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    lhs = rng.standard_normal((ROWS, K)).astype(np.float32)
    rhs = rng.standard_normal((len(SIZES), K, N)).astype(np.float32)
    return lhs, rhs


@pytest.mark.parametrize("tile", [1, 16, 64, 4096])
def test_tiled_form_matches_per_group_matmuls(operands, tile):
    lhs, rhs = operands
    got = np.asarray(jax.jit(lambda a, b: tiled_grouped_matmul(a, b, SIZES, tile=tile))(lhs, rhs))
    want = numpy_reference(lhs, rhs, SIZES)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert not got[SIZES.sum() :].any()


def test_gradients_match_ragged_dot(operands):
    lhs, rhs = operands
    cotangent = np.random.default_rng(1).standard_normal((ROWS, N)).astype(np.float32)
    cotangent[SIZES.sum() :] = 0  # ragged_dot leaves rows past the groups unspecified

    def grads(fn):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b, SIZES) * cotangent), argnums=(0, 1)))(lhs, rhs)

    for got, want in zip(grads(grouped_matmul), grads(jax.lax.ragged_dot), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_a_tpu_lowering_keeps_ragged_dot(operands):
    lhs, rhs = operands
    text = jax.jit(grouped_matmul).trace(lhs, rhs, SIZES).lower(lowering_platforms=("tpu",)).as_text()
    assert "ragged_dot" in text and "scatter" not in text
