"""`t1jax sft --config configs/demo/sft.yaml --tasks DIR/train --out RUN`: the SFT warm start.

Runs `t1jax.sft.train.run_sft`: demonstrations in real sandboxes, masked cross-entropy, an HF
checkpoint in `RUN/checkpoint`. The two halves can run apart: `--collect-only` stops after the
demonstrations (RUN/samples.npz), and `--demonstrations RUN` trains on those instead of
collecting again (no `--tasks` then; the harness must match), e.g. demonstrations that need no
model while the base model is still pretraining. Progress goes to stderr; the run directory holds the metrics
(`metrics.jsonl`, `demonstrations.jsonl`, `summary.json`). A bad config, a missing or malformed
task directory, or an existing non-empty `--out` exit 2 with one line naming the problem.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="SFT config (e.g. configs/demo/sft.yaml)")
    parser.add_argument("--tasks", type=Path, default=None, help="tasks to demonstrate (a train split)")
    parser.add_argument(
        "--collect-only", action="store_true", help="stop after the demonstrations (for --demonstrations)"
    )
    parser.add_argument(
        "--demonstrations", type=Path, default=None, metavar="RUN",
        help="train on the demonstrations a --collect-only run wrote instead of collecting them",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="new run directory")
    parser.add_argument(
        "--init", default=None, help="start from this checkpoint directory (overrides the config)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="override training.epochs")
    parser.add_argument(
        "--seed", type=int, default=None, help="override seed (demonstration mistakes, order)"
    )


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from sandbox_service.cli_contract import UsageError, checking_input
    from t1jax.sft.train import load_sft_config, run_sft

    with checking_input():
        config = load_sft_config(args.config)
    if args.init is not None:
        config = dataclasses.replace(config, init=str(Path(args.init).resolve()))
    if args.epochs is not None:
        training = dataclasses.replace(config.training, epochs=args.epochs)
        config = dataclasses.replace(config, training=training)
    if args.seed is not None:
        config = dataclasses.replace(config, seed=args.seed)
    if config.init is not None and not (Path(config.init) / "config.json").is_file():
        raise UsageError(f"init checkpoint {config.init} has no config.json")
    if args.demonstrations is not None:
        if args.tasks is not None or args.collect_only:
            raise UsageError("--demonstrations replaces --tasks and --collect-only")
    elif args.tasks is None:
        raise UsageError("give --tasks (the tasks to demonstrate) or --demonstrations RUN")
    elif not args.tasks.is_dir():
        raise UsageError(f"--tasks {args.tasks} is not a directory")
    # run_sft raises UsageError for what it checks before its work (the output directory, the
    # tasks, the demonstrations' harness, the habits); anything later is a failure (exit 1)
    summary = run_sft(
        config, args.tasks, args.out, collect_only=args.collect_only, demonstrations=args.demonstrations
    )
    print(json.dumps(summary, indent=1))
    return 0
