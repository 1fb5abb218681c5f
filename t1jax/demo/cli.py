"""`t1jax demo [--config configs/demo/demo.yaml] [--out runs/demo]`: the whole demo, stage by stage,
with a live table of stages and the final Table-1-style result (`t1jax.demo.driver`).

`--campaign rl-NAME KEY=VALUE...` (repeatable) adds an RL campaign from the same SFT checkpoint:
the demo's rl stage with those `t1jax train --set` overrides, evaluated like it and compared with
SFT and with the demo's own RL. Re-running with a new campaign on a finished demo directory runs
only what the campaign adds, e.g.
    t1jax demo --out runs/demo --campaign rl-lr6 rl.actor_optimizer.learning_rate=6e-4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo" / "demo.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="the demo's stages (default: %(default)s)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs") / "demo", help="demo directory (re-run to continue)"
    )
    parser.add_argument(
        "--ablation", action="store_true",
        help="also run the binary-reward RL campaign (rl-binary) from the same SFT and warm-up",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=0,
        help="added to every training and evaluation seed (not the suite's): a second seed's run",
    )  # fmt: skip
    parser.add_argument(
        "--suite-seed", type=int, default=None,
        help="the task suite's seed instead of the config's tasks.seed: other train and held-out families",
    )  # fmt: skip
    parser.add_argument(
        "--campaign", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
        help="another RL campaign from the same SFT: rl-NAME then --set overrides of the rl stage, "
             "e.g. --campaign rl-lr6 rl.actor_optimizer.learning_rate=6e-4; repeatable",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true")


def campaigns_from_args(values: list[list[str]]) -> dict[str, dict]:
    """`--campaign NAME KEY=VALUE...` values -> {NAME: {KEY: value}}, each value read as YAML."""
    from t1jax.cli import UsageError
    from t1jax.controller.cli import parse_overrides

    campaigns: dict[str, dict] = {}
    for name, *pairs in values:
        if name in campaigns:
            raise UsageError(f"--campaign {name}: given twice")
        campaigns[name] = parse_overrides(pairs, flag=f"--campaign {name}")
    return campaigns


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from sandbox_service.cli_contract import checking_input
    from t1jax.demo.driver import (
        Demo,
        ablation_verdicts_hold,
        demo_verdict_holds,
        load_demo_config,
        render_markdown,
    )

    with checking_input():  # the demo's config and campaigns, before any stage runs
        config, base_dir = load_demo_config(args.config)
        demo = Demo(config, base_dir, args.out, ablation=args.ablation, seed=args.seed,
                    suite_seed=args.suite_seed, campaigns=campaigns_from_args(args.campaign))  # fmt: skip
    console = Console(stderr=True)
    started = time.monotonic()

    def table(stages, running):
        view = Table(title=f"t1jax demo -> {args.out}", show_header=True)
        view.add_column("stage")
        view.add_column("state")
        view.add_column("seconds", justify="right")
        now = time.monotonic()
        for stage in stages:
            if stage.skipped:
                state = "done earlier"
            elif stage in running:
                state = "running"
            elif stage.seconds:
                state = "done"
            else:
                state = "waiting"
            view.add_row(stage.name, state, f"{stage.seconds:.0f}" if stage.seconds else "")
        view.caption = f"elapsed {now - started:.0f} s"
        return view

    if args.no_progress or not console.is_terminal:
        announced: set[str] = set()

        def display(stages, running):
            for stage in running:
                if stage.name not in announced:
                    announced.add(stage.name)
                    console.print(f"[demo] {stage.name} (elapsed {time.monotonic() - started:.0f} s)")

        summary = demo.run(display)
    else:
        with Live(console=console, refresh_per_second=1) as live:
            summary = demo.run(lambda stages, running: live.update(table(stages, running)))
    Console().print(render_markdown(summary))
    if args.ablation:
        return 0 if ablation_verdicts_hold(summary["verdicts"]) else 1
    return 0 if demo_verdict_holds(summary["verdicts"]) else 1
