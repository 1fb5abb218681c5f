"""The whole model with its sequence sharded over a ``context`` mesh axis (interleaved layout,
packed documents, padding) against the single-device forward of the same weights.

Tolerances: the context-parallel operators are exact in arithmetic (the recurrent relay bit for
bit, see tests/ops; attention over the same keys in the same order), but XLA:CPU compiles the
per-token ops around them (RMSNorm means, ragged_dot, softmax rows) for a [T / D]-row array
differently from a [T]-row one, which moves the last bits: logits agree to 1e-5 relative (the
contiguous layout at D = 2 is bit-exact) and every expert choice is identical.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from t1jax.model import Qwen35MoeForCausalLM, with_execution
from t1jax.model.attention import attend, packed_causal_mask
from t1jax.model.config import FULL_ATTENTION, LINEAR_ATTENTION
from t1jax.model.execution import ExecutionConfig
from t1jax.ops.context_parallel import PackedSequenceDescriptor
from t1jax.ops.flash_attention import visited_key_blocks
from t1jax.parallel.context import ContextLayout, context_parallel_attention
from t1jax.parallel.forward import parallel_forward
from t1jax.parallel.plan import ShardingPlan, batch_sharding, make_mesh, param_shardings
from tests.model.model_helpers import randomize_all

ROWS = 2


LENGTH = 512  # one length for every degree, so the single-device programs compile once


def _descriptor(degree):
    """Row 0: documents crossing shard edges, a document of exactly D tokens whose padding segment
    is also D tokens long (same length, one sample), a long tail. Row 1: one long document, its
    padding, then a padding sample."""
    length = LENGTH
    row0 = [37, degree, 3 * degree + 5, length // 2 - 12 * degree]
    row1 = [length - 6 * degree - 3]
    descriptor = PackedSequenceDescriptor.from_documents(
        [row0, row1], row_length=length, context_degree=degree
    )
    lengths, padding = descriptor.segment_lengths[0], descriptor.segment_is_padding[0]
    assert (degree, degree) in {
        (lengths[i], lengths[i + 1]) for i in range(len(lengths) - 1) if not padding[i] and padding[i + 1]
    }
    return descriptor


def _ids(config, descriptor, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (descriptor.rows, descriptor.row_length)).astype(np.int32)


@functools.cache
def _single_forward(graphdef):
    @jax.jit
    def forward(state, input_ids, segment_ids):
        out = nnx.merge(graphdef, state)(input_ids, segment_ids=segment_ids)
        return out.logits, out.routing

    return forward


def _plan_forward(graphdef, plan, mesh):
    @jax.jit
    def forward(state, batch, layout_index):
        with parallel_forward(plan, mesh, segment_ids=batch["segment_ids"], layout_index=layout_index):
            out = nnx.merge(graphdef, state)(
                batch["input_ids"], segment_ids=batch["segment_ids"], positions=batch["positions"]
            )
        return out.logits, out.routing

    return forward


def _placed(mesh, plan, state, batch):
    state = jax.device_put(state, param_shardings(state, mesh, plan))
    batch = {k: jax.device_put(v, batch_sharding(mesh, plan, v.shape)) for k, v in batch.items()}
    return state, batch


def _relative(got, want, where):
    got, want = np.asarray(got)[where], np.asarray(want)[where]
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("degree", [2, pytest.param(4, marks=pytest.mark.slow), 8])
def test_context_parallel_model_forward_matches_single_device(tiny_model, tiny_config, degree):
    descriptor = _descriptor(degree)
    segment_ids = descriptor.segment_ids()
    input_ids = _ids(tiny_config, descriptor)
    graphdef, state = nnx.split(tiny_model)
    want_logits, want_routing = _single_forward(graphdef)(state, input_ids, segment_ids)

    plan = ShardingPlan(context=degree, remat="none")
    mesh = make_mesh(plan)
    layout = ContextLayout.interleaved(descriptor)
    state, batch = _placed(mesh, plan, state, layout.prepare(input_ids, segment_ids))
    logits, routing = _plan_forward(graphdef, plan, mesh)(state, batch, layout.index())
    logits, routing = layout.to_contiguous(logits), layout.to_contiguous(routing)

    real = segment_ids != 0
    assert _relative(logits, want_logits, real) < 1e-5
    np.testing.assert_array_equal(routing[real], np.asarray(want_routing)[real])


@pytest.mark.slow
def test_context_parallel_contiguous_layout_matches_single_device(tiny_model, tiny_config):
    """No relayout (the sequence in contiguous order, shard s holding tokens [sT/D, (s+1)T/D)),
    at D = 2. Not bit-exact: each shard runs the MoE on its own tokens, and XLA:CPU's matmuls of
    another row count round differently (~1e-7 per logit); the routing is identical."""
    descriptor = _descriptor(2)
    segment_ids = descriptor.segment_ids()
    input_ids = _ids(tiny_config, descriptor, seed=1)
    graphdef, state = nnx.split(tiny_model)
    want_logits, want_routing = _single_forward(graphdef)(state, input_ids, segment_ids)
    plan = ShardingPlan(context=2, remat="none")
    mesh = make_mesh(plan)
    layout = ContextLayout.contiguous(*segment_ids.shape)
    state, batch = _placed(mesh, plan, state, layout.prepare(input_ids, segment_ids))
    logits, routing = _plan_forward(graphdef, plan, mesh)(state, batch, None)
    assert _relative(logits, want_logits, segment_ids != 0) < 1e-5
    np.testing.assert_array_equal(np.asarray(routing), np.asarray(want_routing))


SMALL_BLOCKS = ExecutionConfig(attention_block_q=16, attention_block_k=32)


def _attention_case(degree):
    descriptor = _descriptor(degree)
    segment_ids = descriptor.segment_ids()
    rng = np.random.default_rng(degree)
    shape = (ROWS, descriptor.row_length)
    query = rng.standard_normal((*shape, 4, 16)).astype(np.float32)
    key, value = (rng.standard_normal((*shape, 2, 16)).astype(np.float32) for _ in range(2))
    return descriptor, segment_ids, query, key, value


@pytest.mark.parametrize("degree", [2, 4, 8])
@pytest.mark.parametrize(
    "execution", [ExecutionConfig(attention="dense"), SMALL_BLOCKS], ids=["dense", "blockwise"]
)
def test_context_attention_matches_single_device(degree, execution):
    """The context-parallel attention core alone, interleaved layout, GQA, packed documents,
    against the single-device dense attention. Dense: each query reduces over the same keys in
    the same order as on one device (XLA:CPU may still tile the [T/D, T] reductions differently
    from [T, T] ones: last-bit differences at some shapes); blockwise (several query and key
    blocks per shard): the online softmax re-associates the normaliser."""
    descriptor, segment_ids, query, key, value = _attention_case(degree)
    want = jax.jit(lambda q, k, v, s: attend(q, k, v, packed_causal_mask(s)))(query, key, value, segment_ids)
    mesh = make_mesh(ShardingPlan(context=degree))
    layout = ContextLayout.interleaved(descriptor)
    run = jax.jit(functools.partial(context_parallel_attention, mesh=mesh, execution=execution))
    got = run(*(layout.to_layout(a) for a in (query, key, value, segment_ids)), layout.original_position)
    real = segment_ids != 0
    assert _relative(layout.to_contiguous(got), want, real) < 1e-6


def test_blockwise_context_attention_gradients_match_single_device():
    """d query, d key, d value of the blockwise context-parallel attention (D = 4, zigzag layout,
    K/V cotangents reduce-scattered back to their shards) against one device's dense attention."""
    degree = 4
    descriptor, segment_ids, query, key, value = _attention_case(degree)
    real = segment_ids != 0
    weight = np.random.default_rng(7).standard_normal(query.shape).astype(np.float32) * real[..., None, None]

    def dense(q, k, v):
        return jnp.sum(attend(q, k, v, packed_causal_mask(segment_ids)) * weight)

    want = jax.jit(jax.grad(dense, argnums=(0, 1, 2)))(query, key, value)
    mesh = make_mesh(ShardingPlan(context=degree))
    layout = ContextLayout.interleaved(descriptor)
    laid_ids, laid_weight = layout.to_layout(segment_ids), layout.to_layout(weight)

    def sharded(q, k, v):
        out = context_parallel_attention(
            q, k, v, laid_ids, layout.original_position, mesh=mesh, execution=SMALL_BLOCKS
        )
        return jnp.sum(out * laid_weight)

    got = jax.jit(jax.grad(sharded, argnums=(0, 1, 2)))(*(layout.to_layout(a) for a in (query, key, value)))
    for g, w in zip(got, want, strict=True):
        assert _relative(layout.to_contiguous(g), w, np.ones_like(real)) < 1e-5


