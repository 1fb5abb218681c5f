"""The ``t1jax`` console entry point: one argparse parser with a subcommand per job.

Each subcommand lives in its own module and contributes ``add_arguments(parser)`` and
``run(args) -> exit code``; register it in ``SUBCOMMANDS`` (imports are lazy so that ``t1jax plan``
does not pay for the trainer's imports and vice versa).

- ``t1jax plan``: rank sharding plans by per-device memory (``t1jax.parallel.planner``).
- ``t1jax tasks generate``: write the synthetic task suite (``t1jax.data.tasks_cli``).
- ``t1jax sft``: demonstrations -> SFT warm start -> checkpoint (``t1jax.sft.cli``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("t1jax.parallel.planner", "rank sharding plans by the per-device memory model (paper Eq. 21)"),
    "tasks": ("t1jax.data.tasks_cli", "synthetic task suite: `tasks generate --out DIR --n N --seed S`"),
    "sft": ("t1jax.sft.cli", "SFT warm start: demonstrations in sandboxes -> cross-entropy -> checkpoint"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t1jax", description="t1jax: PPO for terminal agents in JAX")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_arguments(sub)
        sub.set_defaults(module=module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return importlib.import_module(args.module).run(args)


if __name__ == "__main__":
    sys.exit(main())
