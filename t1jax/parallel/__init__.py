"""Meshes and the logical-axis sharding rules shared by the trainer and the sampler.

This package namespace re-exports the rules only. The model never imports it (the logical axis
names live in ``t1jax.model.axes``) and it never imports the learner (what lowers or calibrates
the learner's programs lives in ``t1jax.tools``). The trainer's parallelism lives in submodules:

- ``t1jax.parallel.plan``: ``ShardingPlan``, named YAML plans, ``make_mesh(plan)``, parameter /
  optimizer / batch shardings.
- ``t1jax.parallel.forward``: ``parallel_forward(plan, mesh, ...)``, the forward hooks of a plan.
- ``t1jax.parallel.expert_parallel``: the all-to-all MoE dispatch.
- ``t1jax.parallel.context``: context-parallel attention, the recurrent relayout, ``ContextLayout``.
- ``t1jax.parallel.capacity``: the per-device memory model of the learner (paper Eq. 21).
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
