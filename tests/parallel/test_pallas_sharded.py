"""The Pallas kernels on a multi-device mesh: a Mosaic kernel is not partitioned automatically, so
the model runs splash attention and the Pallas delta rule per shard (``per_shard``) and megablox
inside the expert-parallel dispatch. On the 8 CPU devices (fsdp 2 x expert 2 x tensor 2, the
kernels interpreted), the model's loss, logits and gradients equal the single-device model with
the pure-JAX choices (dense attention, the reference delta rule, ragged_dot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from t1jax.model import with_execution
from t1jax.model.execution import ExecutionConfig
from t1jax.parallel.forward import parallel_forward
from t1jax.parallel.plan import ShardingPlan, batch_sharding, make_mesh, param_shardings

PALLAS = ExecutionConfig(
    attention="splash",
    attention_block_q=128,
    attention_block_k=128,
    gated_delta_rule_kernel="pallas",
    grouped_matmul_kernel="megablox",
    pallas_interpret=True,
)
JAX = ExecutionConfig(attention="dense")


def _batch(config, rows=4, length=128):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, config.vocab_size, (rows, length)).astype(np.int32)
    lengths = np.array([128, 97, 64, 30])
    segments = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    segments[0, 70:] = 2  # a second document in row 0
    return jnp.asarray(ids), jnp.asarray(segments)


def _loss_fn(graphdef, plan=None, mesh=None):
    def loss(state, ids, segments):
        def body():
            out = nnx.merge(graphdef, state)(ids, segment_ids=segments)
            logprobs = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
            picked = jnp.take_along_axis(logprobs[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
            mask = (segments[:, 1:] != 0) & (segments[:, 1:] == segments[:, :-1])
            return -jnp.sum(jnp.where(mask, picked, 0.0)) / jnp.sum(mask), out.logits

        if plan is None:
            return body()
        with parallel_forward(plan, mesh, segment_ids=segments):
            return body()

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.slow
def test_pallas_kernels_per_shard_match_the_single_device_jax_model(tiny_model, tiny_config):
    ids, segments = _batch(tiny_config)
    reference = with_execution(tiny_model, JAX)
    graphdef, state = nnx.split(reference)
    (want_loss, want_logits), want_grads = _loss_fn(graphdef)(state, ids, segments)

    plan = ShardingPlan(fsdp=2, expert=2, tensor=2, remat="none", moe_collective="padded")
    mesh = make_mesh(plan)
    model = with_execution(tiny_model, PALLAS)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        placed = jax.device_put(state, param_shardings(state, mesh, plan))
        batch = batch_sharding(mesh, plan, ids.shape)
        (loss, logits), grads = _loss_fn(graphdef, plan, mesh)(
            placed, jax.device_put(ids, batch), jax.device_put(segments, batch)
        )
    real = np.asarray(segments) != 0
    got, want = np.asarray(logits)[real], np.asarray(want_logits)[real]
    assert np.max(np.abs(got - want)) <= 2e-5 * np.max(np.abs(want))
    assert float(loss) == pytest.approx(float(want_loss), rel=2e-5)
    flat = dict(nnx.to_flat_state(grads))
    for path, expected in nnx.to_flat_state(want_grads):
        g, w = np.asarray(flat[path].get_value()), np.asarray(expected.get_value())
        assert np.max(np.abs(g - w)) <= 1e-3 * max(np.max(np.abs(w)), 1e-30), path
