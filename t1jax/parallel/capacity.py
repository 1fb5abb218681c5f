"""A per-device memory model of one train step under a sharding plan (paper §7.1, Eq. 21), for the
sharding t1jax actually implements, calibrated against XLA's own memory analysis.

    b(plan, T) = weights + gradients + optimizer + batch + boundary          (exact, from shapes)
               + c_act layer + c_moe dispatch + c_ragged ragged_dense + c_saved saved
               + c_attn attention_scores + c_logit logits + residue        (<= M)

Terms, per device, for ``rows`` sequences of T tokens per batch shard (``n = rows * T / context``
tokens on a device; the terminal stage when a pipeline degree is given):

- ``weights``: every parameter's size x bytes(param_dtype) / its shard count under the plan's
  logical rules (experts over ``expert``, embed over ``fsdp``, heads / intermediates / vocab over
  ``tensor``; replicated over data and context). Printed split as Pe / Pd like the paper.
- ``gradients``: one gradient per parameter in param_dtype, sharded like the parameter, plus its
  float32 cast in the optimizer sharding when param_dtype is not float32.
- ``optimizer``: Adam moments (2 x float32) and, when param_dtype is not float32, a float32 master
  copy, all split over every mesh axis the parameter is replicated on (a distributed optimizer):
  for experts this divides by the whole device count, the plan-invariance of Proposition 7.1.
- ``batch``: the step's per-token inputs (ids, masks, advantages, replayed routing [L, k]).
- ``boundary``: the layer inputs layer remat keeps for the backward, n x hidden x L.
- ``layer``: the working set of one decoder layer's recomputed forward and backward, from the
  structural widths per token of the Gated DeltaNet mixer (projections, conv, q/k/v, the chunk
  terms of the delta rule), of full attention (q/gate/k/v; with context parallelism the gathered
  K/V) and of the MoE's per-token part (router, gates, combine, shared expert). Head-indexed
  widths divide by the tensor degree when it divides the head count.
- ``dispatch``: the MoE's dispatched rows and their expert intermediates: k rows per token, or
  with expert parallelism the worst-case receive buffer eta * min(k, E / eta) rows per token
  (no token is ever dropped), plus the padded collective's blocks where it is used.
- ``ragged_dense``: only where ``lax.ragged_dot`` has no native kernel (XLA:CPU lowers it densely:
  every dispatched row is expanded over all local experts), rows x E_local x (2 hidden + I).
- ``saved``: without remat, every layer's residuals kept for the backward.
- ``attention_scores`` / ``attention_mask``: the dense attention core's [T / context, T] float32
  score block per local head and its mask per row (one layer with remat, all attention layers
  without); 0 with a flash-style kernel.
- ``logits``: n x |V| / tensor float32 (the paper's 4|V|T/kappa term, on the terminal stage).
- ``residue``: b0 (calibrated) plus ``residue_fraction`` x M for allocator fragmentation on the
  device (0 when comparing with XLA's analysis, which has none).

Calibration: the seven c's and b0 are fitted (non-negative least squares) to
``compiled.memory_analysis()`` of the tiny model's train step (``t1jax.parallel.step``: forward,
backward, Adam update, donated state) at several token counts, vocabularies, expert counts and
depths (``calibrate``); ``validate`` compares predictions with fresh compilations of other small
configurations. A calibration records its backend: XLA:CPU's numbers include the dense ragged_dot
and the CPU attention core; a TPU calibration (the same code on a TPU host) replaces them. On CPU
the step is compiled with XLA:CPU's memory-optimised scheduler: the default one optimises for
concurrency and recomputes every remat'd layer up front (8 tiny layers at T = 512: 112 MiB of
temporaries instead of 18 MiB), which accelerators' memory-aware schedulers do not do.

Assumptions, stated once: Adam; float32 moments; a float32 master copy iff param_dtype is not
float32; gradients all live at the peak; one micro-batch (gradient accumulation adds one float32
gradient in the optimizer sharding, the ``gradients`` term's second part); layer remat per plan.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from t1jax.model.config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35MoeConfig
from t1jax.parallel.plan import MESH_AXES, ShardingPlan

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "configs" / "capacity"
# Terms computed exactly from shapes, and terms scaled by a calibrated coefficient (in the order
# of `fit_calibration`'s unknowns; the residue b0 is the last unknown).
EXACT_TERMS = ("weights", "batch", "gradients", "optimizer", "boundary")
FITTED_TERMS = (
    "layer",
    "dispatch",
    "ragged_dense",
    "saved",
    "attention_scores",
    "attention_mask",
    "logits",
)
TERMS = (*EXACT_TERMS, *FITTED_TERMS, "residue")


# --------------------------------------------------------------------------------------------------
# assumptions and calibration
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryAssumptions:
    """What a step keeps, beyond the plan. ``ragged_dot``: "dense" (XLA:CPU's lowering) or
    "grouped" (TPU/GPU kernels); ``attention``: "dense" (t1jax's attention core) or "flash"."""

    param_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"
    ragged_dot: str = "grouped"
    attention: str = "dense"
    rows: int = 1
    residue_fraction: float = 0.03
    chunk_size: int = 64

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {sorted(DTYPE_BYTES)}, got {getattr(self, name)!r}")
        if self.ragged_dot not in ("dense", "grouped"):
            raise ValueError(f"ragged_dot must be 'dense' or 'grouped', got {self.ragged_dot!r}")
        if self.attention not in ("dense", "flash"):
            raise ValueError(f"attention must be 'dense' or 'flash', got {self.attention!r}")
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")

    @property
    def master_weights(self) -> bool:
        return self.param_dtype != "float32"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Fitted multiplicities (bytes XLA allocates per byte of each structural term) and b0."""

    activation: float
    dispatch: float
    ragged: float
    saved: float
    attention: float
    mask: float
    logits: float
    residue_bytes: float
    backend: str = "unknown"
    jax_version: str = "unknown"
    points: tuple = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        body = json.loads(text)
        body["points"] = tuple(tuple(p) if isinstance(p, list) else p for p in body.get("points", ()))
        return cls(**body)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_json(Path(path).read_text())


def default_calibration() -> Calibration:
    """The stored calibration of the tiny model (``configs/capacity/cpu_tiny.json``)."""
    return Calibration.load(CALIBRATION_DIR / "cpu_tiny.json")


# --------------------------------------------------------------------------------------------------
# the parameter inventory (shapes and logical axes, per layer type)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParameterGroup:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...] | None
    count: int  # how many parameters of the model have this shape and axes
    is_expert: bool
    layer_type: str | None  # None: embedding, head, final norm


@functools.cache
def parameter_inventory(config: Qwen35MoeConfig) -> tuple[ParameterGroup, ...]:
    """The model's parameters grouped by (shape, logical axes), from an abstract model with one
    layer of each type (layers of one type are identical), multiplied by the layer counts."""
    import jax.numpy as jnp
    from flax import nnx

    from t1jax.model.transformer import Qwen35MoeForCausalLM
    from t1jax.parallel.rules import logical_axes

    types = [t for t in (LINEAR_ATTENTION, FULL_ATTENTION) if t in config.layer_types]
    probe = config.replace(num_hidden_layers=len(types), layer_types=tuple(types))
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(probe, dtype=jnp.float32))
    counts = {t: config.layer_types.count(t) for t in types}
    groups: dict[tuple, int] = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = logical_axes(variable)
        shape = tuple(variable.get_value().shape)
        if len(path) > 2 and path[0] == "model" and path[1] == "layers":
            layer_type = types[int(path[2])]
            count = counts[layer_type]
        else:
            layer_type, count = None, 1
        key = (shape, axes, bool(axes and "expert" in axes), layer_type)
        groups[key] = groups.get(key, 0) + count
    return tuple(
        ParameterGroup(shape, axes, count, is_expert, layer_type)
        for (shape, axes, is_expert, layer_type), count in sorted(groups.items(), key=str)
    )


def parameter_counts(config: Qwen35MoeConfig) -> tuple[int, int]:
    """(Pe, Pd): routed-expert and all other parameters."""
    expert = dense = 0
    for group in parameter_inventory(config):
        size = math.prod(group.shape) * group.count
        if group.is_expert:
            expert += size
        else:
            dense += size
    return expert, dense


# --------------------------------------------------------------------------------------------------
# per-device sizes
# --------------------------------------------------------------------------------------------------


def _abstract_mesh(plan: ShardingPlan):
    import jax
    from jax.sharding import AxisType

    shape = tuple(getattr(plan, axis) for axis in MESH_AXES)
    return jax.sharding.AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def _shard_sizes(config: Qwen35MoeConfig, plan: ShardingPlan) -> list[tuple[ParameterGroup, int, int]]:
    """Per group: (group, elements per device under the parameter sharding, under the optimizer
    sharding), for one pipeline stage's share of the layers (the terminal stage)."""
    from jax.sharding import NamedSharding

    from t1jax.parallel import rules as logical
    from t1jax.parallel.plan import distributed_spec, plan_rules

    mesh = _abstract_mesh(plan)
    rules = plan_rules(plan)
    out = []
    for group in parameter_inventory(config):
        count = group.count
        if group.layer_type is not None:
            count = math.ceil(count / plan.pipeline)
        spec = logical.resolve_spec(group.axes, group.shape, mesh, rules)
        local = math.prod(NamedSharding(mesh, spec).shard_shape(group.shape))
        opt_spec = distributed_spec(spec, group.shape, mesh)
        opt_local = math.prod(NamedSharding(mesh, opt_spec).shard_shape(group.shape))
        out.append((group, local * count, opt_local * count))
    return out


def _divides(count: int, degree: int) -> int:
    """The factor a dimension of ``count`` is split by: ``degree`` if it divides, else 1."""
    return degree if degree > 1 and count % degree == 0 else 1


def structural_terms(
    config: Qwen35MoeConfig, plan: ShardingPlan, tokens: int, assumptions: MemoryAssumptions
) -> dict[str, float]:
    """The uncalibrated terms in bytes per device (see module docstring)."""
    rows, context = assumptions.rows, plan.context
    local_tokens = rows * tokens / context
    compute = DTYPE_BYTES[assumptions.compute_dtype]
    param_bytes = DTYPE_BYTES[assumptions.param_dtype]
    f32 = 4

    weights = gradients = optimizer = 0.0
    for _group, local, opt_local in _shard_sizes(config, plan):
        weights += local * param_bytes
        gradients += local * param_bytes + (opt_local * f32 if assumptions.master_weights else 0)
        optimizer += opt_local * (8 + (4 if assumptions.master_weights else 0))

    layers_here = [config.layer_types[i] for i in range(config.num_hidden_layers)]
    layers_here = layers_here[len(layers_here) - math.ceil(len(layers_here) / plan.pipeline) :]
    hidden = config.hidden_size
    tau = plan.tensor

    # Gated DeltaNet working set per token.
    lin_heads = config.linear_num_value_heads / _divides(config.linear_num_value_heads, tau)
    dk, dv, conv, chunk = (
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_dim,
        assumptions.chunk_size,
    )
    gdn = (
        2 * hidden * compute
        + conv * compute
        + 2 * conv * f32
        + lin_heads * dv * compute
        + 4 * lin_heads * f32
        + lin_heads * (2 * dk + dv) * f32
        + lin_heads * (dv + 3 * dk + 4 * chunk) * f32
        + 2 * lin_heads * dv * f32
    )
    # Full attention working set per token (scores counted separately).
    heads = config.num_attention_heads / _divides(config.num_attention_heads, tau)
    kv_heads = config.num_key_value_heads / _divides(config.num_key_value_heads, tau)
    head_dim = config.head_dim
    attention = (
        2 * hidden * compute
        + 4 * heads * head_dim * compute
        + 4 * kv_heads * head_dim * compute
        + 2 * heads * head_dim * compute
    )
    if context > 1:  # K/V of the whole row gathered, then reordered
        attention += 2 * 2 * kv_heads * head_dim * compute * context
    # MoE working set per token.
    experts, top_k, eta = config.num_experts, config.num_experts_per_tok, plan.expert
    local_experts = experts // eta if experts % eta == 0 else experts
    rows_per_token = top_k if eta == 1 else eta * min(top_k, local_experts)
    inter = config.moe_intermediate_size / _divides(config.moe_intermediate_size, tau)
    shared = config.shared_expert_intermediate_size / _divides(config.shared_expert_intermediate_size, tau)
    moe = (
        hidden * compute
        + 2 * experts * f32
        + 2 * top_k * f32
        + top_k * hidden * compute
        + top_k * hidden * f32
        + 3 * shared * compute
        + hidden * f32
    )
    # The dispatched rows and their expert intermediates (k per token; with expert parallelism
    # the worst-case receive buffer), and the padded collective's blocks out and back.
    dispatch = rows_per_token * (2 * hidden + 3 * inter) * compute
    # "auto" is the ragged all-to-all except on CPU (where ragged_dot is dense too): padded there.
    padded = plan.moe_collective == "padded" or (
        plan.moe_collective == "auto" and assumptions.ragged_dot == "dense"
    )
    if eta > 1 and padded:
        dispatch += 2 * rows_per_token * hidden * compute
    ragged = rows_per_token * local_experts * (2 * hidden + inter) * compute
    if assumptions.ragged_dot == "grouped":
        ragged = 0.0

    per_type = {LINEAR_ATTENTION: gdn + moe, FULL_ATTENTION: attention + moe}
    attention_layers = sum(1 for t in layers_here if t == FULL_ATTENTION)
    # One layer's working set is live in either mode (the backward of the layer being processed).
    layer = local_tokens * max(per_type[t] for t in set(layers_here))
    dispatch_bytes = local_tokens * dispatch
    ragged_bytes = local_tokens * ragged
    if plan.remat == "layer":
        boundary = local_tokens * len(layers_here) * hidden * compute
        saved = 0.0
        live_attention = min(1, attention_layers)
    else:  # every layer's residuals are kept for the backward
        boundary = 0.0
        saved = local_tokens * sum(per_type[t] + dispatch for t in layers_here)
        live_attention = attention_layers
    # Dense attention: per local head a float32 [T / context, T] score block; per row one
    # [T / context, T] mask (shared by the heads). A flash-style kernel keeps neither.
    scores = mask = 0.0
    if assumptions.attention == "dense":
        pairs = live_attention * rows * (tokens / context) * tokens
        scores = pairs * heads * f32
        mask = pairs * f32
    vocab = config.vocab_size / _divides(config.vocab_size, tau)
    logits = local_tokens * vocab * f32
    # Token ids, targets, segment ids, positions, three float32 per-token values, the replayed
    # routing [L, k], and with context parallelism the two layout index arrays.
    batch = local_tokens * (7 * 4 + config.num_hidden_layers * top_k * 4 + (8 if context > 1 else 0))
    return {
        "weights": weights,
        "batch": batch,
        "gradients": gradients,
        "optimizer": optimizer,
        "boundary": boundary,
        "layer": layer,
        "dispatch": dispatch_bytes,
        "ragged_dense": ragged_bytes,
        "saved": saved,
        "attention_scores": scores,
        "attention_mask": mask,
        "logits": logits,
    }


# --------------------------------------------------------------------------------------------------
# the estimate
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes by term for one plan; ``budget`` M in bytes (None: no verdict)."""

    plan: ShardingPlan
    tokens: int
    terms: dict
    budget: float | None = None
    problems: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def feasible(self) -> bool:
        return not self.problems and (self.budget is None or self.total <= self.budget)

    def binding_term(self) -> str:
        return max(self.terms, key=self.terms.get)

    def verdict(self) -> str:
        """Why the plan fails (empty if it fits)."""
        if self.problems:
            return "; ".join(self.problems)
        if self.budget is None or self.total <= self.budget:
            return ""
        name = self.binding_term()
        share = self.terms[name] / self.budget
        if self.terms[name] > self.budget:
            return f"{name} alone is {self.terms[name] / GIB:.1f} GiB > M"
        over = (self.total - self.budget) / GIB
        return f"over by {over:.1f} GiB; largest term {name} = {share:.0%} of M"


def estimate(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    *,
    assumptions: MemoryAssumptions = MemoryAssumptions(),
    calibration: Calibration | None = None,
    budget_bytes: float | None = None,
) -> MemoryEstimate:
    """The model's per-device bytes for ``plan`` at a token wall of ``tokens``."""
    calibration = default_calibration() if calibration is None else calibration
    raw = structural_terms(config, plan, tokens, assumptions)
    terms = {
        "weights": raw["weights"],
        "batch": raw["batch"],
        "gradients": raw["gradients"],
        "optimizer": raw["optimizer"],
        "boundary": raw["boundary"],
        "layer": calibration.activation * raw["layer"],
        "dispatch": calibration.dispatch * raw["dispatch"],
        "ragged_dense": calibration.ragged * raw["ragged_dense"],
        "saved": calibration.saved * raw["saved"],
        "attention_scores": calibration.attention * raw["attention_scores"],
        "attention_mask": calibration.mask * raw["attention_mask"],
        "logits": calibration.logits * raw["logits"],
        "residue": calibration.residue_bytes + assumptions.residue_fraction * (budget_bytes or 0.0),
    }
    problems = tuple(plan.check_model(config))
    if tokens % (2 * plan.context):
        problems += (f"{tokens} tokens do not split into 2 x context = {2 * plan.context} chunks",)
    elif plan.context > 1 and (tokens // plan.context) % assumptions.chunk_size:
        problems += (
            f"T / context = {tokens // plan.context} is not a multiple of the delta-rule chunk "
            f"({assumptions.chunk_size})",
        )
    return MemoryEstimate(plan=plan, tokens=tokens, terms=terms, budget=budget_bytes, problems=problems)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_plans(
    devices: int, *, pipelines: Sequence[int] = (1,), remat: str = "layer"
) -> list[ShardingPlan]:
    """Every assignment of degrees (data, fsdp, expert, tensor, context, pipeline) whose product
    is ``devices``."""
    plans = []
    for pipeline in pipelines:
        if devices % pipeline:
            continue
        rest = devices // pipeline
        for data, fsdp, expert, tensor in itertools.product(_divisors(rest), repeat=4):
            used = data * fsdp * expert * tensor
            if rest % used:
                continue
            context = rest // used
            name = f"d{data}-f{fsdp}-e{expert}-t{tensor}-c{context}" + (
                f"-p{pipeline}" if pipeline > 1 else ""
            )
            plans.append(
                ShardingPlan(
                    data=data,
                    fsdp=fsdp,
                    expert=expert,
                    tensor=tensor,
                    context=context,
                    pipeline=pipeline,
                    name=name,
                    remat=remat,
                    moe_collective="ragged",
                )
            )
    return plans


def rank_plans(estimates: Iterable[MemoryEstimate]) -> tuple[list[MemoryEstimate], list[MemoryEstimate]]:
    """(feasible, infeasible). Feasible plans first by how many sequences run side by side
    (data x fsdp x expert: throughput), then by a larger expert degree (experts are 95% of the
    parameters: sharding them over ``expert`` moves tokens, over ``fsdp`` it gathers weights every
    step; the paper pins the expert degree maximal), then fewer tensor and pipeline shards, then
    lower per-device bytes; infeasible ones by how far over budget they are."""
    estimates = list(estimates)
    feasible = [e for e in estimates if e.feasible]
    infeasible = [e for e in estimates if not e.feasible]
    feasible.sort(
        key=lambda e: (-e.plan.batch_shards, -e.plan.expert, e.plan.tensor, e.plan.pipeline, e.total)
    )
    infeasible.sort(key=lambda e: (bool(e.problems), e.total))
    return feasible, infeasible


# --------------------------------------------------------------------------------------------------
# XLA's side: measurement, calibration, validation
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CalibrationPoint:
    """One compiled train step: a config override of the tiny model, a plan, a token count."""

    name: str
    tokens: int
    overrides: tuple = ()  # ((field, value), ...) applied to the base config
    plan: ShardingPlan = ShardingPlan()
    rows: int = 1

    def config(self, base: Qwen35MoeConfig) -> Qwen35MoeConfig:
        return base.replace(**dict(self.overrides)) if self.overrides else base


def cpu_assumptions(rows: int = 1) -> MemoryAssumptions:
    """What the CPU calibration compiles: float32 everywhere, dense ragged_dot, dense attention,
    no fragmentation allowance."""
    return MemoryAssumptions(
        param_dtype="float32",
        compute_dtype="float32",
        ragged_dot="dense",
        attention="dense",
        rows=rows,
        residue_fraction=0.0,
    )


def measure(config: Qwen35MoeConfig, plan: ShardingPlan, tokens: int, assumptions: MemoryAssumptions) -> int:
    """Per-device bytes XLA allocates for the train step: arguments + temporaries + outputs that
    do not alias a donated argument (``compiled.memory_analysis()``; compiles, never runs)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from t1jax.model.transformer import Qwen35MoeForCausalLM
    from t1jax.parallel.plan import make_mesh
    from t1jax.parallel.step import (
        abstract_actor_batch,
        init_train_state,
        make_actor_train_step,
        train_shardings,
    )

    dtype = getattr(jnp, assumptions.compute_dtype)
    param_dtype = getattr(jnp, assumptions.param_dtype)
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(config, dtype=dtype, param_dtype=param_dtype))
    graphdef, params = nnx.split(model)
    mesh = make_mesh(plan)
    shape = (assumptions.rows * plan.batch_shards, tokens)
    shardings = train_shardings(params, mesh, plan, shape, config, interleaved=plan.context > 1)
    step = make_actor_train_step(graphdef, plan, mesh, shardings, chunk_size=assumptions.chunk_size)
    state = jax.eval_shape(init_train_state, params)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings.state
    )
    batch = abstract_actor_batch(config, shape, shardings.batch)
    options = (
        {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
        if jax.default_backend() == "cpu"
        else {}
    )
    analysis = step.lower(state, batch).compile(compiler_options=options).memory_analysis()
    return int(
        analysis.argument_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )


def _features(config, plan, tokens, assumptions) -> tuple[float, np.ndarray]:
    raw = structural_terms(config, plan, tokens, assumptions)
    exact = sum(raw[name] for name in EXACT_TERMS)
    fitted = np.array([raw[name] for name in FITTED_TERMS] + [1.0])
    return exact, fitted


def fit_calibration(samples: Sequence[tuple[Qwen35MoeConfig, CalibrationPoint, int]]) -> Calibration:
    """Non-negative least squares of measured bytes - exact terms on the fitted terms, each row
    weighted by 1 / measured (so relative errors count equally)."""
    import jax
    from scipy.optimize import nnls

    rows, targets = [], []
    for config, point, measured in samples:
        exact, fitted = _features(config, point.plan, point.tokens, cpu_assumptions(point.rows))
        rows.append(fitted / measured)
        targets.append((measured - exact) / measured)
    coefficients, _ = nnls(np.asarray(rows), np.asarray(targets))
    activation, dispatch, ragged, saved, attention, mask, logits, residue = (float(c) for c in coefficients)
    return Calibration(
        activation=activation,
        dispatch=dispatch,
        ragged=ragged,
        saved=saved,
        attention=attention,
        mask=mask,
        logits=logits,
        residue_bytes=residue,
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        points=tuple((p.name, p.tokens, m) for _, p, m in samples),
    )


_RECURRENT_ONLY = (LINEAR_ATTENTION,) * 4

CALIBRATION_POINTS = (
    CalibrationPoint("tiny T=256", 256),
    CalibrationPoint("tiny T=512", 512),
    CalibrationPoint("tiny T=1024", 1024),
    CalibrationPoint("tiny T=2048", 2048),  # dense attention scores dominate: T^2 terms pinned
    CalibrationPoint("vocab 8192 T=512", 512, (("vocab_size", 8192),)),
    CalibrationPoint("16 experts T=512", 512, (("num_experts", 16),)),
    CalibrationPoint("8 layers T=512", 512, (("num_hidden_layers", 8),)),
    CalibrationPoint("expert 2 T=512", 512, plan=ShardingPlan(expert=2)),
    CalibrationPoint("expert 4 T=256", 256, plan=ShardingPlan(expert=4)),
    CalibrationPoint("no remat T=256", 256, plan=ShardingPlan(remat="none")),
    CalibrationPoint("8 heads T=512", 512, (("num_attention_heads", 8),)),
    CalibrationPoint("tiny context 2 T=512", 512, plan=ShardingPlan(context=2)),
    CalibrationPoint("tiny context 4 T=2048", 2048, plan=ShardingPlan(context=4)),
    CalibrationPoint(
        "recurrent only context 2 T=1024",
        1024,
        (("layer_types", _RECURRENT_ONLY), ("vocab_size", 512)),
        plan=ShardingPlan(context=2),
    ),
    # Recurrent layers only and a small vocabulary: the layer working set dominates.
    CalibrationPoint("recurrent only T=1024", 1024, (("layer_types", _RECURRENT_ONLY), ("vocab_size", 512))),
    CalibrationPoint(
        "recurrent only wide heads T=512",
        512,
        (
            ("layer_types", _RECURRENT_ONLY),
            ("vocab_size", 512),
            ("linear_num_value_heads", 8),
            ("linear_value_head_dim", 32),
        ),
    ),
    CalibrationPoint(
        "no remat 8 layers T=256", 256, (("num_hidden_layers", 8),), plan=ShardingPlan(remat="none")
    ),
)

VALIDATION_POINTS = (
    CalibrationPoint("tiny T=768", 768),
    CalibrationPoint(
        "recurrent only hidden 128 T=768",
        768,
        (("layer_types", _RECURRENT_ONLY), ("vocab_size", 512), ("hidden_size", 128)),
    ),
    CalibrationPoint("hidden 128 T=512", 512, (("hidden_size", 128),)),
    CalibrationPoint("tiny context 2 T=1024", 1024, plan=ShardingPlan(context=2)),
    CalibrationPoint("tiny context 4 T=1024", 1024, plan=ShardingPlan(context=4)),
    CalibrationPoint("tiny fsdp 2 expert 2 T=512", 512, plan=ShardingPlan(fsdp=2, expert=2)),
    CalibrationPoint("tiny no remat T=512", 512, plan=ShardingPlan(remat="none")),
)


def calibrate(base: Qwen35MoeConfig, points: Sequence[CalibrationPoint] = CALIBRATION_POINTS, log=print):
    samples = []
    for point in points:
        config = point.config(base)
        measured = measure(config, point.plan, point.tokens, cpu_assumptions(point.rows))
        log(f"measured {point.name}: {measured / 2**20:.1f} MiB")
        samples.append((config, point, measured))
    return fit_calibration(samples)


def validate(
    base: Qwen35MoeConfig, calibration: Calibration, points: Sequence[CalibrationPoint] = VALIDATION_POINTS
) -> list[tuple[str, int, float, float]]:
    """(name, XLA bytes, predicted bytes, relative error) for each point."""
    out = []
    for point in points:
        config = point.config(base)
        assumptions = cpu_assumptions(point.rows)
        measured = measure(config, point.plan, point.tokens, assumptions)
        predicted = estimate(
            config, point.plan, point.tokens, assumptions=assumptions, calibration=calibration
        )
        out.append((point.name, measured, predicted.total, predicted.total / measured - 1.0))
    return out
