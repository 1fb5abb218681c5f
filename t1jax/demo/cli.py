"""`t1jax demo [--config configs/demo/demo.yaml] [--out runs/demo]`: the whole demo, stage by stage,
with a live table of stages and the final Table-1-style result (`t1jax.demo.driver`)."""

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
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from t1jax.demo.driver import Demo, load_demo_config, render_markdown

    config, base_dir = load_demo_config(args.config)
    demo = Demo(config, base_dir, args.out, ablation=args.ablation, seed=args.seed)
    console = Console(stderr=True)
    started = time.monotonic()

    def table(stages, current):
        view = Table(title=f"t1jax demo -> {args.out}", show_header=True)
        view.add_column("stage")
        view.add_column("state")
        view.add_column("seconds", justify="right")
        for stage in stages:
            if stage.skipped:
                state = "done earlier"
            elif stage is current:
                state = "running"
            elif stage.seconds:
                state = "done"
            else:
                state = "waiting" if current is not None else "done"
            view.add_row(stage.name, state, f"{stage.seconds:.0f}" if stage.seconds else "")
        view.caption = f"elapsed {time.monotonic() - started:.0f} s"
        return view

    if args.no_progress or not console.is_terminal:

        def display(stages, current):
            if current is not None:
                console.print(f"[demo] {current.name} (elapsed {time.monotonic() - started:.0f} s)")

        summary = demo.run(display)
    else:
        with Live(console=console, refresh_per_second=1) as live:
            summary = demo.run(lambda stages, current: live.update(table(stages, current)))
    Console().print(render_markdown(summary))
    if args.ablation:  # the ablation reports whichever way it comes out
        return 0
    verdicts = summary["verdicts"]
    return 0 if verdicts and all(v["beyond_noise"] for v in verdicts.values()) else 1
