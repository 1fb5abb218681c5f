"""A per-device memory model of the learner under a sharding plan (paper §7.1, Eq. 21), for the
sharding and the programs t1jax actually runs, calibrated against XLA's own memory analysis of
those programs (the learner's `actor_grad` / `critic_grad`, `t1jax.rl.learner.learner_programs`).

What the learner holds on the trainer devices (`t1jax.rl.learner.Learner`, one RL step):
both networks' parameters, float32 master copies and Adam moments (co-resident, as the learner
keeps them; the paper instead offloads the idle network, so that "each must fit alone": the
``residency`` assumption), the ``ppo.retained_versions`` published actor versions (Eq. 26's
behaviour policy), and a float32 gradient accumulator. The two gradient programs run one after
the other (critic first), so the peak is that of the larger one on top of what is resident:

    b(plan, T) = max over role in (actor, critic) of
                 weights + gradients + optimizer + other_network + retained          (exact)
               + batch + boundary                                                      (exact)
               + c_act layer + c_moe dispatch + c_saved saved
               + c_attn attention_scores + c_mask attention_mask + c_block attention_blocks
               + c_logit logits + c_scan scan_copy                                     (fitted)
               + residue                                                                 (<= M)

Terms, per device, for ``rows`` sequences of T tokens per batch shard (``n = rows * T / context``
tokens on a device; the terminal stage when a pipeline degree is given):

- ``weights``: the running network's parameters x bytes(param_dtype) / their shard count under
  the plan's logical rules (experts over ``expert``, embed over ``fsdp``, heads / intermediates /
  vocab over ``tensor``; replicated over data and context).
- ``gradients``: the program's gradient in param_dtype (parameter sharding), its float32 cast
  (the program's output, in the optimizer sharding, as the learner constrains it) and, with
  accumulation, the float32 accumulator of the earlier micro-batches (same sharding).
- ``optimizer``: the running network's Adam moments (2 x float32) and, when param_dtype is not
  float32, its float32 master copy, split over every mesh axis the parameter is replicated on (a
  distributed optimizer): for experts this divides by the whole device count, the
  plan-invariance of Proposition 7.1.
- ``other_network``: co-resident only: the idle network's parameters, master and moments.
- ``retained``: co-resident only: ``retained_versions`` copies of the actor's parameters.
- ``batch``: the step's per-token inputs (ids, masks, advantages, replayed routing [L, k]).
- ``boundary``: the layer inputs layer remat keeps for the backward, n x hidden x (L + 1), and the
  chunked head's per-token residuals (log-sum-exp).
- ``scan_copy``: with ``scan_layers``, the decoder's parameters stacked for the scan and their
  stacked gradient (param_dtype each; fitted: XLA:CPU keeps almost none of it, slicing the
  stacked operand back into its per-layer arguments).
- ``layer``: the working set of one decoder layer's recomputed forward and backward, from the
  structural widths per token of the Gated DeltaNet mixer (projections, conv, q/k/v, the chunk
  terms of the delta rule), of full attention (q/gate/k/v; blockwise: the float32 dQ and the
  log-sum-exp; with context parallelism the gathered K/V and their float32 gradients) and of the
  MoE's per-token part (router, gates, combine, shared expert). Head-indexed widths divide by the
  tensor degree when it divides the head count.
- ``dispatch``: the MoE's dispatched rows and their expert intermediates: k rows per token, or
  with expert parallelism the worst-case receive buffer eta * min(k, E / eta) rows per token
  (no token is ever dropped), plus the padded collective's blocks where it is used.
- ``saved``: without remat, every layer's residuals kept for the backward.
- ``attention_scores`` / ``attention_mask``: dense attention only: the [T / context, T] float32
  score block per local head and its mask per row (one layer with remat, all attention layers
  without).
- ``attention_blocks``: blockwise attention only: one [block_q, block_k] block of scores,
  probabilities and their two gradients per local head (no [T, T] term at all).
- ``logits``: the actor's head: one chunk of the chunked log-probabilities, (n / chunks) x |V| /
  tensor float32 (``t1jax.ops.cross_entropy``; the paper's 4|V|T/kappa term divided by the chunk
  count). The head and a decoder layer peak at different moments of the backward pass, so the
  estimate charges max(head, layer phase): this term reports what the head adds beyond the layer
  phase (``layer`` + ``dispatch`` + the attention terms; often 0). The critic has no head.
- ``residue``: b0 (calibrated) plus ``residue_fraction`` x M for allocator fragmentation on the
  device (0 when comparing with XLA's analysis, which has none).

Calibration: the eight c's and b0 are fitted (non-negative least squares) to
``compiled.memory_analysis()`` of the learner's two gradient programs on the tiny model at
several token counts, vocabularies, expert counts, depths and plans (``t1jax.tools.lowering``:
``calibrate``); ``validate`` compares predictions with fresh compilations of other configurations,
T = 8192 among them. A compiled program holds its arguments, temporaries and outputs: the
``program_terms`` of its role; the resident extras (optimizer, other network, retained versions,
accumulator) are exact shapes and are added on top. A calibration records its backend: XLA:CPU's
numbers reflect its fusion and buffer-reuse decisions (and the MoE's tiled grouped matmul,
``t1jax.ops.grouped_matmul``); a TPU calibration (the same code on a TPU host) replaces them. On
CPU the programs are compiled with XLA:CPU's memory-optimised scheduler (the default one
optimises for concurrency and recomputes every remat'd layer up front, which accelerators'
memory-aware schedulers do not do).

Assumptions, stated once: Adam; float32 moments; a float32 master copy iff param_dtype is not
float32; all gradients live at the program's peak; layer remat per plan; the execution settings
(attention kernel, head chunking, layer scan) of the model preset.
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
from t1jax.model.execution import ExecutionConfig
from t1jax.ops.cross_entropy import num_chunks_for
from t1jax.parallel.plan import MESH_AXES, ShardingPlan

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# package data (pyproject.toml): the fit `t1jax plan --calibrate` writes and `default_calibration` reads
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "calibration" / "cpu_tiny.json"
ROLES = ("actor", "critic")
ATTENTION = ("dense", "blockwise")
RESIDENCY = ("co-resident", "offload")
PLATFORMS = ("tpu", "gpu", "cpu")
# Terms computed exactly from shapes, and terms scaled by a calibrated coefficient (in the order
# of `fit_calibration`'s unknowns; the residue b0 is the last unknown). PROGRAM_EXACT_TERMS are
# what a compiled gradient program itself holds; RESIDENT_TERMS live beside it.
PROGRAM_EXACT_TERMS = ("weights", "gradients", "batch", "boundary")
RESIDENT_TERMS = ("optimizer", "other_network", "retained")
EXACT_TERMS = (*PROGRAM_EXACT_TERMS, *RESIDENT_TERMS)
FITTED_TERMS = (
    "layer",
    "dispatch",
    "saved",
    "attention_scores",
    "attention_mask",
    "attention_blocks",
    "logits",
    "scan_copy",
)
TERMS = (*EXACT_TERMS, *FITTED_TERMS, "residue")


# --------------------------------------------------------------------------------------------------
# assumptions and calibration
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryAssumptions:
    """What a step keeps, beyond the plan. ``platform``: the backend the step runs on ("cpu"
    has no ragged all-to-all, so the "auto" MoE collective is the padded one there);
    ``attention``: "blockwise" (t1jax's default kernel, and the
    memory of the splash kernel) or "dense"; ``residency``: "co-resident" (both networks'
    state on the devices, as `Learner` holds it) or "offload" (only the running network's,
    the paper's forced offload); ``retained_versions``: published actor versions kept for the
    behaviour policy (co-resident only); ``accumulate``: a float32 gradient accumulator across
    micro-batches; ``logits_chunk`` / ``scan_layers`` / block sizes: the model's execution."""

    param_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"
    platform: str = "tpu"
    attention: str = "blockwise"
    rows: int = 1
    residue_fraction: float = 0.03
    chunk_size: int = 64
    attention_block_q: int = 512
    attention_block_k: int = 512
    logits_chunk: int = 1024
    scan_layers: bool = False
    residency: str = "co-resident"
    retained_versions: int = 2
    accumulate: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {sorted(DTYPE_BYTES)}, got {getattr(self, name)!r}")
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.residency not in RESIDENCY:
            raise ValueError(f"residency must be one of {RESIDENCY}, got {self.residency!r}")
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if self.retained_versions < 0:
            raise ValueError(f"retained_versions must be >= 0, got {self.retained_versions}")

    @property
    def master_weights(self) -> bool:
        return self.param_dtype != "float32"

    def with_execution(self, execution: ExecutionConfig) -> MemoryAssumptions:
        """These assumptions with the attention kernel, blocks, head chunking and layer scan of
        a model's `ExecutionConfig` (the splash kernel's memory is the blockwise one's)."""
        return dataclasses.replace(
            self,
            attention="dense" if execution.attention == "dense" else "blockwise",
            attention_block_q=execution.attention_block_q,
            attention_block_k=execution.attention_block_k,
            logits_chunk=execution.logits_chunk,
            scan_layers=execution.scan_layers,
        )

    def execution(self) -> ExecutionConfig:
        """The `ExecutionConfig` a compiled program must use to match these assumptions."""
        return ExecutionConfig(
            attention=self.attention,
            attention_block_q=self.attention_block_q,
            attention_block_k=self.attention_block_k,
            logits_chunk=self.logits_chunk,
            scan_layers=self.scan_layers,
        )


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Fitted multiplicities (bytes XLA allocates per byte of each structural term) and b0."""

    activation: float
    dispatch: float
    saved: float
    attention: float
    mask: float
    blocks: float
    logits: float
    residue_bytes: float
    scan: float = 1.0
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

    def coefficients(self) -> dict[str, float]:
        """Fitted term name -> its multiplicity."""
        values = (self.activation, self.dispatch, self.saved, self.attention, self.mask, self.blocks)
        scale = dict(zip(FITTED_TERMS, (*values, self.logits, self.scan), strict=True))
        return scale | {"layer_attention": self.activation}


def default_calibration() -> Calibration:
    """The stored calibration of the tiny model (``DEFAULT_CALIBRATION``)."""
    return Calibration.load(DEFAULT_CALIBRATION)


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
def parameter_inventory(config: Qwen35MoeConfig, role: str = "actor") -> tuple[ParameterGroup, ...]:
    """The parameters of the actor (LM head) or the critic (value head), grouped by (shape,
    logical axes), from an abstract model with one layer of each type (layers of one type are
    identical), multiplied by the layer counts."""
    import jax.numpy as jnp

    from t1jax.model.axes import logical_axes
    from t1jax.model.critic import Qwen35MoeCritic
    from t1jax.model.params import abstract_params
    from t1jax.model.transformer import Qwen35MoeForCausalLM

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    types = [t for t in (LINEAR_ATTENTION, FULL_ATTENTION) if t in config.layer_types]
    probe = config.replace(num_hidden_layers=len(types), layer_types=tuple(types))
    build = Qwen35MoeForCausalLM if role == "actor" else Qwen35MoeCritic
    from flax import nnx

    with abstract_params():
        model = build(probe, dtype=jnp.float32)
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


def parameter_counts(config: Qwen35MoeConfig, role: str = "actor") -> tuple[int, int]:
    """(Pe, Pd): routed-expert and all other parameters."""
    expert = dense = 0
    for group in parameter_inventory(config, role):
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


@dataclasses.dataclass(frozen=True)
class ShardSizes:
    """Elements per device of one network: all parameters under the parameter sharding, under
    the optimizer sharding, and the decoder layers' parameters (what the layer scan stacks)."""

    params: int
    optimizer: int
    layers: int


def group_shard_sizes(
    config: Qwen35MoeConfig, plan: ShardingPlan, role: str = "actor"
) -> list[tuple[ParameterGroup, int, int]]:
    """Per parameter group: (group, elements per device under the parameter sharding, under the
    optimizer sharding), for one pipeline stage's share of the layers (the terminal stage)."""
    from jax.sharding import NamedSharding

    from t1jax.model.axes import resolve_spec
    from t1jax.parallel.plan import distributed_spec, plan_rules

    mesh = _abstract_mesh(plan)
    rules = plan_rules(plan)
    out = []
    for group in parameter_inventory(config, role):
        count = group.count
        if group.layer_type is not None:
            count = math.ceil(count / plan.pipeline)
        spec = resolve_spec(group.axes, group.shape, mesh, rules)
        local = math.prod(NamedSharding(mesh, spec).shard_shape(group.shape))
        opt_spec = distributed_spec(spec, group.shape, mesh)
        opt_local = math.prod(NamedSharding(mesh, opt_spec).shard_shape(group.shape))
        out.append((group, local * count, opt_local * count))
    return out


@functools.cache
def shard_sizes(config: Qwen35MoeConfig, plan: ShardingPlan, role: str = "actor") -> ShardSizes:
    """Per-device element counts of ``role``'s parameters (``group_shard_sizes`` summed)."""
    params = optimizer = layers = 0
    for group, local, opt_local in group_shard_sizes(config, plan, role):
        params += local
        optimizer += opt_local
        if group.layer_type is not None:
            layers += local
    return ShardSizes(params, optimizer, layers)


def _divides(count: int, degree: int) -> int:
    """The factor a dimension of ``count`` is split by: ``degree`` if it divides, else 1."""
    return degree if degree > 1 and count % degree == 0 else 1


def program_terms(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    assumptions: MemoryAssumptions,
    role: str = "actor",
) -> dict[str, float]:
    """The uncalibrated terms, in bytes per device, of ``role``'s gradient program alone (its
    arguments, temporaries and outputs; see the module docstring)."""
    rows, context = assumptions.rows, plan.context
    local_tokens = rows * tokens / context
    compute = DTYPE_BYTES[assumptions.compute_dtype]
    param_bytes = DTYPE_BYTES[assumptions.param_dtype]
    f32 = 4
    sizes = shard_sizes(config, plan, role)
    weights = sizes.params * param_bytes
    # The program's gradient in param_dtype (parameter sharding), then its float32 cast in the
    # optimizer sharding (the output).
    gradients = sizes.params * param_bytes + sizes.optimizer * f32
    scan_copy = 2 * sizes.layers * param_bytes if assumptions.scan_layers else 0.0

    layers_here = [config.layer_types[i] for i in range(config.num_hidden_layers)]
    layers_here = layers_here[len(layers_here) - math.ceil(len(layers_here) / plan.pipeline) :]
    hidden = config.hidden_size
    tau = plan.tensor
    blockwise = assumptions.attention == "blockwise"

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
    if blockwise:  # the float32 dQ accumulator and the log-sum-exp of every query row
        attention += heads * head_dim * f32 + heads * f32
    if context > 1:  # K/V of the whole row gathered, then reordered (and blockwise: their grads)
        attention += 2 * 2 * kv_heads * head_dim * compute * context
        if blockwise:
            attention += 2 * kv_heads * head_dim * f32 * context
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
    # "auto" is the ragged all-to-all except on CPU (which has none): padded there.
    padded = plan.moe_collective == "padded" or (
        plan.moe_collective == "auto" and assumptions.platform == "cpu"
    )
    if eta > 1 and padded:
        dispatch += 2 * rows_per_token * hidden * compute

    per_type = {LINEAR_ATTENTION: gdn + moe, FULL_ATTENTION: attention + moe}
    attention_layers = sum(1 for t in layers_here if t == FULL_ATTENTION)
    # One layer's working set is live in either mode (the backward of the layer being processed):
    # a Gated DeltaNet layer's or an attention layer's, whichever is larger (``calibrated``).
    layer = local_tokens * per_type[LINEAR_ATTENTION] if LINEAR_ATTENTION in layers_here else 0.0
    layer_attention = local_tokens * per_type[FULL_ATTENTION] if attention_layers else 0.0
    dispatch_bytes = local_tokens * dispatch
    if plan.remat == "layer":
        boundary = local_tokens * (len(layers_here) + 1) * hidden * compute
        saved = 0.0
        live_attention = min(1, attention_layers)
    else:  # every layer's residuals are kept for the backward (dense attention: its probabilities)
        boundary = local_tokens * hidden * compute
        saved = local_tokens * sum(per_type[t] + dispatch for t in layers_here)
        live_attention = attention_layers if assumptions.attention == "dense" else min(1, attention_layers)
    scores = mask = blocks = 0.0
    query_rows = tokens / context
    if assumptions.attention == "dense":
        # Per local head a float32 [T / context, T] score block; per row one mask (shared by heads).
        pairs = live_attention * rows * query_rows * tokens
        scores = pairs * heads * f32
        mask = pairs * f32
    elif live_attention:
        # Scores, probabilities and their two gradients of one [block_q, block_k] block per head.
        block_q = min(assumptions.attention_block_q, query_rows)
        block_k = min(assumptions.attention_block_k, tokens)
        blocks = live_attention * 4 * rows * heads * block_q * block_k * f32
    logits = 0.0
    if role == "actor":
        vocab = config.vocab_size / _divides(config.vocab_size, tau)
        chunks = num_chunks_for(tokens, assumptions.logits_chunk)
        logits = local_tokens / chunks * vocab * f32
        boundary += local_tokens * 2 * f32  # per-token log-sum-exp and log-prob of the head
    # Token ids, targets, segment ids, positions, four float32 per-token values, the replayed
    # routing [L, k], and the programs' per-token outputs.
    batch = local_tokens * (8 * 4 + config.num_hidden_layers * top_k * 4)
    return {
        "weights": weights,
        "gradients": gradients,
        "batch": batch,
        "boundary": boundary,
        "scan_copy": scan_copy,
        "layer": layer,
        "layer_attention": layer_attention,
        "dispatch": dispatch_bytes,
        "saved": saved,
        "attention_scores": scores,
        "attention_mask": mask,
        "attention_blocks": blocks,
        "logits": logits,
    }


def resident_terms(
    config: Qwen35MoeConfig, plan: ShardingPlan, assumptions: MemoryAssumptions, role: str = "actor"
) -> dict[str, float]:
    """What lives on the devices beside ``role``'s gradient program, in bytes per device: its
    optimizer state (moments, master), the float32 gradient accumulator and, co-resident, the
    other network's whole state and the retained actor versions."""
    param_bytes = DTYPE_BYTES[assumptions.param_dtype]
    master = 4 if assumptions.master_weights else 0

    def state(sizes: ShardSizes) -> float:
        return sizes.params * param_bytes + sizes.optimizer * (8 + master)

    sizes = shard_sizes(config, plan, role)
    other = "critic" if role == "actor" else "actor"
    co_resident = assumptions.residency == "co-resident"
    actor = shard_sizes(config, plan, "actor")
    return {
        "optimizer": sizes.optimizer * (8 + master),
        "accumulator": sizes.optimizer * 4 if assumptions.accumulate else 0.0,
        "other_network": state(shard_sizes(config, plan, other)) if co_resident else 0.0,
        "retained": assumptions.retained_versions * actor.params * param_bytes if co_resident else 0.0,
    }


def structural_terms(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    assumptions: MemoryAssumptions,
    role: str = "actor",
) -> dict[str, float]:
    """Every uncalibrated term of ``role``'s step, in bytes per device (program + resident; the
    accumulator is part of ``gradients``)."""
    terms = program_terms(config, plan, tokens, assumptions, role)
    resident = resident_terms(config, plan, assumptions, role)
    terms["gradients"] += resident.pop("accumulator")
    return {**terms, **resident}


# --------------------------------------------------------------------------------------------------
# the estimate
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes by term for one plan, for the program that binds (``role``: the larger
    of the actor's and the critic's step); ``roles`` holds both totals; ``budget`` M in bytes
    (None: no verdict)."""

    plan: ShardingPlan
    tokens: int
    terms: dict
    budget: float | None = None
    problems: tuple[str, ...] = ()
    role: str = "actor"
    roles: dict = dataclasses.field(default_factory=dict)

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
            return f"{self.role} step: {name} alone is {self.terms[name] / GIB:.1f} GiB > M"
        over = (self.total - self.budget) / GIB
        return f"{self.role} step over by {over:.1f} GiB; largest term {name} = {share:.0%} of M"


# The backward pass peaks in one place at a time: in a Gated DeltaNet layer (its working set and
# the MoE dispatch), in an attention layer (its working set, its attention terms and the dispatch)
# or in the LM head (one chunk of logits and their gradient).
ATTENTION_TERMS = ("attention_scores", "attention_mask", "attention_blocks")


def _phases(scaled: dict[str, float]) -> tuple[float, float, float]:
    """(Gated DeltaNet layer, attention layer, head) working sets from scaled terms."""
    linear = scaled.get("layer", 0.0)
    attention = scaled.get("layer_attention", 0.0) + sum(scaled.get(name, 0.0) for name in ATTENTION_TERMS)
    return linear, attention, scaled.get("logits", 0.0)


def calibrated(terms: dict[str, float], calibration: Calibration) -> dict[str, float]:
    """Structural terms with the fitted ones scaled by the calibration (no residue), and the peak
    phase resolved so that the terms add up to the peak: ``layer`` is the binding layer type's
    working set (the attention terms count only when an attention layer binds), and ``logits`` is
    what the head's chunk needs beyond that layer phase (often 0)."""
    scale = calibration.coefficients()
    scaled = {name: value * scale.get(name, 1.0) for name, value in terms.items()}
    linear, attention, head = _phases(scaled)
    out = {name: value for name, value in scaled.items() if name != "layer_attention"}
    if "layer_attention" in scaled:
        if attention >= linear:
            out["layer"] = scaled["layer_attention"]
        else:
            out.update({name: 0.0 for name in ATTENTION_TERMS})
    layer_phase = max(linear, attention) + scaled.get("dispatch", 0.0)
    if "logits" in out:
        out["logits"] = max(0.0, head - layer_phase)
    return out


def estimate(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    *,
    assumptions: MemoryAssumptions = MemoryAssumptions(),
    calibration: Calibration | None = None,
    budget_bytes: float | None = None,
    roles: Sequence[str] = ROLES,
) -> MemoryEstimate:
    """The learner's per-device bytes for ``plan`` at a token wall of ``tokens``: the larger of
    the ``roles``' steps (each with everything resident beside it)."""
    calibration = default_calibration() if calibration is None else calibration
    residue = calibration.residue_bytes + assumptions.residue_fraction * (budget_bytes or 0.0)
    per_role = {}
    for role in roles:
        terms = calibrated(structural_terms(config, plan, tokens, assumptions, role), calibration)
        per_role[role] = {name: terms[name] for name in TERMS if name != "residue"} | {"residue": residue}
    role = max(per_role, key=lambda r: sum(per_role[r].values()))
    problems = tuple(plan.check_model(config))
    if tokens % (2 * plan.context):
        problems += (f"{tokens} tokens do not split into 2 x context = {2 * plan.context} chunks",)
    elif plan.context > 1 and (tokens // plan.context) % assumptions.chunk_size:
        problems += (
            f"T / context = {tokens // plan.context} is not a multiple of the delta-rule chunk "
            f"({assumptions.chunk_size})",
        )
    return MemoryEstimate(
        plan=plan,
        tokens=tokens,
        terms=per_role[role],
        budget=budget_bytes,
        problems=problems,
        role=role,
        roles={r: float(sum(t.values())) for r, t in per_role.items()},
    )


def program_estimate(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    assumptions: MemoryAssumptions,
    calibration: Calibration,
    role: str = "actor",
) -> float:
    """Predicted bytes of ``role``'s compiled gradient program alone (what XLA's memory analysis
    of that program reports): its program terms, calibrated, plus b0."""
    terms = calibrated(program_terms(config, plan, tokens, assumptions, role), calibration)
    return float(sum(terms.values()) + calibration.residue_bytes)


def padded_tokens(tokens: int, plan: ShardingPlan, chunk_size: int = 64) -> int:
    """The smallest length >= ``tokens`` the plan can run: a multiple of context x chunk."""
    if plan.context == 1:
        return tokens
    unit = plan.context * chunk_size
    return math.ceil(tokens / unit) * unit


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
# fitting to XLA's memory analysis (the measurements themselves: t1jax.tools.lowering)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CalibrationPoint:
    """One compiled gradient program: a config override of the tiny model, a plan, a token
    count, and overrides of the CPU assumptions (attention kernel, head chunking, ...)."""

    name: str
    tokens: int
    overrides: tuple = ()  # ((field, value), ...) applied to the base config
    plan: ShardingPlan = ShardingPlan()
    rows: int = 1
    assumption_overrides: tuple = ()  # ((field, value), ...) applied to cpu_assumptions()

    def config(self, base: Qwen35MoeConfig) -> Qwen35MoeConfig:
        return base.replace(**dict(self.overrides)) if self.overrides else base

    def assumptions(self) -> MemoryAssumptions:
        return dataclasses.replace(cpu_assumptions(self.rows), **dict(self.assumption_overrides))


def cpu_assumptions(rows: int = 1) -> MemoryAssumptions:
    """What the CPU calibration compiles: float32 everywhere, the blockwise kernel with the
    default blocks, no fragmentation allowance."""
    return MemoryAssumptions(
        param_dtype="float32",
        compute_dtype="float32",
        platform="cpu",
        rows=rows,
        residue_fraction=0.0,
    )


def fit_calibration(
    samples: Sequence[tuple[Qwen35MoeConfig, CalibrationPoint, str, int]], *, backend: str, jax_version: str
) -> Calibration:
    """Least squares, with non-negative coefficients, of the relative error of the predicted
    program bytes (exact terms + fitted terms with the peak phase as a max, see ``calibrated``,
    + b0) over (config, point, role, measured bytes) samples (started from an additive NNLS)."""
    from scipy.optimize import least_squares, nnls

    features, exact, measured = [], [], []
    for config, point, role, nbytes in samples:
        raw = program_terms(config, point.plan, point.tokens, point.assumptions(), role)
        exact.append(sum(raw[name] for name in PROGRAM_EXACT_TERMS))
        features.append([raw[name] for name in FITTED_TERMS] + [1.0, raw["layer_attention"]])
        measured.append(nbytes)
    features, exact, measured = np.asarray(features), np.asarray(exact), np.asarray(measured, float)
    names = (*FITTED_TERMS, "residue")
    index = {name: names.index(name) for name in names}
    additive = [index[name] for name in ("saved", "scan_copy", "residue")]
    attention_extras = [index[name] for name in ATTENTION_TERMS]

    def predicted(c):
        scaled = features[:, : len(names)] * c
        linear = scaled[:, index["layer"]]
        attention = features[:, -1] * c[index["layer"]] + scaled[:, attention_extras].sum(1)
        layer_phase = np.maximum(linear, attention) + scaled[:, index["dispatch"]]
        return exact + scaled[:, additive].sum(1) + np.maximum(scaled[:, index["logits"]], layer_phase)

    additive_model = features[:, : len(names)].copy()
    additive_model[:, index["layer"]] = np.maximum(features[:, index["layer"]], features[:, -1])
    start, _ = nnls(additive_model / measured[:, None], (measured - exact) / measured)
    # The maxima are flat in a coefficient wherever another phase wins: start the head's
    # coefficient at several values so the fit can find where the head binds.
    fits = []
    for head_start in (start[index["logits"]], 1.0, 2.0, 4.0):
        guess = start.copy()
        guess[index["logits"]] = head_start
        fits.append(least_squares(lambda c: predicted(c) / measured - 1.0, guess, bounds=(0.0, np.inf)))
    fit = min(fits, key=lambda f: f.cost)
    activation, dispatch, saved, attention, mask, blocks, logits, scan, residue = (float(c) for c in fit.x)
    return Calibration(
        scan=scan,
        activation=activation,
        dispatch=dispatch,
        blocks=blocks,
        saved=saved,
        attention=attention,
        mask=mask,
        logits=logits,
        residue_bytes=residue,
        backend=backend,
        jax_version=jax_version,
        points=tuple((f"{p.name} ({role})", p.tokens, m) for _, p, role, m in samples),
    )
