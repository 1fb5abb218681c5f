"""A minimal actor train step under a sharding plan, with the shardings of everything it touches.

This is the step the capacity model is calibrated on and the 122B configuration is lowered with;
the real learner (``t1jax.rl``) should build its steps from the same pieces: ``train_shardings``
for state and batch placement, ``parallel_forward`` around the model call, and donated state.

Step (one micro-batch, paper §4.4 actor objective without its extras): logits of the actor with
routing replayed from the sampler, token log-probabilities of the next tokens, the PPO clipped
surrogate ``-mean_mask(min(r A, clip(r, 1-eps, 1+eps) A))`` with ``r = exp(logp - logp_sampler)``;
gradients in float32; Adam (optax) on float32 weights.

State (``ActorTrainState``):
- ``params``: the model's parameters in ``param_dtype``, sharded by the plan's logical rules.
- ``master``: float32 copies when ``param_dtype`` is not float32 (``None`` otherwise), sharded
  like the optimizer state; the update is applied to them and cast back into ``params``.
- ``opt_state``: Adam moments (float32), split over every mesh axis a parameter is replicated
  on (``optimizer_shardings``: a distributed optimizer).

Batch (``ActorBatch``): int32 [B, T] ``input_ids``, ``targets`` (next token, any id where
``loss_mask`` is 0), ``segment_ids``, ``positions``; float32 [B, T] ``sampler_logprobs``,
``advantages``, ``loss_mask``; int32 [B, T, L, k] ``routing_replay``; and the layout
(``original_position`` / ``layout_slot``, int32 [B, T]) when the context layout is interleaved.
All of it in the model's layout (``ContextLayout.prepare``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from t1jax.model.config import Qwen35MoeConfig
from t1jax.parallel.context import LayoutIndex
from t1jax.parallel.forward import parallel_forward
from t1jax.parallel.plan import ShardingPlan, batch_sharding, optimizer_shardings, param_shardings

__all__ = [
    "ActorBatch",
    "ActorTrainState",
    "TrainShardings",
    "abstract_actor_batch",
    "init_train_state",
    "make_actor_train_step",
    "ppo_actor_loss",
    "train_shardings",
]


@struct.dataclass
class ActorTrainState:
    params: Any
    master: Any
    opt_state: Any


@struct.dataclass
class ActorBatch:
    input_ids: jax.Array
    targets: jax.Array
    segment_ids: jax.Array
    positions: jax.Array
    sampler_logprobs: jax.Array
    advantages: jax.Array
    loss_mask: jax.Array
    routing_replay: jax.Array
    layout: LayoutIndex | None = None


@dataclasses.dataclass(frozen=True)
class TrainShardings:
    state: ActorTrainState
    batch: ActorBatch


def ppo_actor_loss(logits, targets, sampler_logprobs, advantages, loss_mask, clip_epsilon=0.2):
    """PPO clipped surrogate, averaged over ``loss_mask`` tokens. logits float32 [B, T, V]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_logprobs = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ratio = jnp.exp(token_logprobs - sampler_logprobs)
    clipped = jnp.clip(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon)
    surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
    mask = loss_mask.astype(jnp.float32)
    return -jnp.sum(surrogate * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _optimizer(learning_rate: float) -> optax.GradientTransformation:
    return optax.adam(learning_rate)


def _float32_like(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), tree)


