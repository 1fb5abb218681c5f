"""Pipeline benchmark: is a training step a max, not a sum (paper §7.5, App. 12.1)?

Runs `t1jax train` on the tiny run config (`configs/runs/tiny_cpu.yaml`: 4 trainer + 4 sampler
fake CPU devices, real sandboxes) for a few steps with one-step asynchrony, then, per step after
the first (which pays for compilation), prints the measured step time against max(rollout time,
train time) of the same step, and their ratio (goal <= 1.15). Also prints the ratio against the
sum, for reference: a synchronous loop would pay the sum.

A caveat this benchmark makes visible: fake CPU devices share the machine's cores, so the
"disjoint" trainer and sampler compete for the same two cores here, unlike TPU slices; the ratio
on this machine measures the controller's overlap logic plus that contention.

Run: `.venv/bin/python bench/pipeline.py [--steps N]`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from t1jax.controller.cli import train  # noqa: E402
from t1jax.controller.config import load_run_config  # noqa: E402
from t1jax.controller.rundir import RunDir, read_metrics  # noqa: E402


def processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "runs" / "tiny_cpu.yaml")
    args = parser.parse_args()
    overrides = {
        "run.steps": args.steps,
        "logging.display": False,
        "logging.trajectories": False,
        "checkpoint.state_every": 1000,
        "checkpoint.weights_every": 1000,
    }
    config = load_run_config(args.config, overrides=overrides).with_absolute_paths(args.config.parent)
    run_dir = RunDir(Path(tempfile.mkdtemp()) / "run")
    run_dir.create(config.resolved())
    train(config, run_dir, resume=False, base_dir=args.config.parent)
    rows = read_metrics(run_dir.path)
    print(f"machine: {processor()}")
    print(
        f"run: {args.config.name}, {args.steps} steps, launch {config.schedule.launch_size} admit "
        f"{config.schedule.batch_size}, trainer {config.devices.trainer} + sampler "
        f"{config.devices.sampler} devices"
    )
    print(
        f"{'step':>4} {'rollout s':>10} {'train s':>8} {'publish s':>9} {'step s':>7} "
        f"{'step/max':>9} {'step/sum':>9}"
    )
    ratios = []
    for row in rows:
        rollout, train_sec, step = row["time/rollout_sec"], row["time/train_sec"], row["time/step_sec"]
        publish = row["time/publish_sec"]
        ratio_max = step / max(rollout, train_sec)
        ratio_sum = step / (rollout + train_sec)
        print(
            f"{row['step']:>4} {rollout:>10.2f} {train_sec:>8.2f} {publish:>9.2f} {step:>7.2f} "
            f"{ratio_max:>9.2f} {ratio_sum:>9.2f}"
        )
        if row["step"] > 1 and rollout > 0:  # step 1 compiles; the last step overlaps no rollout
            ratios.append(ratio_max)
    if ratios:
        print(
            f"step time / max(rollout, train), steps 2..{rows[-1]['step'] - 1}: "
            f"{sum(ratios) / len(ratios):.2f} (goal <= 1.15)"
        )


if __name__ == "__main__":
    main()