def test_zigzag_layout_balances_blockwise_attention_work():
    """One document filling the row: under the zigzag layout every context shard's query blocks
    read the same number of key blocks; in the contiguous layout the last shard reads D times
    more than the first (the imbalance the zigzag exists to remove, paper §7.2)."""
    degree, length, block = 4, 1024, 32
    segment_ids = np.ones((1, length), np.int32)
    descriptor = PackedSequenceDescriptor.from_documents([[length]], row_length=length, context_degree=degree)
    layouts = {
        "zigzag": ContextLayout.interleaved(descriptor).original_position[0],
        "contiguous": np.arange(length),
    }
    work = {}
    for name, order in layouts.items():
        per_shard = []
        for shard in np.split(order, degree):
            visited = visited_key_blocks(
                jnp.ones((1, shard.size), jnp.int32),
                jnp.asarray(segment_ids),
                jnp.asarray(shard[None], jnp.int32),
                block_q=block,
                block_k=block,
            )
            per_shard.append(int(np.sum(visited)))
        work[name] = per_shard
    assert len(set(work["zigzag"])) == 1
    assert work["contiguous"][-1] > (degree + 1) * work["contiguous"][0]
    assert sum(work["zigzag"]) == sum(work["contiguous"])


def _token_loss(logits, targets, mask):
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    return -jnp.sum(picked * mask) / jnp.sum(mask)


