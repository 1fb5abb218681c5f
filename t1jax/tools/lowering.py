"""Lowering and compiling the learner's own programs without running them: on an abstract
production mesh (proof, without the hardware, that a plan's shardings are consistent for the
programs `Learner.step` runs), and on the CPU mesh for the capacity model's calibration.

``learner_program_args(config, plan, tokens)`` builds the abstract actor and critic (no parameter
is allocated), the plan's mesh (``AbstractMesh`` or a real one), the programs of
``t1jax.rl.learner.learner_programs`` and abstract arguments carrying the shardings the learner
gives them (parameters by the plan's logical rules, the batch rows over the batch axes and the
sequence over context). ``lower_learner_programs`` traces and lowers them for a platform (TPU by
default: its ragged_dot and ragged all-to-all), reporting the time each took; compiling a
256-device TPU program needs the TPU backend, so that stops at StableHLO.

``lower_sampler_step`` does the same for the embedded sampler's decode step (one token for every
slot of a ``max_batch`` x ``max_context`` cache, then sampling) on an abstract mesh of the sampler
share, with the engine's own parameter and cache placement (``t1jax.rollout.engine``).
``lowering_for_tpu`` (``t1jax.ops.pallas``) is in force while tracing for TPU, so a config's Pallas
kernels are lowered as Mosaic calls, as they would be on the pod.

``measure`` compiles one gradient program on the local devices and reads XLA's memory analysis
(arguments + temporaries + outputs that do not alias a donated argument); ``calibrate`` fits the
capacity model's coefficients to such measurements of both roles over ``CALIBRATION_POINTS``
and ``validate`` compares its predictions with fresh compilations (``VALIDATION_POINTS``, T up to
8192). This module sits above ``rl`` because it builds the learner's programs;
``t1jax.parallel.capacity`` holds only the arithmetic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from t1jax.model.config import LINEAR_ATTENTION, Qwen35MoeConfig
from t1jax.model.execution import DEFAULT_EXECUTION, ExecutionConfig
from t1jax.parallel import capacity
from t1jax.parallel.capacity import CalibrationPoint
from t1jax.parallel.plan import ShardingPlan, abstract_mesh, batch_sharding, make_mesh, plan_rules

__all__ = [
    "CALIBRATION_POINTS",
    "VALIDATION_POINTS",
    "LoweringReport",
    "calibrate",
    "learner_program_args",
    "lower_learner_programs",
    "lower_sampler_step",
    "measure",
    "validate",
]

GRADIENT_PROGRAMS = ("actor_grad", "critic_grad")


@dataclasses.dataclass(frozen=True)
class LoweringReport:
    program: str
    plan: ShardingPlan
    tokens: int
    rows: int
    parameters: int
    arguments: int  # arrays passed to the program
    seconds_trace: float
    seconds_lower: float
    hlo_chars: int
    platform: str
    lowered: object = dataclasses.field(repr=False, default=None)
    argument_bytes_per_device: int = 0  # the arguments' shards on one device (weights, cache, batch)


def learner_program_args(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    *,
    rows: int = 1,
    mesh=None,
    rl_config=None,
    param_dtype=jnp.bfloat16,
    compute_dtype=jnp.bfloat16,
    execution: ExecutionConfig = DEFAULT_EXECUTION,
) -> tuple[object, dict[str, tuple[Callable, tuple, int]]]:
    """(mesh, {program name: (jitted program, abstract arguments, parameter count)}) for the
    learner's gradient programs under ``plan``: one micro-batch of ``rows`` sequences of
    ``tokens`` per batch shard. ``mesh`` defaults to the plan's ``AbstractMesh``."""
    from t1jax.model.critic import Qwen35MoeCritic
    from t1jax.model.params import abstract_params
    from t1jax.model.transformer import Qwen35MoeForCausalLM
    from t1jax.parallel.rules import state_shardings
    from t1jax.rl.batching import TrainBatch
    from t1jax.rl.config import RLConfig
    from t1jax.rl.learner import learner_programs

    rl_config = RLConfig() if rl_config is None else rl_config
    mesh = abstract_mesh(plan) if mesh is None else mesh
    rules = plan_rules(plan)
    with abstract_params():
        kwargs = dict(dtype=compute_dtype, param_dtype=param_dtype, execution=execution)
        actor = Qwen35MoeForCausalLM(config, **kwargs)
        critic = Qwen35MoeCritic(config, **kwargs)

    def placed(module):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        shardings = state_shardings(params, mesh, rules)
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
        )
        return graphdef, params, rest

    (actor_graphdef, actor_params, actor_rest), (critic_graphdef, critic_params, critic_rest) = (
        placed(actor),
        placed(critic),
    )
    programs = learner_programs(actor_graphdef, critic_graphdef, rl_config, mesh, plan)
    shape = (rows * plan.batch_shards, tokens)
    routing_shape = (*shape, config.num_hidden_layers, config.num_experts_per_tok)

    def spec(shape_, dtype):
        return jax.ShapeDtypeStruct(shape_, dtype, sharding=batch_sharding(mesh, plan, shape_))

    batch = TrainBatch(
        input_ids=spec(shape, jnp.int32),
        target_ids=spec(shape, jnp.int32),
        action_mask=spec(shape, jnp.float32),
        sampler_logprobs=spec(shape, jnp.float32),
        rewards=spec(shape, jnp.float32),
        segment_ids=spec(shape, jnp.int32),
        positions=spec(shape, jnp.int32),
        routing=spec(routing_shape, jnp.int32),
    )
    per_token = spec(shape, jnp.float32)
    count = jax.ShapeDtypeStruct((), jnp.float32)

    def size(params):
        return sum(x.size for x in jax.tree.leaves(params))

    calls = {
        "actor_grad": (
            programs.actor_grad,
            (actor_params, actor_rest, batch, per_token, per_token, count, True),
            size(actor_params),
        ),
        "critic_grad": (
            programs.critic_grad,
            (critic_params, critic_rest, batch, per_token, per_token, count),
            size(critic_params),
        ),
    }
    return mesh, calls


