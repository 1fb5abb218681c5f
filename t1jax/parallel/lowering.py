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

__all__ = ["LoweringReport", "lower_actor_step"]


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
