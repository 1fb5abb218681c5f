"""Lowering (not running) the actor train step of a real configuration on a production-sized
abstract mesh: proof, without the hardware, that a plan's shardings are consistent.

``lower_actor_step(config, plan, tokens)`` builds the abstract model (``nnx.eval_shape``: no
parameter is allocated), the plan's ``AbstractMesh`` (no device is needed), abstract train state and
batch carrying their ``NamedSharding``s, and calls ``jax.jit(step, in_shardings, out_shardings)
.lower(...)``: tracing, shard_map spec checks, the sharding of every parameter, optimizer moment
and batch array. ``LoweringReport`` summarises what was lowered.

Compiling the result needs the target backend (XLA:CPU cannot compile a 256-device TPU program),
so this stops at the StableHLO module.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from t1jax.model.config import Qwen35MoeConfig
from t1jax.parallel.plan import ShardingPlan, abstract_mesh
from t1jax.parallel.step import abstract_actor_batch, init_train_state, make_actor_train_step, train_shardings

__all__ = ["LoweringReport", "lower_actor_step", "lower_learner_updates"]


@dataclasses.dataclass(frozen=True)
class LoweringReport:
    plan: ShardingPlan
    tokens: int
    rows: int
    parameters: int
    state_arrays: int
    seconds_abstract: float
    seconds_lower: float
    hlo_chars: int
    platform: str
    lowered: object = dataclasses.field(repr=False, default=None)


def _abstract_model(config: Qwen35MoeConfig, dtype, param_dtype):
    from t1jax.model.transformer import Qwen35MoeForCausalLM

    try:  # the model package's fast path, when present: no tracing of initialisers
        from t1jax.model.params import abstract_params
    except ImportError:
        return nnx.eval_shape(lambda: Qwen35MoeForCausalLM(config, dtype=dtype, param_dtype=param_dtype))
    with abstract_params():
        return Qwen35MoeForCausalLM(config, dtype=dtype, param_dtype=param_dtype)


def lower_actor_step(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    *,
    rows: int = 1,
    param_dtype=jnp.bfloat16,
    compute_dtype=jnp.bfloat16,
    interleaved: bool = True,
    platform: str = "tpu",
) -> LoweringReport:
    """Lower one actor train step for ``rows`` sequences of ``tokens`` per batch shard, for
    ``platform`` (the lowering rules of that backend: TPU's ragged_dot and ragged all-to-all)."""
    start = time.perf_counter()
    model = _abstract_model(config, compute_dtype, param_dtype)
    graphdef, params = nnx.split(model)
    mesh = abstract_mesh(plan)
    batch_shape = (rows * plan.batch_shards, tokens)
    interleaved = interleaved and plan.context > 1
    shardings = train_shardings(params, mesh, plan, batch_shape, config, interleaved=interleaved)
    state = jax.eval_shape(init_train_state, params)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings.state
    )
    batch = abstract_actor_batch(config, batch_shape, shardings.batch)
    abstract_seconds = time.perf_counter() - start
    step = make_actor_train_step(graphdef, plan, mesh, shardings)
    start = time.perf_counter()
    lowered = step.trace(state, batch).lower(lowering_platforms=(platform,))
    lower_seconds = time.perf_counter() - start
    return LoweringReport(
        plan=plan,
        tokens=tokens,
        rows=rows,
        parameters=sum(x.size for x in jax.tree.leaves(params)),
        state_arrays=len(jax.tree.leaves(state)),
        seconds_abstract=abstract_seconds,
        seconds_lower=lower_seconds,
        hlo_chars=len(lowered.as_text()),
        platform=platform,
        lowered=lowered,
    )


def lower_learner_updates(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    *,
    rows: int = 1,
    rl_config=None,
    param_dtype=jnp.bfloat16,
    compute_dtype=jnp.bfloat16,
    platform: str = "tpu",
) -> dict[str, LoweringReport]:
    """Lower the ``Learner``'s own gradient programs under ``plan``: the actor's (PPO surrogate,
    routing replayed, Eq. 18 / 27) and the critic's (clipped value loss, Eq. 17), one micro-batch
    of ``rows`` sequences of ``tokens`` per batch shard each, on the plan's abstract mesh. These
    are the programs ``Learner.step`` runs (``t1jax.rl.learner.learner_programs``), parameters
    and batch carrying the shardings the learner gives them."""
    from t1jax.model.critic import Qwen35MoeCritic
    from t1jax.model.params import abstract_params
    from t1jax.model.transformer import Qwen35MoeForCausalLM
    from t1jax.parallel.plan import batch_sharding, plan_rules
    from t1jax.parallel.rules import state_shardings
    from t1jax.rl.batching import TrainBatch
    from t1jax.rl.config import RLConfig
    from t1jax.rl.learner import learner_programs

    rl_config = RLConfig() if rl_config is None else rl_config
    mesh = abstract_mesh(plan)
    rules = plan_rules(plan)
    with abstract_params():
        actor = Qwen35MoeForCausalLM(config, dtype=compute_dtype, param_dtype=param_dtype)
        critic = Qwen35MoeCritic(config, dtype=compute_dtype, param_dtype=param_dtype)

    def placed(module):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        shardings = state_shardings(params, mesh, rules)
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
        )
        return graphdef, params, rest

    (actor_graphdef, actor_params, actor_rest), (critic_graphdef, critic_params, critic_rest) = (
        placed(actor),
        placed(critic),
    )
    programs = learner_programs(actor_graphdef, critic_graphdef, rl_config, mesh, plan)
    shape = (rows * plan.batch_shards, tokens)
    routing_shape = (*shape, config.num_hidden_layers, config.num_experts_per_tok)

    def spec(shape_, dtype):
        return jax.ShapeDtypeStruct(shape_, dtype, sharding=batch_sharding(mesh, plan, shape_))

    batch = TrainBatch(
        input_ids=spec(shape, jnp.int32),
        target_ids=spec(shape, jnp.int32),
        action_mask=spec(shape, jnp.float32),
        sampler_logprobs=spec(shape, jnp.float32),
        rewards=spec(shape, jnp.float32),
        segment_ids=spec(shape, jnp.int32),
        positions=spec(shape, jnp.int32),
        routing=spec(routing_shape, jnp.int32),
    )
    per_token = spec(shape, jnp.float32)
    count = jax.ShapeDtypeStruct((), jnp.float32)
    calls = {
        "actor_grad": (
            programs.actor_grad,
            (actor_params, actor_rest, batch, per_token, per_token, count, True),
            actor_params,
        ),
        "critic_grad": (
            programs.critic_grad,
            (critic_params, critic_rest, batch, per_token, per_token, count),
            critic_params,
        ),
    }
    reports = {}
    for name, (program, args, params) in calls.items():
        start = time.perf_counter()
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = program.trace(*args).lower(lowering_platforms=(platform,))
        reports[name] = LoweringReport(
            plan=plan,
            tokens=tokens,
            rows=rows,
            parameters=sum(x.size for x in jax.tree.leaves(params)),
            state_arrays=len(jax.tree.leaves(params)),
            seconds_abstract=0.0,
            seconds_lower=time.perf_counter() - start,
            hlo_chars=len(lowered.as_text()),
            platform=platform,
            lowered=lowered,
        )
    return reports