def _mesh_scope(mesh):
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return jax.sharding.use_abstract_mesh(mesh)
    return jax.set_mesh(mesh)


def _kernel_scope(platform: str):
    from t1jax.ops.pallas import lowering_for_tpu

    return lowering_for_tpu() if platform == "tpu" else contextlib.nullcontext()


def argument_bytes_per_device(args) -> int:
    """Bytes of one device's shards of the abstract arguments (by each one's sharding)."""
    total = 0
    for leaf in jax.tree.leaves(args):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            continue
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return int(total)


def _lower(name, program, args, *, mesh, platform, report):
    """Trace and lower one program; ``report(seconds_trace, seconds_lower, lowered)`` builds the
    report (with the arguments' per-device bytes filled in)."""
    with _mesh_scope(mesh), _kernel_scope(platform):
        start = time.perf_counter()
        traced = program.trace(*args)
        traced_at = time.perf_counter()
        lowered = traced.lower(lowering_platforms=(platform,))
        lowered_at = time.perf_counter()
    built = report(traced_at - start, lowered_at - traced_at, lowered)
    return dataclasses.replace(built, argument_bytes_per_device=argument_bytes_per_device(args))


def lower_learner_programs(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    *,
    rows: int = 1,
    programs: Sequence[str] = GRADIENT_PROGRAMS,
    platform: str = "tpu",
    **kwargs,
) -> dict[str, LoweringReport]:
    """Trace and lower the learner's gradient programs on the plan's abstract mesh for
    ``platform`` (keyword arguments as ``learner_program_args``)."""
    mesh, calls = learner_program_args(config, plan, tokens, rows=rows, **kwargs)
    reports = {}
    for name in programs:
        program, args, parameters = calls[name]
        reports[name] = _lower(
            name,
            program,
            args,
            mesh=mesh,
            platform=platform,
            report=lambda trace, lower, lowered, name=name, args=args, parameters=parameters: LoweringReport(
                program=name,
                plan=plan,
                tokens=tokens,
                rows=rows,
                parameters=parameters,
                arguments=len(jax.tree.leaves(args)),
                seconds_trace=trace,
                seconds_lower=lower,
                hlo_chars=len(lowered.as_text()),
                platform=platform,
                lowered=lowered,
            ),
        )
    return reports


