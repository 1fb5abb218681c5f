"""The ``t1jax`` console entry point: one argparse parser with a subcommand per job.

Each subcommand lives in its own module and contributes ``add_arguments(parser)`` and
``run(args) -> exit code``; register it in ``SUBCOMMANDS``. Only the module of the subcommand named
on the command line is imported (``t1jax --help`` imports none): the planner's imports alone (jax,
flax, the model) cost ~2 CPU seconds, which a ``t1jax tasks generate``, a demo stage or a bad-input
check should not pay.

- ``t1jax plan``: rank sharding plans by per-device memory (``t1jax.tools.planner``).
- ``t1jax eval``: evaluate a checkpoint (or the oracle / no-op agent) on a task directory
  (``t1jax.eval.cli``).
- ``t1jax compare``: is one evaluated checkpoint better than another on the same tasks, beyond the
  noise (paired, family-clustered bootstrap; ``t1jax.eval.compare``).
- ``t1jax train``: run or resume an RL run (``t1jax.controller.cli``).
- ``t1jax tasks generate``: write the synthetic task suite (``t1jax.data.tasks_cli``).
- ``t1jax sft``: demonstrations -> SFT warm start -> checkpoint (``t1jax.sft.cli``).
- ``t1jax demo``: base -> SFT -> critic warm-up -> RL -> held-out evaluation (``t1jax.demo.cli``).
- ``t1jax launch --dry-run``: check a TPU pod run without the pod, write its manifests
  (``t1jax.launch.dry_run``).

Errors: every subcommand follows the repository's one error contract
(``sandbox_service.cli_contract``): bad input is a `UsageError` raised where the input is checked
(or a run config's `ConfigError`), one line and exit status 2; any other failure one line and exit
status 1; ``--debug`` (before or after the subcommand) shows the traceback too.

Every subcommand, and every process it starts, shares one persistent XLA compilation cache
(``t1jax.compilation_cache``: ``T1JAX_COMPILATION_CACHE=DIR|off``, default ``~/.cache/t1jax/xla``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sandbox_service.cli_contract import (
    EXIT_FAILURE,
    EXIT_USAGE,
    OneLineArgumentParser,
    UsageError,
    run_command,
)
from t1jax import compilation_cache

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "SUBCOMMANDS", "UsageError", "build_parser", "main"]

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("t1jax.tools.planner", "rank sharding plans by the per-device memory model (paper Eq. 21)"),
    "eval": ("t1jax.eval.cli", "evaluate a checkpoint, the oracle or the no-op agent on a task directory"),
    "compare": (
        "t1jax.eval.compare",
        "paired difference of eval jobs on their shared tasks: `compare JOB... --against BASE`",
    ),
    "train": ("t1jax.controller.cli", "run or resume an RL run from a run config (the single controller)"),
    "demo": ("t1jax.demo.cli", "base -> SFT -> critic warm-up -> RL -> held-out evaluation in one directory"),
    "tasks": ("t1jax.data.tasks_cli", "synthetic task suite: `tasks generate --out DIR --n N --seed S`"),
    "sft": ("t1jax.sft.cli", "SFT warm start: demonstrations in sandboxes -> cross-entropy -> checkpoint"),
    "launch": (
        "t1jax.launch.dry_run",
        "TPU pod run: `launch --config RUN.yaml --dry-run` checks it and writes its manifests",
    ),
}

def chosen_command(argv: list[str]) -> str | None:
    """The subcommand `argv` names: its first argument that is not an option (the only option
    before a subcommand is ``--debug``), if that is a registered subcommand."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in SUBCOMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (default: ``sys.argv[1:]``): every subcommand is listed with its help,
    and only the one `argv` names has its arguments (its module imported)."""
    chosen = chosen_command(sys.argv[1:] if argv is None else argv)
    parser = OneLineArgumentParser(
        prog="t1jax",
        description="t1jax: PPO for terminal agents in JAX",
        epilog=f"environment: {compilation_cache.ENV}=DIR|off chooses the XLA compilation cache every "
        "t1jax process shares (default ~/.cache/t1jax/xla)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub)
        sub.set_defaults(module=module_name)
    return parser


def as_usage_error(error: Exception) -> Exception:
    """A run config's `ConfigError` is bad input too. Looked up only once something failed, and
    only if the config module was loaded (it raised it then), so the parser imports nothing."""
    config = sys.modules.get("t1jax.controller.config")
    if config is not None and isinstance(error, config.ConfigError) and not isinstance(error, UsageError):
        return UsageError(str(error))
    return error


def main(argv: list[str] | None = None) -> int:
    # Before the parser imports the subcommands (some import jax, which reads the cache settings
    # from the environment once); a bad setting is reported like any other bad input, below.
    try:
        compilation_cache.configure()
        cache_problem = None
    except ValueError as error:
        cache_problem = UsageError(str(error))
    args = build_parser(argv).parse_args(argv)

    def body() -> int:
        if cache_problem is not None:
            raise cache_problem
        try:
            return importlib.import_module(args.module).run(args)
        except Exception as error:
            converted = as_usage_error(error)
            if converted is error:
                raise
            raise converted from error

    # a subcommand with actions of its own names them in `prog` (`t1jax tasks generate`)
    return run_command(getattr(args, "prog", f"t1jax {args.command}"), body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
