"""The model's logical axis names, and how a rules table resolves them onto a mesh.

Every parameter of the model carries a tuple of logical axis names (its `out_sharding` metadata,
one name per dimension); activations are constrained with the same vocabulary through
`constrain`. This module owns that vocabulary and the mechanism that turns names into a
`PartitionSpec` for a given rules table, mesh and array shape. It knows no rules table: which
mesh axis a name maps to is the parallelism's decision (`t1jax.parallel.rules.DEFAULT_RULES`,
`t1jax.parallel.plan.plan_rules`), set by the caller with `nnx.logical_axis_rules(...)`.

Invariants of `resolve_spec`:
- a mesh axis is used at most once per array;
- a mesh axis that is missing from the mesh or has size 1 is dropped;
- a dimension is only sharded over mesh axes whose product divides it (the longest dividing prefix
  of the rule's axes is kept), so any rules table gives a valid sharding for any shape: too few
  heads for the tensor axis means replication, never an error.

`constrain` is a no-op unless both a mesh (`jax.set_mesh` / an abstract mesh) and rules are in
scope: a model called plainly (one device, tests, eager use) never sees a sharding constraint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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

# (logical name, mesh axis | axes | None) pairs, in the form `nnx.logical_axis_rules` takes.
LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


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
    rules: LogicalRules,
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


def rules_in_scope() -> LogicalRules:
    """The rules set with `nnx.logical_axis_rules(...)` (empty outside one)."""
    from flax.core import spmd as core_spmd

    return tuple(core_spmd.get_logical_axis_rules())


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names, under the mesh in scope and the rules in
    scope; a no-op when either is missing or the mesh has one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return x
    rules = rules_in_scope()
    if not rules:
        return x
    spec = resolve_spec(logical, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def per_shard(fn, in_logical: Sequence, out_logical: Sequence, *args):
    """``fn(*args)`` run on each device's shard: a ``shard_map`` over the mesh in scope with every
    argument and result placed by its logical names (``resolve_spec``), for kernels that cannot be
    partitioned automatically (Pallas / Mosaic calls). ``fn`` must be shard-local: each shard's
    results depend only on its own shard of the arguments (e.g. rows and heads independent).
    Without a multi-device mesh or rules in scope it is just ``fn(*args)``. The shard_map runs
    without varying-axes checks: a ``pallas_call``'s outputs carry no varying-axes type."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = rules_in_scope()
    if mesh.empty or math.prod(mesh.shape.values()) == 1 or not rules:
        return fn(*args)
    in_specs = tuple(
        resolve_spec(names, x.shape, mesh, rules) for names, x in zip(in_logical, args, strict=True)
    )
    leaves, treedef = jax.tree.flatten(jax.eval_shape(fn, *args))
    out_specs = treedef.unflatten(
        [resolve_spec(names, x.shape, mesh, rules) for names, x in zip(out_logical, leaves, strict=True)]
    )
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a model variable was declared with (None: replicated)."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else None