def lower_sampler_step(
    config: Qwen35MoeConfig,
    mesh_shape: dict[str, int],
    *,
    max_batch: int,
    max_context: int,
    kv_chunk: int = 256,
    param_dtype=jnp.bfloat16,
    compute_dtype=jnp.bfloat16,
    platform: str = "tpu",
) -> LoweringReport:
    """Trace and lower the embedded sampler's decode step (module docstring) on an abstract mesh
    of ``mesh_shape`` (axis sizes over the sampler share; the sampler never splits sequences)."""
    from t1jax.model.cache import init_cache
    from t1jax.model.params import abstract_params
    from t1jax.model.transformer import Qwen35MoeForCausalLM
    from t1jax.parallel.rules import DEFAULT_RULES, MESH_AXES, state_shardings
    from t1jax.rollout.engine import cache_shardings
    from t1jax.rollout.sampling import sample

    unknown = sorted(set(mesh_shape) - set(MESH_AXES))
    if unknown or mesh_shape.get("context", 1) != 1:
        raise ValueError(f"sampler mesh {mesh_shape}: axes must be among {MESH_AXES}, context 1")
    shape = tuple(int(mesh_shape.get(axis, 1)) for axis in MESH_AXES)
    mesh = jax.sharding.AbstractMesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    with abstract_params():
        model = Qwen35MoeForCausalLM(config, dtype=compute_dtype, param_dtype=param_dtype)
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, DEFAULT_RULES)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    cache = jax.eval_shape(lambda: init_cache(config, max_batch, max_context, compute_dtype))
    cache = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        cache,
        cache_shardings(cache, mesh, DEFAULT_RULES),
    )
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def rows(dtype):
        return jax.ShapeDtypeStruct((max_batch,), dtype, sharding=replicated)

    def decode(state, cache, tokens, live, index, temperature, top_k, top_p, seed_low, seed_high):
        out, cache = nnx.merge(graphdef, state).decode_step(tokens, cache, active=live, kv_chunk=kv_chunk)
        token, logprob, _ = sample(out.logits, temperature, top_k, top_p, seed_low, seed_high, index)
        return token, logprob, out.routing, cache

    args = (
        state,
        cache,
        rows(jnp.int32),
        rows(jnp.bool_),
        rows(jnp.int32),
        rows(jnp.float32),
        rows(jnp.int32),
        rows(jnp.float32),
        rows(jnp.uint32),
        rows(jnp.uint32),
    )
    program = jax.jit(decode, donate_argnums=(1,))
    label = " ".join(
        f"{axis[:2] if axis != 'context' else 'cp'}{size}"
        for axis, size in zip(MESH_AXES, shape, strict=True)
    )
    return _lower(
        "sampler_decode",
        program,
        args,
        mesh=mesh,
        platform=platform,
        report=lambda trace, lower, lowered: LoweringReport(
            program="sampler_decode",
            plan=ShardingPlan(**dict(zip(MESH_AXES, shape, strict=True)), name=f"sampler {label}"),
            tokens=max_context,
            rows=max_batch,
            parameters=sum(x.size for x in jax.tree.leaves(state)),
            arguments=len(jax.tree.leaves(args)),
            seconds_trace=trace,
            seconds_lower=lower,
            hlo_chars=len(lowered.as_text()),
            platform=platform,
            lowered=lowered,
        ),
    )


def _compiler_options() -> dict:
    # XLA:CPU's default scheduler optimises for concurrency and recomputes every remat'd layer up
    # front; the memory-optimised one behaves like accelerators' memory-aware schedulers.
    if jax.default_backend() == "cpu":
        return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    return {}


