"""The ``t1jax`` console entry point: one argparse parser with a subcommand per job.

Each subcommand lives in its own module and contributes ``add_arguments(parser)`` and
``run(args) -> exit code``; register it in ``SUBCOMMANDS``. Only the module of the subcommand named
on the command line is imported (``t1jax --help`` imports none): the planner's imports alone (jax,
flax, the model) cost ~2 CPU seconds, which every ``t1jax tasks generate``, every demo stage and
every bad-input check paid when the parser imported them all.

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

Errors (the contract of every subcommand): bad input — a missing file, a malformed config, an
impossible combination — is one line on stderr naming the problem and exit status 2; any other
failure is one line and exit status 1; ``--debug`` (before or after the subcommand) shows the
traceback instead. A subcommand signals bad input by raising `UsageError` (or `ValueError`,
`FileNotFoundError`, which the loaders raise with the file and field named).

Every subcommand, and every process it starts, shares one persistent XLA compilation cache
(``t1jax.compilation_cache``: ``T1JAX_COMPILATION_CACHE=DIR|off``, default ``~/.cache/t1jax/xla``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
import traceback

from t1jax import compilation_cache

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

EXIT_USAGE = 2
EXIT_FAILURE = 1


class UsageError(ValueError):
    """Bad input to a CLI: reported as one line with exit status 2."""


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
    parser = argparse.ArgumentParser(
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


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on it); another
    BrokenPipeError (a socket, a subprocess's pipe) is a failure like any other."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    # Before the parser imports the subcommands (some import jax, which reads the cache settings
    # from the environment once); a bad setting is reported like any other bad input, below.
    try:
        compilation_cache.configure()
        cache_problem = None
    except ValueError as error:
        cache_problem = error
    args = build_parser(argv).parse_args(argv)
    try:
        if cache_problem is not None:
            raise cache_problem
        status = importlib.import_module(args.module).run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return status
    except KeyboardInterrupt:
        print(f"t1jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if isinstance(error, BrokenPipeError) and stdout_reader_gone():
            # `t1jax ... | head`: the reader went away; stop quietly, as a shell tool does. stdout
            # now points at /dev/null, so the interpreter's own flush at exit cannot raise again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # 128 + SIGPIPE
        if args.debug:
            traceback.print_exc()
        usage = isinstance(error, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError))
        kind = "error" if usage else f"failed: {type(error).__name__}"
        message = "; ".join(line.strip() for line in str(error).strip().splitlines()) or type(error).__name__
        hint = "" if args.debug else " (--debug shows the traceback)"
        print(f"t1jax {args.command}: {kind}: {message}{hint if not usage else ''}", file=sys.stderr)
        return EXIT_USAGE if usage else EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
