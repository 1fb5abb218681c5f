"""Meshes and the logical-axis sharding rules shared by the trainer and the sampler."""

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