def train_shardings(
    abstract_params,
    mesh,
    plan: ShardingPlan,
    batch_shape: tuple[int, int],
    config: Qwen35MoeConfig,
    *,
    learning_rate: float = 1e-6,
    interleaved: bool = False,
) -> TrainShardings:
    """Shardings of the train state (for params shaped like ``abstract_params``) and the batch."""
    params_sharding = param_shardings(abstract_params, mesh, plan)
    distributed = optimizer_shardings(params_sharding, abstract_params)
    master_needed = any(x.dtype != jnp.float32 for x in jax.tree.leaves(abstract_params))
    abstract_target = _float32_like(abstract_params)
    abstract_opt = jax.eval_shape(_optimizer(learning_rate).init, abstract_target)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sharding = optax.tree_utils.tree_map_params(
        _optimizer(learning_rate),
        lambda _, sharding: sharding,
        abstract_opt,
        distributed,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    tokens = batch_sharding(mesh, plan, batch_shape)
    routing_shape = (*batch_shape, config.num_hidden_layers, config.num_experts_per_tok)
    batch = ActorBatch(
        input_ids=tokens,
        targets=tokens,
        segment_ids=tokens,
        positions=tokens,
        sampler_logprobs=tokens,
        advantages=tokens,
        loss_mask=tokens,
        routing_replay=batch_sharding(mesh, plan, routing_shape),
        layout=LayoutIndex(tokens, tokens) if interleaved else None,
    )
    state = ActorTrainState(
        params=params_sharding, master=distributed if master_needed else None, opt_state=opt_sharding
    )
    return TrainShardings(state=state, batch=batch)


def init_train_state(params, *, learning_rate: float = 1e-6) -> ActorTrainState:
    """A fresh state for concrete (or abstract, under ``jax.eval_shape``) params."""
    master_needed = any(x.dtype != jnp.float32 for x in jax.tree.leaves(params))
    master = jax.tree.map(lambda x: x.astype(jnp.float32), params) if master_needed else None
    target = master if master_needed else params
    return ActorTrainState(params=params, master=master, opt_state=_optimizer(learning_rate).init(target))


def abstract_actor_batch(config: Qwen35MoeConfig, batch_shape: tuple[int, int], shardings: ActorBatch):
    """``jax.ShapeDtypeStruct``s of an actor batch carrying ``shardings`` (for ``.lower``)."""
    rows, length = batch_shape

    def spec(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    tokens = (rows, length)
    routing = (rows, length, config.num_hidden_layers, config.num_experts_per_tok)
    layout = None
    if shardings.layout is not None:
        layout = LayoutIndex(
            spec(tokens, jnp.int32, shardings.layout.original_position),
            spec(tokens, jnp.int32, shardings.layout.layout_slot),
        )
    return ActorBatch(
        input_ids=spec(tokens, jnp.int32, shardings.input_ids),
        targets=spec(tokens, jnp.int32, shardings.targets),
        segment_ids=spec(tokens, jnp.int32, shardings.segment_ids),
        positions=spec(tokens, jnp.int32, shardings.positions),
        sampler_logprobs=spec(tokens, jnp.float32, shardings.sampler_logprobs),
        advantages=spec(tokens, jnp.float32, shardings.advantages),
        loss_mask=spec(tokens, jnp.float32, shardings.loss_mask),
        routing_replay=spec(routing, jnp.int32, shardings.routing_replay),
        layout=layout,
    )


def make_actor_train_step(
    graphdef: nnx.GraphDef,
    plan: ShardingPlan,
    mesh,
    shardings: TrainShardings,
    *,
    learning_rate: float = 1e-6,
    clip_epsilon: float = 0.2,
    chunk_size: int = 64,
) -> Callable[[ActorTrainState, ActorBatch], tuple[ActorTrainState, dict]]:
    """The jitted step ``(state, batch) -> (state, {"loss": ...})``; the state is donated."""
    optimizer = _optimizer(learning_rate)

    def loss_fn(params, batch: ActorBatch):
        model = nnx.merge(graphdef, params)
        with parallel_forward(
            plan, mesh, segment_ids=batch.segment_ids, layout_index=batch.layout, chunk_size=chunk_size
        ):
            out = model(
                batch.input_ids,
                segment_ids=batch.segment_ids,
                positions=batch.positions,
                routing_replay=batch.routing_replay,
            )
        return ppo_actor_loss(
            out.logits, batch.targets, batch.sampler_logprobs, batch.advantages, batch.loss_mask, clip_epsilon
        )

    def step(state: ActorTrainState, batch: ActorBatch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        target = state.params if state.master is None else state.master
        updates, opt_state = optimizer.update(grads, state.opt_state, target)
        target = optax.apply_updates(target, updates)
        if state.master is None:
            new_state = ActorTrainState(params=target, master=None, opt_state=opt_state)
        else:
            params = jax.tree.map(lambda m, p: m.astype(p.dtype), target, state.params)
            new_state = ActorTrainState(params=params, master=target, opt_state=opt_state)
        return new_state, {"loss": loss}

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(shardings.state, shardings.batch),
        out_shardings=(shardings.state, {"loss": replicated}),
        donate_argnums=(0,),
    )