def _grad_case(tiny_config, degree):
    descriptor = _descriptor(degree)
    segment_ids = descriptor.segment_ids()
    input_ids = _ids(tiny_config, descriptor, seed=3)
    targets = np.roll(input_ids, -1, axis=1)
    mask = ((segment_ids != 0) & (np.roll(segment_ids, -1, axis=1) == segment_ids)).astype(np.float32)
    return descriptor, segment_ids, input_ids, targets, mask


@functools.cache
def _single_train_grad(graphdef):
    @jax.jit
    def run(state, input_ids, segment_ids, replay, targets, mask):
        def loss(state):
            out = nnx.merge(graphdef, state)(input_ids, segment_ids=segment_ids, routing_replay=replay)
            return _token_loss(out.logits, targets, mask), out.logits

        return jax.value_and_grad(loss, has_aux=True)(state)

    return run


def _gradient_errors(grads, want_grads):
    """(global relative L2 error, worst per-parameter max error relative to that parameter's max)."""
    flat_got = dict(nnx.to_flat_state(grads))
    squared_error = squared_norm = worst = 0.0
    for path, want in nnx.to_flat_state(want_grads):
        got, want = (
            np.asarray(flat_got[path].get_value(), np.float64),
            np.asarray(want.get_value(), np.float64),
        )
        squared_error += float(np.sum((got - want) ** 2))
        squared_norm += float(np.sum(want**2))
        worst = max(worst, float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)))
    return (squared_error / squared_norm) ** 0.5, worst


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(ShardingPlan(name="context2", context=2), marks=pytest.mark.slow),
        pytest.param(ShardingPlan(name="context4", context=4), marks=pytest.mark.slow),
        pytest.param(ShardingPlan(name="context8", context=8), marks=pytest.mark.slow),
        ShardingPlan(name="fsdp2-expert2-context2", fsdp=2, expert=2, context=2),
    ],
    ids=lambda plan: plan.name,
)
def test_train_forward_and_gradients_match_single_device(tiny_model, tiny_config, plan):
    """Train-style forward + backward (routing replayed from the single-device forward, layer
    remat, interleaved layout): loss, logits and gradients w.r.t. every parameter against one
    device. Gradients re-associate sums over tokens and devices (FSDP reduce-scatters, K/V
    cotangent reduce-scatters, EP returns): parameters whose gradient is a heavily cancelling sum
    (A_log, dt_bias) see ~1e-4 of their own (small) scale, the whole gradient ~1e-6 in L2."""
    _check_train_step(tiny_model, tiny_model, tiny_config, plan)


