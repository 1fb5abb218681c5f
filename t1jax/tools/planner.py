"""``t1jax plan``: every sharding plan for a model, a device count, a per-device memory budget and a
token wall, ranked by the capacity model of the learner (``t1jax.parallel.capacity``), with the
reason each infeasible plan fails.

Owns the command's arguments and its report; the numbers come from ``capacity.estimate`` (the
larger of the learner's actor and critic steps with everything the learner keeps resident). The
model's execution settings (attention kernel, head chunking, layer scan) come from the preset's
``execution:`` section unless overridden. The token wall is padded per plan to what the
context-parallel scan needs (a multiple of context x chunk), and the padded length is what the
plan is charged for. ``--lower`` lowers the learner's own gradient programs of the evaluated plans
on their abstract meshes (``t1jax.tools.lowering``); ``--calibrate`` refits the coefficients to
compilations of those programs on the local (CPU) devices and prints the validation errors.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from pathlib import Path

from sandbox_service.cli_contract import UsageError, checking_input
from t1jax.model.config import Qwen35MoeConfig, load_config
from t1jax.model.execution import load_execution
from t1jax.parallel import capacity
from t1jax.parallel.capacity import padded_tokens
from t1jax.parallel.plan import load_plan

GIB = capacity.GIB
COLUMNS = (
    ("weights", "weights"),
    ("gradients", "grads"),
    ("optimizer", "optim"),
    ("other_network", "other"),
    ("retained", "retain"),
    ("batch", "batch"),
    ("boundary", "bound"),
    ("scan_copy", "scan"),
    ("layer", "layer"),
    ("dispatch", "moe"),
    ("saved", "saved"),
    ("attention_scores", "scores"),
    ("attention_mask", "mask"),
    ("attention_blocks", "blocks"),
    ("logits", "logits"),
    ("residue", "resid"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="model config (YAML preset or HF config.json)")
    parser.add_argument("--devices", type=int, help="device count G (required unless --plan is given)")
    parser.add_argument("--memory-gb", type=float, default=95.0, help="per-device budget M in GiB")
    parser.add_argument(
        "--tokens", type=int, default=84_000, help="token wall T (one sequence per batch shard)"
    )
    parser.add_argument("--rows", type=int, default=1, help="sequences per batch shard per micro-batch")
    parser.add_argument("--param-dtype", default="bfloat16", choices=sorted(capacity.DTYPE_BYTES))
    parser.add_argument("--compute-dtype", default="bfloat16", choices=sorted(capacity.DTYPE_BYTES))
    parser.add_argument(
        "--attention",
        choices=("blockwise", "flash", "dense"),
        help="attention kernel (default: the preset's execution.attention); blockwise (alias flash): "
        "t1jax's blockwise kernel, no [T, T] scores; dense: the reference core ([T/cp, T] scores)",
    )
    parser.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the layer scan's stacked parameter copy (default: the preset's execution.scan_layers)",
    )
    parser.add_argument(
        "--residency",
        default="co-resident",
        choices=capacity.RESIDENCY,
        help="co-resident: both networks' state on the devices, as the learner keeps it; offload: "
        "only the running network's (the paper's forced offload: each must fit alone)",
    )
    parser.add_argument(
        "--retained-versions",
        type=int,
        default=2,
        help="published actor versions the learner keeps (ppo.retained_versions; co-resident only)",
    )
    parser.add_argument(
        "--platform",
        default="tpu",
        choices=("tpu", "gpu", "cpu"),
        help="the backend the learner runs on (cpu: the 'auto' MoE collective is the padded one)",
    )
    parser.add_argument("--remat", default="layer", choices=("layer", "none"))
    parser.add_argument("--pipeline", default="1", help="comma-separated pipeline degrees to consider")
    parser.add_argument(
        "--residue-fraction", type=float, default=0.03, help="allocator residue as a share of M"
    )
    parser.add_argument("--calibration", type=Path, help="calibration JSON (default: the stored CPU one)")
    parser.add_argument(
        "--plan", action="append", default=[], help="evaluate these named plans / YAML files only"
    )
    parser.add_argument("--top", type=int, default=0, help="print at most this many plans per table (0: all)")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="recompile the tiny model's train step, refit the calibration, print validation errors",
    )
    parser.add_argument(
        "--calibration-out", type=Path,
        help="with --calibrate: where to write the JSON (default: the stored one, in the package)",
    )  # fmt: skip
    parser.add_argument(
        "--lower",
        action="store_true",
        help="also lower the learner's actor and critic gradient programs of each evaluated plan "
        "on its abstract mesh (TPU lowering rules; slow for a large model)",
    )


def _gib(x: float) -> str:
    return f"{x / GIB:7.2f}"


def _model_line(config: Qwen35MoeConfig) -> str:
    experts, dense = capacity.parameter_counts(config)
    attention = len(config.full_attention_layers)
    return (
        f"model: {config.num_hidden_layers} layers ({config.num_hidden_layers - attention} Gated DeltaNet + "
        f"{attention} attention), hidden {config.hidden_size}, {config.num_experts} experts top-"
        f"{config.num_experts_per_tok}, vocab {config.vocab_size:,}; Pe = {experts / 1e9:.2f}B expert, "
        f"Pd = {dense / 1e9:.2f}B other parameters"
    )


def _row(rank, estimate: capacity.MemoryEstimate) -> str:
    cells = " ".join(_gib(estimate.terms[key]) for key, _ in COLUMNS)
    budget = estimate.budget or 0.0
    plan = estimate.plan
    return (
        f"{rank:>4} {plan.label():<30} {plan.batch_shards:>5} {estimate.tokens:>7} {estimate.role:>6} "
        f"{cells} {_gib(estimate.total)} {_gib(budget - estimate.total)}"
    )


def _header() -> str:
    cells = " ".join(f"{label:>7}" for _, label in COLUMNS)
    return (
        f"{'rank':>4} {'plan (degrees)':<30} {'seqs':>5} {'T':>7} {'role':>6} {cells} {'total':>7} "
        f"{'free':>7}"
    )


def _assumptions(args: argparse.Namespace) -> capacity.MemoryAssumptions:
    execution = load_execution(args.config)
    if args.attention is not None:
        execution = execution.replace(attention="dense" if args.attention == "dense" else "blockwise")
    if args.scan_layers is not None:
        execution = execution.replace(scan_layers=args.scan_layers)
    return capacity.MemoryAssumptions(
        param_dtype=args.param_dtype,
        compute_dtype=args.compute_dtype,
        platform=args.platform,
        rows=args.rows,
        residue_fraction=args.residue_fraction,
        residency=args.residency,
        retained_versions=args.retained_versions,
    ).with_execution(execution)


def _pipelines(text: str) -> list[int]:
    """`--pipeline 1,2,4` -> [1, 2, 4]; each degree a whole number >= 1."""
    try:
        degrees = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--pipeline takes comma-separated whole numbers, got {text!r}") from None
    if not degrees or min(degrees) < 1:
        raise UsageError(f"--pipeline degrees must be >= 1, got {text!r}")
    return degrees


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, least in (("--devices", args.devices, 1), ("--tokens", args.tokens, 1),
                               ("--rows", args.rows, 1), ("--top", args.top, 0),
                               ("--retained-versions", args.retained_versions, 0)):  # fmt: skip
        if value is not None and value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if not args.memory_gb > 0:
        raise UsageError(f"--memory-gb must be > 0, got {args.memory_gb:g}")
    if not 0 <= args.residue_fraction < 1:
        raise UsageError(f"--residue-fraction must be in [0, 1), got {args.residue_fraction:g}")


def run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    with checking_input():
        config = load_config(args.config)
    if args.calibrate:
        return _calibrate(args)
    with checking_input():
        assumptions = _assumptions(args)
        if args.calibration:
            calibration = capacity.Calibration.load(args.calibration)
        else:
            calibration = capacity.default_calibration()
        if args.plan:
            plans = [load_plan(name) for name in args.plan]
    budget = args.memory_gb * GIB
    if args.plan:
        plans = [dataclasses.replace(p, remat=args.remat) if args.remat != p.remat else p for p in plans]
        devices = {p.devices for p in plans}
        device_text = "/".join(str(d) for d in sorted(devices))
    else:
        if not args.devices:
            raise UsageError("give --devices (or --plan)")
        plans = capacity.candidate_plans(args.devices, pipelines=_pipelines(args.pipeline), remat=args.remat)
        device_text = str(args.devices)

    estimates = []
    for plan in plans:
        tokens = padded_tokens(args.tokens, plan, assumptions.chunk_size)
        estimates.append(
            capacity.estimate(
                config, plan, tokens, assumptions=assumptions, calibration=calibration, budget_bytes=budget
            )
        )
    feasible, infeasible = capacity.rank_plans(estimates)
    print(_model_line(config))
    print(
        f"devices {device_text} x {args.memory_gb:g} GiB, token wall {args.tokens:,} x {args.rows} "
        f"row(s) per batch shard; params {args.param_dtype}"
        f"{' + float32 master' if assumptions.master_weights else ''}, Adam float32, remat {args.remat}, "
        f"attention {assumptions.attention}, head in chunks of ~{assumptions.logits_chunk} positions, "
        f"scan_layers {assumptions.scan_layers}, platform {args.platform}, "
        f"residue {args.residue_fraction:.0%} of M"
    )
    if assumptions.residency == "co-resident":
        resident = f"both networks resident, {assumptions.retained_versions} retained actor versions"
    else:
        resident = "only the running network resident"
    print(
        f"learner: actor and critic steps time-share the devices; {assumptions.residency} ({resident}); "
        "each row is the larger step (role column)"
    )
    source = args.calibration or f"stored {capacity.DEFAULT_CALIBRATION.name}"
    print(
        f"calibration: {source} ({calibration.backend}, jax "
        f"{calibration.jax_version}): c_act {calibration.activation:.3f}, c_moe {calibration.dispatch:.3f}, "
        f"c_saved {calibration.saved:.3f}, c_block {calibration.blocks:.3f}, "
        f"c_attn {calibration.attention:.3f}, c_mask {calibration.mask:.3f}, "
        f"c_logit {calibration.logits:.3f}, "
        f"b0 {calibration.residue_bytes / 2**20:.1f} MiB"
    )
    print("GiB per device; seqs = sequences side by side (data x fsdp x expert); T = padded token wall")
    print()
    limit = args.top or None
    order = "seqs desc, expert desc, tensor asc, pipeline asc, total asc"
    print(f"feasible plans: {len(feasible)} (ranked: {order})")
    if feasible:
        print(_header())
        for rank, estimate in enumerate(feasible[:limit], 1):
            print(_row(rank, estimate))
    memory_bound = [e for e in infeasible if not e.problems]
    unsplittable = [e for e in infeasible if e.problems]
    print()
    print(f"infeasible by memory: {len(memory_bound)} (ranked by total)")
    if memory_bound:
        print(_header() + "  why")
        for rank, estimate in enumerate(memory_bound[:limit], 1):
            print(_row(rank, estimate) + "  " + estimate.verdict())
    if unsplittable:
        reasons = Counter(problem for e in unsplittable for problem in e.problems)
        print()
        print(f"not splittable: {len(unsplittable)} plans")
        for reason, count in reasons.most_common():
            print(f"  {count:>4} x {reason}")
    if args.lower:
        _lower(config, [e for e in estimates if not e.problems], assumptions)
    return 0 if feasible else 1


def _lower(config: Qwen35MoeConfig, estimates, assumptions: capacity.MemoryAssumptions) -> None:
    import jax.numpy as jnp

    from t1jax.tools.lowering import lower_learner_programs

    print()
    print("lowering the learner's gradient programs on each plan's abstract mesh (TPU rules):")
    for estimate in estimates:
        reports = lower_learner_programs(
            config,
            estimate.plan,
            estimate.tokens,
            rows=assumptions.rows,
            param_dtype=getattr(jnp, assumptions.param_dtype),
            compute_dtype=getattr(jnp, assumptions.compute_dtype),
            execution=assumptions.execution(),
        )
        for name, report in reports.items():
            print(
                f"  {estimate.plan.label():<30} {name:<11} lowered: trace {report.seconds_trace:5.1f} s, "
                f"lower {report.seconds_lower:5.1f} s, {report.arguments} arrays, "
                f"{report.hlo_chars / 1e6:.1f} MB of StableHLO"
            )


def _calibrate(args: argparse.Namespace) -> int:
    import jax

    if jax.default_backend() == "cpu" and len(jax.devices()) < 8:
        raise UsageError(
            "--calibrate compiles 2- and 4-device plans: run it with 8 CPU devices, e.g. "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 t1jax plan --calibrate ..."
        )
    from t1jax.tools.lowering import calibrate, validate

    base = load_config(args.config)
    calibration = calibrate(base)
    out = args.calibration_out or capacity.DEFAULT_CALIBRATION
    calibration.save(out)
    print(f"wrote {out}")
    print(calibration.to_json())
    worst = 0.0
    for name, measured, predicted, error in validate(base, calibration):
        worst = max(worst, abs(error))
        print(
            f"validate {name:<44} XLA {measured / 2**20:9.1f} MiB  "
            f"model {predicted / 2**20:9.1f} MiB  {error:+.1%}"
        )
    print(f"worst validation error {worst:.1%}")
    return 0
