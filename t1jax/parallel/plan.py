"""Sharding plans: one place that turns parallel degrees into a mesh and into shardings.

A ``ShardingPlan`` names the degree of each parallel axis (data, fsdp, expert, tensor, context,
pipeline) and the options that change what a step keeps in memory (layer remat, the MoE
collective). Named plans are YAML files shipped with the package, ``t1jax/parallel/plans/``
(``load_plan``; any other file is given by its path).

Axis semantics (the mesh has axes ``MESH_AXES``; their product is the device count):
- ``data``: replicas; the batch is split, parameters are replicated.
- ``fsdp``: the batch is split and every parameter's ``embed`` dimension is sharded (gathered
  per use by XLA).
- ``expert``: routed experts are split (``E / expert`` per device, all-to-all dispatch); for
  everything else it acts as a data axis (the batch is split over it as well).
- ``tensor``: attention heads, Gated DeltaNet heads, MLP and expert intermediates, vocabulary.
- ``context``: the sequence (``t1jax.parallel.context``); parameters are replicated over it.
- ``pipeline``: accepted by the capacity model only (``make_mesh`` refuses a degree > 1: t1jax
  has no pipeline runtime).

Shardings: parameters follow ``plan_rules`` (the model's logical axis names -> these axes);
optimizer state (``optimizer_shardings``) is additionally split over every axis the parameter is
replicated on (a distributed optimizer), so Adam moments and master weights divide by the whole
device count wherever the shapes allow. Activations: batch over (data, fsdp, expert), sequence
over context (``batch_sharding``).

Invariant: every sharding produced here is valid for any shape (an axis that does not divide a
dimension is dropped, as in ``t1jax.parallel.rules.resolve_spec``), so a plan never makes a
model unrunnable, only less sharded; ``ShardingPlan.check_model`` reports where a plan cannot
shard what it promises (experts or heads not divisible).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from t1jax.parallel import rules as logical

MESH_AXES = logical.MESH_AXES
BATCH_AXES = ("data", "fsdp", "expert")
PLANS_DIR = Path(__file__).resolve().parent / "plans"  # package data (pyproject.toml)
REMAT_POLICIES = ("none", "layer")
MOE_COLLECTIVES = ("auto", "ragged", "padded")


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Parallel degrees and memory-relevant execution options (see module docstring)."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    context: int = 1
    pipeline: int = 1
    name: str = "custom"
    remat: str = "layer"
    moe_collective: str = "auto"
    description: str = ""

    def __post_init__(self):
        for axis in (*MESH_AXES, "pipeline"):
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"plan {self.name!r}: {axis} degree must be a positive int, got {value!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"plan {self.name!r}: remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.moe_collective not in MOE_COLLECTIVES:
            raise ValueError(
                f"plan {self.name!r}: moe_collective must be one of {MOE_COLLECTIVES}, "
                f"got {self.moe_collective!r}"
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def devices(self) -> int:
        """Device count: the product of all degrees, pipeline included."""
        return math.prod(self.degrees.values()) * self.pipeline

    @property
    def batch_shards(self) -> int:
        return self.data * self.fsdp * self.expert

    def label(self) -> str:
        parts = [f"{axis[:2] if axis != 'context' else 'cp'}{getattr(self, axis)}" for axis in MESH_AXES]
        if self.pipeline > 1:
            parts.append(f"pp{self.pipeline}")
        return " ".join(parts)

    def check_model(self, config) -> list[str]:
        """Reasons this plan cannot shard ``config`` as its degrees say (empty: none)."""
        problems = []
        if config.num_experts % self.expert:
            problems.append(f"{config.num_experts} experts do not split over expert={self.expert}")
        if self.tensor > 1:
            for what, count in (
                ("attention heads", config.num_attention_heads),
                ("Gated DeltaNet value heads", config.linear_num_value_heads),
                ("expert intermediate", config.moe_intermediate_size),
            ):
                if count % self.tensor:
                    problems.append(f"{count} {what} do not split over tensor={self.tensor}")
        if self.pipeline > 1 and config.num_hidden_layers % self.pipeline:
            problems.append(f"{config.num_hidden_layers} layers do not split over pipeline={self.pipeline}")
        return problems

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "plan") -> ShardingPlan:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown plan keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**dict(values))

    def to_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_plan(name_or_path: str | Path) -> ShardingPlan:
    """A plan from a YAML file (a path) or by name from ``PLANS_DIR/<name>.yaml``.

    The file holds the plan's fields under a ``plan:`` key (or at the top level); ``devices``,
    if present, must equal the product of the degrees."""
    from t1jax.yamlio import load_yaml

    path = Path(name_or_path)
    if not path.suffix:
        path = PLANS_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        available = sorted(p.stem for p in PLANS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no sharding plan at {path}; named plans: {available}")
    with path.open() as f:
        body = load_yaml(f)
    if not isinstance(body, Mapping):
        raise ValueError(f"{path}: expected a mapping, got {type(body).__name__}")
    body = dict(body.get("plan", body))
    devices = body.pop("devices", None)
    body.setdefault("name", path.stem)
    plan = ShardingPlan.from_mapping(body, source=str(path))
    if devices is not None and devices != plan.devices:
        raise ValueError(f"{path}: devices: {devices} but the degrees multiply to {plan.devices}")
    return plan


def _mesh_shape(plan: ShardingPlan) -> tuple[int, ...]:
    if plan.pipeline > 1:
        raise ValueError(
            f"plan {plan.name!r} has pipeline={plan.pipeline}: t1jax has no pipeline runtime "
            "(pipeline degrees are for the capacity model only)"
        )
    return tuple(plan.degrees[axis] for axis in MESH_AXES)


def make_mesh(plan: ShardingPlan, devices: Sequence | None = None) -> Mesh:
    """The plan's mesh (``t1jax.parallel.rules.make_mesh`` with the plan's degrees) over the
    first ``plan.devices`` of ``devices`` (default: all devices)."""
    _mesh_shape(plan)  # refuses a pipeline degree
    available = len(jax.devices()) if devices is None else len(devices)
    if available < plan.devices:
        raise ValueError(f"plan {plan.name!r} ({plan.label()}) needs {plan.devices} devices, got {available}")
    return logical.make_mesh(**plan.degrees, devices=devices)


def abstract_mesh(plan: ShardingPlan) -> jax.sharding.AbstractMesh:
    """The plan's mesh without devices (for lowering a step for a machine we do not have)."""
    shape = _mesh_shape(plan)
    return jax.sharding.AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def plan_rules(plan: ShardingPlan | None = None) -> logical.LogicalRules:
    """The model's default logical rules with the activation batch over (data, fsdp, expert) and
    the activation length over context. (Axes of size 1 drop out when resolved.)"""
    overrides = {logical.ACT_BATCH: BATCH_AXES, logical.ACT_LENGTH: "context"}
    return tuple((name, overrides.get(name, axes)) for name, axes in logical.DEFAULT_RULES)


