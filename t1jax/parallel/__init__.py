"""Meshes and the logical-axis sharding rules shared by the trainer and the sampler.

This package namespace re-exports the logical rules only (the model imports them, so importing
anything heavier here would be circular). The trainer's parallelism lives in submodules:

- ``t1jax.parallel.plan``: ``ShardingPlan``, named YAML plans, ``make_mesh(plan)``, parameter /
  optimizer / batch shardings.
- ``t1jax.parallel.forward``: ``parallel_forward(plan, mesh, ...)``, the forward hooks of a plan.
- ``t1jax.parallel.expert_parallel``: the all-to-all MoE dispatch.
- ``t1jax.parallel.context``: context-parallel attention, the recurrent relayout, ``ContextLayout``.
- ``t1jax.parallel.step``: a minimal actor train step and ``train_shardings``.
- ``t1jax.parallel.capacity`` / ``planner``: the per-device memory model and ``t1jax plan``.
- ``t1jax.parallel.lowering``: lowering a step on an abstract production mesh.
"""

from t1jax.parallel.rules import (
    DEFAULT_RULES,
    MESH_AXES,
    constrain,
    logical_axes,
    make_mesh,
    resolve_spec,
    shard_state,
    state_shardings,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "constrain",
    "logical_axes",
    "make_mesh",
    "resolve_spec",
    "shard_state",
    "state_shardings",
]
