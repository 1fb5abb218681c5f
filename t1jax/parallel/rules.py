"""Logical axis names and the table that maps them onto mesh axes.

Every parameter of the model carries a tuple of logical axis names (its `out_sharding` metadata,
one name per dimension); activations are constrained with the same vocabulary through
`constrain`. This module owns the vocabulary, the default rules table, and the resolution of a
logical spec into a `PartitionSpec` for a given mesh and array shape.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with sharded parameters), `expert`
(expert parallel), `tensor` (tensor parallel), and room for `context` (sequence parallel).

Invariants of `resolve_spec`:
- a mesh axis is used at most once per array;
- a mesh axis that is missing from the mesh or has size 1 is dropped;
- a dimension is only sharded over mesh axes whose product divides it (the longest dividing prefix
  of the rule's axes is kept), so any rules table gives a valid sharding for any shape — too few
  heads for the tensor axis means replication, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

# Every mesh in t1jax has these axes, in this order (sizes 1 where unused). `context` splits the
# sequence; only the trainer's sharding plans use it (`t1jax.parallel.plan`).
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

# Logical names of parameter dimensions.
VOCAB = "vocab"
EMBED = "embed"  # the model width (hidden_size)
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
LINEAR_HEADS = "linear_heads"  # Gated DeltaNet value heads
LINEAR_CONV = "linear_conv"  # Gated DeltaNet conv channels, [q | k | v] concatenated
CONV_KERNEL = "conv_kernel"
MLP = "mlp"  # shared-expert intermediate
EXPERT = "expert"
EXPERT_MLP = "expert_mlp"  # routed-expert intermediate
ROUTER = "router"  # the expert axis of the router kernel (kept whole on every device)
NORM = "norm"

# Logical names of activation dimensions.
ACT_BATCH = "act_batch"
ACT_LENGTH = "act_length"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV_HEADS = "act_kv_heads"
ACT_VOCAB = "act_vocab"
ACT_MLP = "act_mlp"

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

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


def _rules_dict(rules: LogicalRules) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for logical, mesh_axes in rules:
        if mesh_axes is None:
            out[logical] = ()
        elif isinstance(mesh_axes, str):
            out[logical] = (mesh_axes,)
        else:
            out[logical] = tuple(mesh_axes)
    return out


def resolve_spec(
    logical: Sequence[str | None] | None,
    shape: Sequence[int],
    mesh: Mesh | jax.sharding.AbstractMesh,
    rules: LogicalRules = DEFAULT_RULES,
) -> PartitionSpec:
    """Map one array's logical axis names to a PartitionSpec valid for `shape` on `mesh`."""
    if logical is None:
        return PartitionSpec()
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match the array's rank {len(shape)}")
    table = _rules_dict(rules)
    mesh_sizes = dict(mesh.shape)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, size in zip(logical, shape, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        chosen: list[str] = []
        product = 1
        for axis in table[name]:
            axis_size = mesh_sizes.get(axis, 1)
            if axis in used or axis_size == 1:
                continue
            if size % (product * axis_size) != 0:
                break
            chosen.append(axis)
            product *= axis_size
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def current_rules() -> LogicalRules:
    """Rules set with `nnx.logical_axis_rules(...)`, else `DEFAULT_RULES`."""
    from flax.core import spmd as core_spmd

    return tuple(core_spmd.get_logical_axis_rules()) or DEFAULT_RULES


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names under the mesh set with `jax.set_mesh`;
    a no-op when no mesh is set (single device, tests, eager use)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return x
    spec = resolve_spec(logical, x.shape, mesh, current_rules())
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a model variable was declared with (None: replicated)."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else None


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
