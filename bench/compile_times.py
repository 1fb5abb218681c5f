"""Compile time of the learner's gradient programs with the decoder unrolled vs scanned over
repeats of the layer-type period (``ExecutionConfig.scan_layers``), in one run.

- the tiny model (configs/tiny_cpu.yaml, 4 layers: one period, so the scan has one step) and the
  tiny widths at the 122B depth (48 layers, 12 repeats): trace + lower + XLA:CPU compile of
  ``actor_grad`` and ``critic_grad`` for one micro-batch on one device;
- the 122B preset on its 256-device context-4 plan at the 84k wall: trace + lower for TPU (the
  abstract lowering; compiling needs a TPU).

Prints seconds per program and the unrolled / scanned ratio. Timings on a shared machine are noisy.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/compile_times.py
[--skip-122b]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from t1jax.model import load_config, load_execution  # noqa: E402
from t1jax.parallel.capacity import padded_tokens  # noqa: E402
from t1jax.parallel.plan import ShardingPlan, load_plan, make_mesh  # noqa: E402
from t1jax.tools.lowering import learner_program_args, lower_learner_programs  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_compile_seconds(config, execution, rows=4, tokens=256) -> dict[str, float]:
    plan = ShardingPlan()
    mesh, calls = learner_program_args(
        config,
        plan,
        tokens,
        rows=rows,
        mesh=make_mesh(plan),
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        execution=execution,
    )
    out = {}
    with jax.set_mesh(mesh):
        for name, (program, args, _) in calls.items():
            start = time.perf_counter()
            program.trace(*args).lower().compile()
            out[name] = time.perf_counter() - start
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-122b", action="store_true")
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"jax {jax.__version__}, load average {load}")
    tiny = load_config(os.path.join(REPO, "configs", "tiny_cpu.yaml"))
    base = load_execution(os.path.join(REPO, "configs", "tiny_cpu.yaml"))
    print("\ncompile (trace + lower + XLA:CPU compile), one device, 4 x 256 tokens")
    print(f"{'model':<28} {'program':<12} {'unrolled s':>10} {'scanned s':>10} {'ratio':>6}")
    for label, config in (
        ("tiny (4 layers)", tiny),
        ("tiny widths, 48 layers", tiny.replace(num_hidden_layers=48)),
    ):
        unrolled = tiny_compile_seconds(config, base.replace(scan_layers=False))
        scanned = tiny_compile_seconds(config, base.replace(scan_layers=True))
        for name in unrolled:
            print(
                f"{label:<28} {name:<12} {unrolled[name]:>10.1f} {scanned[name]:>10.1f} "
                f"{unrolled[name] / scanned[name]:>5.2f}x"
            )
    if args.skip_122b:
        return
    big_path = os.path.join(REPO, "configs", "qwen35_122b_a10b.yaml")
    config, execution = load_config(big_path), load_execution(big_path)
    plan = load_plan("qwen35_122b_a10b_256_cp4")
    tokens = padded_tokens(84_000, plan)
    print(f"\n122B abstract lowering for TPU (trace + lower), plan {plan.name}, T = {tokens}")
    print(
        f"{'program':<12} {'unrolled s':>10} {'scanned s':>10} {'ratio':>6} {'HLO MB unrolled / scanned':>26}"
    )
    results = {}
    for scan in (False, True):
        results[scan] = lower_learner_programs(
            config, plan, tokens, execution=execution.replace(scan_layers=scan)
        )
    for name in results[False]:
        unrolled, scanned = results[False][name], results[True][name]
        a = unrolled.seconds_trace + unrolled.seconds_lower
        b = scanned.seconds_trace + scanned.seconds_lower
        print(
            f"{name:<12} {a:>10.1f} {b:>10.1f} {a / b:>5.2f}x "
            f"{unrolled.hlo_chars / 1e6:>14.1f} / {scanned.hlo_chars / 1e6:.1f}"
        )


if __name__ == "__main__":
    main()
