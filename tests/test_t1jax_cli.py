"""The `t1jax` entry point (t1jax.cli): every subcommand is listed, only the named one is imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from t1jax import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv, command",
    [
        (["eval", "--tasks", "x"], "eval"),
        (["--debug", "train", "--config", "x"], "train"),
        (["--help"], None),
        ([], None),
        (["bogus", "eval"], None),  # argparse rejects "bogus"; "eval" there is not the command
    ],
)
def test_the_chosen_command_is_the_first_argument_that_is_not_an_option(argv, command):
    assert cli.chosen_command(argv) == command


def test_the_named_subcommand_parses_its_own_arguments():
    argv = ["--debug", "tasks", "generate", "--out", "suite", "--n", "8"]
    args = cli.build_parser(argv).parse_args(argv)
    assert (args.command, args.module, args.debug, str(args.out), args.n) == (
        "tasks", "t1jax.data.tasks_cli", True, "suite", 8,
    )  # fmt: skip


def imported_after(argv: list[str]) -> set[str]:
    """The heavy modules a fresh interpreter holds after building the parser for `argv`."""
    heavy = "('jax', 'flax', 't1jax.model', 't1jax.tools.planner')"
    code = (
        "import sys; from t1jax import cli; cli.build_parser(sys.argv[1:]); "
        f"print(' '.join(m for m in {heavy} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    return set(done.stdout.split())


def test_only_the_named_subcommands_module_is_imported():
    # the planner imports jax, flax and the model (~2 CPU seconds); nothing else should pay for it
    assert imported_after(["--help"]) == set()
    assert imported_after(["tasks", "generate", "--out", "x"]) == set()
    assert imported_after(["plan", "--help"]) == {"jax", "flax", "t1jax.model", "t1jax.tools.planner"}


def test_help_lists_every_subcommand():
    done = subprocess.run([sys.executable, "-m", "t1jax.cli", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0
    for name in cli.SUBCOMMANDS:
        assert name in done.stdout


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path, unbuffered):
    """`t1jax tasks generate ... | true`: the reader is gone before the summary is printed; the
    command stops without a traceback or a 'failed' line (line- or block-buffered stdout), its work
    (the suite) already done."""
    shell = (
        f"{sys.executable} -m t1jax.cli tasks generate --out {tmp_path / 's'} --n 30 | true; "
        + 'echo "status=${PIPESTATUS[0]}"'
    )
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    done = subprocess.run(
        ["bash", "-c", shell], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert "status=141" in done.stdout, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "failed" not in done.stderr and "Exception" not in done.stderr
    assert (tmp_path / "s" / "manifest.json").is_file()


def test_a_broken_pipe_other_than_stdout_is_a_failure(monkeypatch, capsys):
    import t1jax.data.tasks_cli as tasks_cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a sandbox's socket, not the reader of stdout

    monkeypatch.setattr(tasks_cli, "run", broken)
    assert cli.main(["tasks", "generate", "--out", "x", "--n", "3"]) == cli.EXIT_FAILURE
    assert "failed: BrokenPipeError" in capsys.readouterr().err