def param_shardings(state: nnx.State, mesh, plan: ShardingPlan) -> nnx.State:
    """NamedShardings for a model state (concrete or abstract), from its logical axis names."""
    return logical.state_shardings(state, mesh, plan_rules(plan))


def _spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def distributed_spec(spec: PartitionSpec, shape: Sequence[int], mesh) -> PartitionSpec:
    """``spec`` additionally split over every mesh axis it does not use, each axis placed on the
    largest dimension it still divides (axes in mesh order; an axis that divides nothing is left
    out, i.e. that state stays replicated over it)."""
    entries = [list(_spec_axes(e)) for e in tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))]
    sizes = dict(mesh.shape)
    used = {a for e in entries for a in e}
    for axis in mesh.axis_names:
        if axis in used or sizes[axis] == 1:
            continue
        best, best_rest = None, 0
        for dim, extent in enumerate(shape):
            shards = math.prod(sizes[a] for a in entries[dim])
            if extent % (shards * sizes[axis]) == 0 and extent // shards > best_rest:
                best, best_rest = dim, extent // shards
        if best is not None:
            entries[best].append(axis)
            used.add(axis)
    return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


def optimizer_shardings(shardings, shapes):
    """Shardings for per-parameter optimizer state (Adam moments, float32 master weights): each
    parameter's sharding split further over the axes it is replicated on (``distributed_spec``).
    ``shardings`` and ``shapes`` are trees of the same structure (NamedSharding / objects with
    ``.shape``)."""

    def one(sharding, shaped):
        if not isinstance(sharding, NamedSharding):
            return sharding
        return NamedSharding(sharding.mesh, distributed_spec(sharding.spec, shaped.shape, sharding.mesh))

    return jax.tree.map(one, shardings, shapes)


def batch_sharding(mesh, plan: ShardingPlan, shape: Sequence[int]) -> NamedSharding:
    """Sharding of a [B, T, ...] batch array: B over (data, fsdp, expert), T over context."""
    names = (logical.ACT_BATCH, logical.ACT_LENGTH) + (None,) * (len(shape) - 2)
    return NamedSharding(mesh, logical.resolve_spec(names, shape, mesh, plan_rules(plan)))


def batch_axes_for(mesh, plan: ShardingPlan, batch_size: int) -> tuple[str, ...]:
    """The mesh axes that actually shard a batch of ``batch_size`` rows under the plan."""
    spec = logical.resolve_spec((logical.ACT_BATCH,), (batch_size,), mesh, plan_rules(plan))
    return _spec_axes(spec[0])
