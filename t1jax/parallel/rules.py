"""The rules table that maps the model's logical axis names onto mesh axes, and meshes.

The vocabulary of logical names and the resolution mechanism belong to the model
(`t1jax.model.axes`; re-exported here for callers that shard); this module owns the parallelism's
side: the mesh axes every t1jax mesh has (`MESH_AXES`), the default rules table (`DEFAULT_RULES`),
`make_mesh`, and the shardings of a model state resolved from its parameters' names.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with sharded parameters), `expert`
(expert parallel), `context` (sequence parallel, used by the trainer's plans), `tensor`.
A model call under a mesh is sharded by the rules set with `nnx.logical_axis_rules(rules)`; with
no rules in scope the model adds no sharding constraint (`t1jax.model.axes.constrain`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from t1jax.model.axes import (  # noqa: F401  (the vocabulary, re-exported for callers that shard)
    ACT_BATCH,
    ACT_EMBED,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_LENGTH,
    ACT_MLP,
    ACT_VOCAB,
    CONV_KERNEL,
    EMBED,
    EXPERT,
    EXPERT_MLP,
    HEAD_DIM,
    KV_HEADS,
    LINEAR_CONV,
    LINEAR_HEADS,
    MLP,
    NORM,
    Q_HEADS,
    ROUTER,
    VOCAB,
    LogicalRules,
    constrain,
    logical_axes,
    resolve_spec,
)

# Every mesh in t1jax has these axes, in this order (sizes 1 where unused). `context` splits the
# sequence; only the trainer's sharding plans use it (`t1jax.parallel.plan`).
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


DEFAULT_RULES: LogicalRules = (
    (VOCAB, "tensor"),
    (EMBED, "fsdp"),
    (Q_HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (HEAD_DIM, None),
    (LINEAR_HEADS, "tensor"),
    (LINEAR_CONV, None),
    (CONV_KERNEL, None),
    (MLP, "tensor"),
    (EXPERT, "expert"),
    (EXPERT_MLP, "tensor"),
    (ROUTER, None),
    (NORM, None),
    (ACT_BATCH, ("data", "fsdp")),
    (ACT_LENGTH, None),  # becomes "context" with context parallelism
    (ACT_EMBED, None),
    (ACT_HEADS, "tensor"),
    (ACT_KV_HEADS, "tensor"),
    (ACT_VOCAB, "tensor"),
    (ACT_MLP, "tensor"),
)


def make_mesh(
    data: int = 1,
    fsdp: int = 1,
    expert: int = 1,
    tensor: int = 1,
    *,
    context: int = 1,
    devices: Sequence | None = None,
) -> Mesh:
    """A mesh with the named axes `MESH_AXES` (Auto axis types, so GSPMD propagates shardings)
    over the first data x fsdp x expert x context x tensor of `devices` (default: all), in a
    topology-aware device order where the devices have one (physical axes may be split across
    logical ones), else in the given order."""
    import numpy as np
    from jax.experimental import mesh_utils

    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "expert": expert, "context": context, "tensor": tensor}
    for axis, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis {axis} must be a positive int, got {size!r}")
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    needed = math.prod(shape)
    if needed > len(devices):
        raise ValueError(f"mesh {sizes} needs {needed} devices, only {len(devices)} available")
    devices = devices[:needed]
    try:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except ValueError:
        # Device sets without a usable topology (e.g. several slices): the order given.
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def state_shardings(state: nnx.State, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> nnx.State:
    """A tree mirroring `state` (from `nnx.split` / `nnx.state`) with each variable's value
    replaced by its NamedSharding, resolved from its logical axis names and shape. The result
    has the same tree structure as `state`, so it serves `jax.device_put(state, shardings)` and
    `jax.jit(..., in_shardings=...)`. Works on abstract states too."""

    def one(variable):
        if not isinstance(variable, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        spec = resolve_spec(logical_axes(variable), variable.get_value().shape, mesh, rules)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state: nnx.State, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> nnx.State:
    """`state` placed on `mesh` by its logical axis names."""
    return jax.device_put(state, state_shardings(state, mesh, rules))