@pytest.mark.slow
def test_scanned_layers_under_a_plan_match_the_unrolled_single_device_step(tiny_config):
    """The layer scan (three repeats of a [linear, full] period, each layer rematerialised inside
    the scan body) with expert and context parallelism, against the unrolled single-device step."""
    types = (LINEAR_ATTENTION, FULL_ATTENTION) * 3
    model = Qwen35MoeForCausalLM(
        tiny_config.replace(num_hidden_layers=6, layer_types=types), rngs=nnx.Rngs(5)
    )
    randomize_all(model, seed=5)
    for layer in model.model.layers:
        layer.mlp.gate.set_value(layer.mlp.gate[...] * 20.0)
    scanned = with_execution(model, ExecutionConfig(scan_layers=True))
    plan = ShardingPlan(name="fsdp2-expert2-context2", fsdp=2, expert=2, context=2)
    _check_train_step(model, scanned, tiny_config, plan)


def _check_train_step(reference_model, sharded_model, tiny_config, plan):
    descriptor, segment_ids, input_ids, targets, mask = _grad_case(tiny_config, plan.context)
    graphdef, state = nnx.split(reference_model)
    _, replay = _single_forward(graphdef)(state, input_ids, segment_ids)
    replay = np.asarray(replay)
    (want_loss, want_logits), want_grads = _single_train_grad(graphdef)(
        state, input_ids, segment_ids, replay, targets, mask
    )

    graphdef = nnx.graphdef(sharded_model)
    mesh = make_mesh(plan)
    layout = ContextLayout.interleaved(descriptor)
    batch = layout.prepare(input_ids, segment_ids, routing_replay=replay)
    batch["targets"] = layout.to_layout(targets)
    batch["mask"] = layout.to_layout(mask)
    placed_state, batch = _placed(mesh, plan, state, batch)

    @jax.jit
    def sharded(state, batch, layout_index):
        def loss(state):
            with parallel_forward(plan, mesh, segment_ids=batch["segment_ids"], layout_index=layout_index):
                logits = nnx.merge(graphdef, state)(
                    batch["input_ids"],
                    segment_ids=batch["segment_ids"],
                    positions=batch["positions"],
                    routing_replay=batch["routing_replay"],
                ).logits
            return _token_loss(logits, batch["targets"], batch["mask"]), logits

        return jax.value_and_grad(loss, has_aux=True)(state)

    (loss, logits), grads = sharded(placed_state, batch, layout.index())
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert _relative(layout.to_contiguous(logits), want_logits, segment_ids != 0) < 1e-5
    global_error, worst_parameter = _gradient_errors(grads, want_grads)
    assert global_error < 1e-5
    assert worst_parameter < 1e-3
