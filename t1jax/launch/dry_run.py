"""``t1jax launch --config RUN.yaml --dry-run``: everything about a TPU pod run that can be checked
without the pod, in one pass, with a verdict per check.

The checks, in order (each a row of the verdict table):

- ``config``: the run config loads and is consistent (``t1jax.controller.config``; paths are the
  pod's, so local paths are not looked up here) and it has a ``launch:`` section.
- ``locations``: every gs:// URL parses as a GCS location by tensorstore's own parser (what orbax
  writes through); nothing is contacted. Local paths are listed as the pod's.
- ``devices``: the launch's TPU type, topology and slice count give the device count; the
  trainer and sampler shares must fit in it (disjoint, trainer first), the trainer plan must use
  exactly the trainer share, the sampler mesh the sampler share, the micro-batch rows must split
  over the plan's batch shards; on several slices, a share that straddles a slice boundary is
  reported (its collectives would cross the data-centre network).
- ``kernels``: the execution settings the run computes with; a Pallas kernel the plan cannot use
  (the Pallas delta rule under context parallelism) fails.
- ``capacity actor`` / ``capacity critic``: the planner's per-device memory (paper Eq. 21,
  ``t1jax.parallel.capacity``) for each network's step alone (the paper's forced offload), at the
  run's token wall (the largest row bucket) and rows per batch shard, against the device's HBM;
  ``capacity co-resident``: the larger step with both networks' state resident, as ``Learner``
  holds them (what the run actually needs).
- ``lower actor_grad`` / ``lower critic_grad`` / ``lower sampler``: the learner's two gradient
  programs traced and lowered for TPU on an abstract mesh of the trainer share, and the embedded
  sampler's decode step on an abstract mesh of the sampler share (``t1jax.tools.lowering``);
  StableHLO only, no compilation (that needs the TPU backend). With ``sampler.engine: vllm`` the
  sampler step lowered is the JAX engine's, as a check of the sampler share's shardings: vLLM-TPU's
  own programs need a TPU to build.
- ``pathways``: with ``run.pathways: true``, pathwaysutils is importable (its ``initialize()``
  needs a Pathways backend and is not called).
- ``manifests``: rendered from the launch section (``t1jax.launch.render_manifests``), validated
  offline (``t1jax.launch.validate_manifests``), written to ``--out``.

Exit status: 0 when every check passes; 1 when a check fails (one line per failure on stderr,
after the table); 2 for bad input (an unreadable or inconsistent config, a missing launch
section), per the CLI contract of ``t1jax.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from sandbox_service.cli_contract import UsageError, checking_input

# HBM per JAX device (one device per chip on these generations), GiB: the planner's budget M.
DEVICE_MEMORY_GIB = {"v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}
DEVICES_PER_CHIP = {"v4": 1, "v5e": 1, "v5p": 1, "v6e": 1}

PASS, FAIL, SKIP = "pass", "FAIL", "skip"


@dataclasses.dataclass(frozen=True)
class Check:
    """One row of the verdict table."""

    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="a run config with a launch: section")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything that can be checked without the pod and write the manifests (required: "
        "applying them is `kubectl apply -f`)",
    )
    parser.add_argument(
        "--out", type=Path, help="where to write the rendered manifests (default: <run.name>-manifests.yaml)"
    )
    parser.add_argument(
        "--no-lower",
        action="store_true",
        help="skip the abstract lowering of the learner and sampler programs",
    )
    parser.add_argument("--memory-gb", type=float, help="HBM per device (default: by launch.tpu_type)")
    parser.add_argument(
        "--kubernetes-version", default=None, help="schemas to validate against (default 1.33)"
    )


def _progress(message: str) -> None:
    print(f"t1jax launch: {message}", file=sys.stderr, flush=True)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _trainer_plan(config):
    from t1jax.parallel.plan import ShardingPlan, load_plan

    if config.trainer.plan is not None:
        return load_plan(config.trainer.plan)
    mesh = dict(config.trainer.mesh or {"fsdp": config.devices.trainer})
    try:
        return ShardingPlan.from_mapping({**mesh, "name": "trainer.mesh"}, source="trainer.mesh")
    except TypeError as error:
        raise UsageError(f"trainer.mesh: {error}") from error


def _device_checks(config, plan) -> tuple[Check, int]:
    launch = config.launch
    if launch.tpu_type not in DEVICES_PER_CHIP:
        raise UsageError(
            f"launch.tpu_type {launch.tpu_type!r}: the dry run knows the devices per chip of "
            f"{sorted(DEVICES_PER_CHIP)} only"
        )
    chips_per_slice = math.prod(int(d) for d in launch.topology.split("x"))
    per_slice = chips_per_slice * DEVICES_PER_CHIP[launch.tpu_type]
    total = per_slice * launch.num_slices
    trainer, sampler = config.devices.trainer, config.devices.sampler
    problems, notes = [], []
    if trainer + sampler > total:
        problems.append(f"trainer {trainer} + sampler {sampler} devices exceed the {total} of the launch")
    elif trainer + sampler < total:
        notes.append(f"{total - trainer - sampler} devices idle")
    if plan.devices != trainer:
        problems.append(
            f"trainer plan {plan.label()} uses {plan.devices} devices, devices.trainer is {trainer}"
        )
    sampler_mesh = math.prod(dict(config.sampler.mesh or {"tensor": sampler}).values())
    if sampler_mesh != sampler:
        problems.append(f"sampler.mesh makes {sampler_mesh} devices, devices.sampler is {sampler}")
    rows = config.rl.batching.rows_per_micro_batch
    if rows % plan.batch_shards:
        problems.append(
            f"rl.batching.rows_per_micro_batch {rows} does not split over the plan's "
            f"{plan.batch_shards} batch shards"
        )
    if launch.num_slices > 1:
        for share, start, count in (("trainer", 0, trainer), ("sampler", trainer, sampler)):
            first, last = start // per_slice, (start + count - 1) // per_slice
            if first != last and (start % per_slice or count % per_slice):
                notes.append(f"the {share} share straddles a slice boundary")
    detail = (
        f"{launch.tpu_type} {launch.topology} x {launch.num_slices} slice(s) = {total} devices; trainer "
        f"{trainer} ({plan.label()}), sampler {sampler} ({dict(config.sampler.mesh or {'tensor': sampler})})"
    )
    detail += "".join(f"; {text}" for text in problems + notes)
    return Check("devices", FAIL if problems else PASS, detail), max(1, rows // plan.batch_shards)


def _location_check(config) -> Check:
    from t1jax.controller.config import is_url

    urls, local = [], []
    for key, value in config.locations():
        if value and key != "model.preset":  # the preset is read here (the architecture)
            (urls if is_url(value) else local).append(f"{key}={value}")
    detail = f"gs:// parsed by tensorstore (not contacted): {', '.join(urls) or 'none'}"
    if local:
        detail += f"; pod paths (not looked up here): {', '.join(local)}"
    return Check("locations", PASS, detail)


def _kernel_check(execution, plan) -> Check:
    detail = (
        f"attention {execution.attention}, gated delta rule {execution.gated_delta_rule_kernel}, grouped "
        f"matmul {execution.grouped_matmul_kernel}, scan_layers {execution.scan_layers}, logits_chunk "
        f"{execution.logits_chunk}; Pallas: {', '.join(execution.pallas_kernels) or 'none'}"
    )
    if plan.context > 1 and execution.gated_delta_rule_kernel == "pallas":
        fix = "the Pallas delta rule has no context-parallel form: set gated_delta_rule_kernel: jax"
        return Check("kernels", FAIL, f"{detail}; plan context {plan.context}: {fix}")
    if plan.context > 1 and execution.attention == "splash":
        fix = (
            "splash attention is not used under context parallelism: set model.execution.attention: blockwise"
        )
        return Check("kernels", FAIL, f"{detail}; plan context {plan.context}: {fix}")
    if execution.pallas_interpret:
        return Check("kernels", FAIL, detail + "; pallas_interpret is for CPU tests, not for a TPU run")
    return Check("kernels", PASS, detail)


def _capacity_checks(model_config, plan, tokens, rows, execution, memory_gib, param_dtype, dtype):
    from t1jax.parallel import capacity

    assumptions = capacity.MemoryAssumptions(
        param_dtype=param_dtype, compute_dtype=dtype, platform="tpu", rows=rows, residency="offload"
    ).with_execution(execution)
    budget = memory_gib * capacity.GIB
    padded = capacity.padded_tokens(tokens, plan, assumptions.chunk_size)
    checks = []
    # Each network's step alone (the paper's forced offload), then both resident as `Learner`
    # holds them (the larger step with the other network's state and the retained versions).
    for role, residency in (("actor", "offload"), ("critic", "offload"), ("co-resident", "co-resident")):
        roles = capacity.ROLES if role == "co-resident" else (role,)
        estimate = capacity.estimate(
            model_config, plan, padded, budget_bytes=budget, roles=roles,
            assumptions=dataclasses.replace(assumptions, residency=residency),
        )  # fmt: skip
        terms = sorted(estimate.terms.items(), key=lambda item: -item[1])[:3]
        step = f"{estimate.role} step, " if role == "co-resident" else ""
        detail = (
            f"{step}{_gib(estimate.total)} of {memory_gib:g} GiB per device at T={padded:,} x {rows} row(s) "
            f"({plan.label()}); largest: " + ", ".join(f"{name} {_gib(value)}" for name, value in terms)
        )
        if not estimate.feasible:
            detail += f"; {estimate.verdict()}"
        checks.append(Check(f"capacity {role}", PASS if estimate.feasible else FAIL, detail))
    return checks


def _lowering_checks(config, model_config, plan, tokens, rows, execution, dtypes, memory_gib):
    import jax.numpy as jnp

    from t1jax.parallel.capacity import padded_tokens
    from t1jax.tools.lowering import lower_learner_programs, lower_sampler_step

    param_dtype, dtype = (getattr(jnp, name) for name in dtypes)
    padded = padded_tokens(tokens, plan)
    checks = []
    for program in ("actor_grad", "critic_grad"):
        _progress(f"lowering {program} for TPU on an abstract {plan.label()} mesh (T={padded:,}) ...")
        start = time.perf_counter()
        try:
            report = lower_learner_programs(
                model_config, plan, padded, rows=rows, programs=(program,), execution=execution,
                param_dtype=param_dtype, compute_dtype=dtype,
            )[program]  # fmt: skip
        except Exception as error:  # a lowering error is the check's finding, not a crash
            checks.append(Check(f"lower {program}", FAIL, _one_line(error), time.perf_counter() - start))
            continue
        kernels = report.lowered.as_text().count("tpu_custom_call")
        detail = (
            f"trace {report.seconds_trace:.1f} s + lower {report.seconds_lower:.1f} s; {report.arguments} "
            f"arrays, {report.hlo_chars / 1e6:.1f} MB StableHLO, {kernels} tpu_custom_call op(s) (Mosaic)"
        )
        checks.append(Check(f"lower {program}", PASS, detail, time.perf_counter() - start))
        _progress(f"  {program}: {detail}")
    sampler = config.sampler
    mesh = dict(sampler.mesh or {"tensor": config.devices.sampler})
    _progress(f"lowering the sampler's decode step for TPU on an abstract {mesh} mesh ...")
    start = time.perf_counter()
    try:
        report = lower_sampler_step(
            model_config, mesh, max_batch=sampler.max_batch, max_context=sampler.max_context,
            param_dtype=param_dtype, compute_dtype=dtype,
        )  # fmt: skip
    except Exception as error:
        checks.append(Check("lower sampler", FAIL, _one_line(error), time.perf_counter() - start))
        return checks
    resident = report.argument_bytes_per_device
    engine = (
        ""
        if sampler.engine == "jax"
        else f" (the JAX engine's; sampler.engine {sampler.engine} builds its own)"
    )
    detail = (
        f"decode step{engine}: {sampler.max_batch} slots x {sampler.max_context:,} tokens; weights + cache "
        f"{_gib(resident)} of {memory_gib:g} GiB per device; trace {report.seconds_trace:.1f} s + lower "
        f"{report.seconds_lower:.1f} s"
    )
    _progress(f"  sampler: {detail}")
    fits = resident <= memory_gib * 2**30
    if not fits:
        detail += " (weights and cache alone exceed the device)"
    return checks + [Check("lower sampler", PASS if fits else FAIL, detail, time.perf_counter() - start)]


def _one_line(error: Exception) -> str:
    text = " ".join(line.strip() for line in str(error).strip().splitlines()) or type(error).__name__
    return f"{type(error).__name__}: {text[:400]}"


def _pathways_check(config) -> Check:
    if not config.run.pathways:
        return Check("pathways", SKIP, "run.pathways is false")
    try:
        import pathwaysutils
    except ImportError:
        return Check("pathways", FAIL, "run.pathways is true but pathwaysutils is not installed")
    version = getattr(pathwaysutils, "__version__", "?")
    return Check(
        "pathways",
        PASS,
        f"pathwaysutils {version} importable; initialize() needs a Pathways backend (not called)",
    )


def _manifest_check(config, out: Path, kubernetes_version: str | None) -> Check:
    from t1jax.launch.__main__ import rendered_yaml
    from t1jax.launch.manifests import render_manifests
    from t1jax.launch.validate import DEFAULT_KUBERNETES_VERSION, ManifestError, validate_manifests

    version = kubernetes_version or DEFAULT_KUBERNETES_VERSION
    manifests = render_manifests(config.launch)
    try:
        validate_manifests(manifests, version)
    except ManifestError as error:
        return Check("manifests", FAIL, str(error))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(rendered_yaml(manifests))
    kinds = sorted({m["kind"] for m in manifests})
    return Check(
        "manifests", PASS, f"{len(manifests)} valid for Kubernetes {version} ({', '.join(kinds)}) -> {out}"
    )


def dry_run(args: argparse.Namespace) -> list[Check]:
    """Every check of the module docstring, in order; bad input raises `UsageError` (a check that
    fails is a FAIL verdict, not an exception)."""
    from t1jax.controller.config import load_run_config
    from t1jax.model.config import load_config

    start = time.perf_counter()
    with checking_input():
        config = load_run_config(args.config, check_paths=False).with_absolute_paths(args.config.parent)
    if config.launch is None:
        raise UsageError(
            f"{args.config}: no launch: section (the TPU pod deployment, t1jax.launch.LaunchParams)"
        )
    base_dir = args.config.parent
    checks = [Check("config", PASS, f"{args.config} (run {config.run.name!r}, {config.run.steps} steps)",
                    time.perf_counter() - start)]  # fmt: skip
    checks.append(_location_check(config))
    with checking_input():
        plan = _trainer_plan(config)
    device_check, rows = _device_checks(config, plan)
    checks.append(device_check)
    with checking_input():
        execution = config.model.execution_config(base_dir)
    checks.append(_kernel_check(execution, plan))
    if not config.model.preset:
        raise UsageError(
            "model.preset: the dry run needs the architecture preset (the checkpoint is the pod's)"
        )
    with checking_input():
        model_config = load_config(config.model.preset)
    memory = args.memory_gb or DEVICE_MEMORY_GIB.get(config.launch.tpu_type)
    tokens = config.rl.batching.row_length_buckets[-1]
    dtype = config.model.dtype
    param_dtype = config.model.param_dtype or dtype
    checks += _capacity_checks(model_config, plan, tokens, rows, execution, memory, param_dtype, dtype)
    if args.no_lower:
        checks.append(Check("lower", SKIP, "--no-lower"))
    else:
        checks += _lowering_checks(
            config, model_config, plan, tokens, rows, execution, (param_dtype, dtype), memory
        )
    checks.append(_pathways_check(config))
    out = args.out or Path(f"{config.launch.name}-manifests.yaml")
    checks.append(_manifest_check(config, out, args.kubernetes_version))
    return checks


def verdict_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  {'':4}  {'time':>6}  detail"]
    for c in checks:
        seconds = f"{c.seconds:5.1f}s" if c.seconds >= 0.05 else ""
        lines.append(f"{c.name:<{width}}  {c.status:<4}  {seconds:>6}  {c.detail}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.dry_run:
        raise UsageError(
            "only --dry-run is implemented: apply the manifests it writes with `kubectl apply -f`"
        )
    if args.memory_gb is not None and args.memory_gb <= 0:
        raise UsageError(f"--memory-gb must be > 0, got {args.memory_gb}")
    checks = dry_run(args)
    print(verdict_table(checks))
    failed = [c for c in checks if c.status == FAIL]
    for check in failed:
        print(f"t1jax launch: check failed: {check.name}: {check.detail}", file=sys.stderr)
    if not failed:
        print(f"dry run passed ({sum(c.status == PASS for c in checks)} checks)")
    return 1 if failed else 0
