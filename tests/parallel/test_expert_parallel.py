"""Expert parallelism on the 8-device CPU mesh against the single-device MoE (``routed_experts``):
forward and gradients w.r.t. tokens, router and experts, 2/4/8-way expert meshes, free and replay
router modes; the padded collective against ``ragged_all_to_all``'s documented semantics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from t1jax.model.execution import ExecutionConfig
from t1jax.model.moe import route, routed_experts
from t1jax.parallel.expert_parallel import expert_parallel_routed_experts, padded_ragged_all_to_all

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 96, 16, 8, 8, 2


def _mesh(shape, names):
    count = int(np.prod(shape))
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:count]
    )


def _case(seed):
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    x = normal(TOKENS, HIDDEN)
    router = normal(HIDDEN, EXPERTS)
    weights = (
        normal(EXPERTS, HIDDEN, INTER, scale=0.3),
        normal(EXPERTS, HIDDEN, INTER, scale=0.3),
        normal(EXPERTS, INTER, HIDDEN, scale=0.3),
    )
    # Replay ids: distinct per token, deliberately skewed so one expert shard gets most rows.
    replay = np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=_skew()) for _ in range(TOKENS)])
    return x, router, weights, jnp.asarray(replay, jnp.int32)


def _skew():
    p = np.ones(EXPERTS)
    p[:2] = 20.0
    return p / p.sum()


def _moe(dispatch, x, router, w_gate, w_up, w_down, replay=None):
    expert_ids, gates = route(x @ router, TOP_K, replay)
    return dispatch(x, expert_ids, gates, w_gate, w_up, w_down)


def _loss(dispatch, replay):
    """jit of (x, router, *weights) -> ((loss, moe output), grads w.r.t. all five)."""

    def loss(x, router, w_gate, w_up, w_down):
        out = _moe(dispatch, x, router, w_gate, w_up, w_down, replay)
        return jnp.sum(jnp.sin(out) * jnp.arange(HIDDEN, dtype=jnp.float32)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@functools.cache
def _reference(seed, mode):
    x, router, weights, replay = _case(seed)
    replay = replay if mode == "replay" else None
    return _loss(routed_experts, replay)(x, router, *weights)


def _relative(got, want):
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


@pytest.mark.parametrize(
    ("degree", "mode"),
    [
        (2, "free"),
        pytest.param(2, "replay", marks=pytest.mark.slow),
        pytest.param(4, "free", marks=pytest.mark.slow),
        (4, "replay"),
        (8, "free"),
        (8, "replay"),
    ],
)
def test_expert_parallel_matches_single_device(degree, mode):
    x, router, weights, replay = _case(0)
    replay = replay if mode == "replay" else None
    mesh = _mesh((degree,), ("expert",))
    dispatch = functools.partial(expert_parallel_routed_experts, mesh=mesh, collective="padded")
    (loss, out), grads = _loss(dispatch, replay)(x, router, *weights)
    (want_loss, want), want_grads = _reference(0, mode)
    # Forward: every (token, expert) row meets the same weights; only XLA:CPU's ragged_dot tiling
    # over a different row count can change the last bits.
    assert _relative(out, want) < 1e-6
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for name, got, want in zip(("x", "router", "w_gate", "w_up", "w_down"), grads, want_grads, strict=True):
        assert _relative(got, want) < 1e-5, (name, _relative(got, want))


def test_expert_parallel_composes_with_data_and_tensor_axes():
    """Tokens over (data, expert), intermediates over tensor: one psum re-associates the down
    projection, so equality is to float32 rounding."""
    x, router, weights, replay = _case(1)
    mesh = _mesh((2, 2, 2), ("data", "expert", "tensor"))
    dispatch = functools.partial(
        expert_parallel_routed_experts,
        mesh=mesh,
        token_axes=("data", "expert"),
        tensor_axis="tensor",
        collective="padded",
    )
    (loss, _), grads = _loss(dispatch, replay)(x, router, *weights)
    (want_loss, _), want_grads = _loss(routed_experts, replay)(x, router, *weights)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        assert _relative(got, want) < 1e-5


def test_megablox_kernel_in_the_expert_parallel_dispatch_matches_single_device():
    """The Pallas megablox matmul (interpreted) in every shard, tokens over (data, expert) and
    intermediates over tensor (the shard_map runs without varying-axes checks for a Pallas
    kernel; its tensor-axis psum must still sum exactly once), against the single-device MoE."""
    x, router, weights, replay = _case(2)
    mesh = _mesh((2, 2, 2), ("data", "expert", "tensor"))
    megablox = ExecutionConfig(grouped_matmul_kernel="megablox", pallas_interpret=True).grouped_matmul()
    dispatch = functools.partial(
        expert_parallel_routed_experts,
        mesh=mesh,
        token_axes=("data", "expert"),
        tensor_axis="tensor",
        collective="padded",
        matmul=megablox,
    )
    (loss, out), grads = _loss(dispatch, replay)(x, router, *weights)
    (want_loss, want), want_grads = _loss(routed_experts, replay)(x, router, *weights)
    assert _relative(out, want) < 1e-5
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for name, got, want in zip(("x", "router", "w_gate", "w_up", "w_down"), grads, want_grads, strict=True):
        assert _relative(got, want) < 1e-5, (name, _relative(got, want))


def test_padded_collective_has_ragged_all_to_all_semantics():
    """The two-device example of ``jax.lax.ragged_all_to_all``'s docstring, run through the padded
    implementation (XLA:CPU has no ragged all-to-all)."""
    mesh = _mesh((2,), ("x",))
    operand = jnp.asarray([[1, 2, 2], [3, 4, 0]], jnp.float32)
    output = jnp.zeros((2, 4), jnp.float32)
    input_offsets = jnp.asarray([[0, 1], [0, 1]], jnp.int32)
    send_sizes = jnp.asarray([[1, 2], [1, 1]], jnp.int32)
    output_offsets = jnp.asarray([[0, 0], [1, 2]], jnp.int32)
    recv_sizes = jnp.asarray([[1, 1], [2, 1]], jnp.int32)

    def body(*args):
        args = [a[0] for a in args]
        return padded_ragged_all_to_all(*args, axis_name="x", capacity=2)[None]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    got = run(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_bad_shapes_are_rejected_with_the_cause():
    x, router, weights, _ = _case(2)
    ids, gates = route(x @ router, TOP_K)
    with pytest.raises(ValueError, match="cannot be split evenly over expert axis of size 3"):
        expert_parallel_routed_experts(x, ids, gates, *weights, mesh=_mesh((3,), ("expert",)))
    with pytest.raises(ValueError, match="must include the expert axis"):
        expert_parallel_routed_experts(
            x, ids, gates, *weights, mesh=_mesh((2, 2), ("data", "expert")), token_axes=("data",)
        )
    with pytest.raises(ValueError, match="collective must be one of"):
        expert_parallel_routed_experts(x, ids, gates, *weights, mesh=_mesh((2,), ("expert",)), collective="x")