def measure(
    config: Qwen35MoeConfig,
    plan: ShardingPlan,
    tokens: int,
    assumptions: capacity.MemoryAssumptions,
    role: str = "actor",
) -> int:
    """Per-device bytes XLA allocates for ``role``'s gradient program on the local devices
    (``compiled.memory_analysis()``: arguments + temporaries + outputs not aliasing a donated
    argument; compiled, never run)."""
    program_name = {"actor": "actor_grad", "critic": "critic_grad"}[role]
    mesh, calls = learner_program_args(
        config,
        plan,
        tokens,
        rows=assumptions.rows,
        mesh=make_mesh(plan),
        param_dtype=getattr(jnp, assumptions.param_dtype),
        compute_dtype=getattr(jnp, assumptions.compute_dtype),
        execution=assumptions.execution(),
    )
    program, args, _ = calls[program_name]
    with _mesh_scope(mesh):
        compiled = program.trace(*args).lower().compile(compiler_options=_compiler_options())
    analysis = compiled.memory_analysis()
    return int(
        analysis.argument_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )


_RECURRENT_ONLY = (LINEAR_ATTENTION,) * 4
_SMALL_HEAD = (("logits_chunk", 128),)  # the head chunked at the calibration's short lengths
_DENSE = (("attention", "dense"),)

CALIBRATION_POINTS = (
    CalibrationPoint("tiny T=256", 256),
    CalibrationPoint("tiny T=512", 512),
    CalibrationPoint("tiny T=1024", 1024),
    CalibrationPoint("tiny T=2048", 2048),
    CalibrationPoint("tiny T=1024 head chunks", 1024, assumption_overrides=_SMALL_HEAD),
    CalibrationPoint("tiny T=1024 dense attention", 1024, assumption_overrides=_DENSE),
    CalibrationPoint("tiny T=2048 dense attention", 2048, assumption_overrides=_DENSE),
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
    CalibrationPoint(
        "8 layers scanned T=512",
        512,
        (("num_hidden_layers", 8),),
        assumption_overrides=(("scan_layers", True),),
    ),
)

VALIDATION_POINTS = (
    CalibrationPoint("tiny T=768", 768),
    CalibrationPoint("tiny T=8192", 8192),
    CalibrationPoint("tiny context 4 T=8192", 8192, plan=ShardingPlan(context=4)),
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
    CalibrationPoint("tiny dense attention T=768", 768, assumption_overrides=_DENSE),
)


def calibrate(
    base: Qwen35MoeConfig,
    points: Sequence[CalibrationPoint] = CALIBRATION_POINTS,
    *,
    roles: Sequence[str] = capacity.ROLES,
    measured: capacity.Calibration | None = None,
    log=print,
) -> capacity.Calibration:
    """Compile both roles' gradient programs at every point and fit the coefficients.
    ``measured``: a calibration whose recorded measurements (its ``points``) are reused instead of
    compiling again (same code, same backend: e.g. to refit after a change of the model's terms)."""
    recorded = {} if measured is None else {name: int(nbytes) for name, _, nbytes in measured.points}
    samples = []
    for point in points:
        config = point.config(base)
        for role in roles:
            label = f"{point.name} ({role})"
            if label in recorded:
                nbytes = recorded[label]
            else:
                nbytes = measure(config, point.plan, point.tokens, point.assumptions(), role)
                log(f"measured {label}: {nbytes / 2**20:.1f} MiB")
            samples.append((config, point, role, nbytes))
    return capacity.fit_calibration(samples, backend=jax.default_backend(), jax_version=jax.__version__)


def validate(
    base: Qwen35MoeConfig,
    calibration: capacity.Calibration,
    points: Sequence[CalibrationPoint] = VALIDATION_POINTS,
    *,
    roles: Sequence[str] = capacity.ROLES,
) -> list[tuple[str, int, float, float]]:
    """(name (role), XLA bytes, predicted bytes, relative error) for each point and role."""
    out = []
    for point in points:
        config = point.config(base)
        assumptions = point.assumptions()
        for role in roles:
            measured = measure(config, point.plan, point.tokens, assumptions, role)
            predicted = capacity.program_estimate(
                config, point.plan, point.tokens, assumptions, calibration, role
            )
            out.append((f"{point.name} ({role})", measured, predicted, predicted / measured - 1.0))
    return out
