"""The one error contract of every command line (`sandbox_service.cli_contract`, docs/design.md
"The command-line contract"): bad input is exit 2 and exactly one line on stderr naming it, never
argparse's usage block nor a traceback; any other failure is exit 1, one line and a --debug hint.

Table-driven over every subcommand of `t1jax`, `python -m sandbox_service`, `python -m
t1jax.launch` and the project's other `python -m` entry points; each case fails before any real
work (most before jax is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_service.cli_contract import UsageError, checking_input, run_command

REPO = Path(__file__).resolve().parents[1]
T1JAX = (sys.executable, "-m", "t1jax.cli")
SERVICE = (sys.executable, "-m", "sandbox_service")
LAUNCH = (sys.executable, "-m", "t1jax.launch")
TINY = "configs/tiny_cpu.yaml"
RUN = "configs/runs/tiny_cpu.yaml"

# (command, what the one line must say)
BAD_INPUT = [
    ((*T1JAX,), "the following arguments are required: command"),
    ((*T1JAX, "frobnicate"), "invalid choice: 'frobnicate'"),
    ((*T1JAX, "plan"), "the following arguments are required: --config"),
    ((*T1JAX, "plan", "--config", TINY, "--devices", "8", "--pipeline", "0"),
     "--pipeline degrees must be >= 1"),
    ((*T1JAX, "plan", "--config", TINY, "--devices", "8", "--pipeline", "two"),
     "--pipeline takes comma-separated"),
    ((*T1JAX, "plan", "--config", TINY), "give --devices (or --plan)"),
    ((*T1JAX, "plan", "--config", "no/such.yaml", "--devices", "8"), "no/such.yaml"),
    ((*T1JAX, "eval"), "--tasks DIR is needed"),
    ((*T1JAX, "eval", "--tasks", "no/such", "--agent", "nop"), "--tasks no/such is not a directory"),
    ((*T1JAX, "eval", "--tasks", "tests/data/tasks", "--checkpoint", "no/such"),
     "checkpoint no/such does not exist"),
    ((*T1JAX, "compare", "no/job", "--against", "no/base"), "no such job directory"),
    ((*T1JAX, "train"), "one of the arguments --config --resume is required"),
    ((*T1JAX, "train", "--config", "no/such.yaml"), "no/such.yaml"),
    ((*T1JAX, "train", "--config", RUN, "--set", "run.stepz=3"), "stepz"),
    ((*T1JAX, "train", "--resume", "no/such/run"), "no/such/run"),
    ((*T1JAX, "demo", "--config", "no/such.yaml"), "demo config no/such.yaml does not exist"),
    ((*T1JAX, "tasks"), "the following arguments are required"),
    ((*T1JAX, "tasks", "generate", "--out", "{tmp}/suite", "--n", "1"), "at least 2 tasks"),
    ((*T1JAX, "tasks", "subset", "--suite", "no/suite", "--out", "{tmp}/subset",
      "--families-per-category", "1"), "no/suite"),
    ((*T1JAX, "sft", "--out", "{tmp}/sft"), "the following arguments are required: --config"),
    ((*T1JAX, "sft", "--config", "no/such.yaml", "--out", "{tmp}/sft"), "SFT config not found: no/such.yaml"),
    ((*T1JAX, "launch", "--config", "no/such.yaml", "--dry-run"), "no/such.yaml"),
    ((*T1JAX, "launch", "--config", RUN), "only --dry-run is implemented"),
    ((*SERVICE,), "the following arguments are required: command"),
    ((*SERVICE, "serve", "--port", "eighty"), "argument --port: invalid int value: 'eighty'"),
    ((*SERVICE, "check-tasks", "no/such"), "task directory not found: no/such"),
    ((*SERVICE, "reap", "--backend", "docker"), "argument --backend: invalid choice: 'docker'"),
    ((*SERVICE, "leak-check", "--run-id", "x"), "the following arguments are required: --url"),
    ((*SERVICE, "stand-ins", "--nope"), "unrecognized arguments: --nope"),
    ((*LAUNCH, "render"), "the following arguments are required: params"),
    ((*LAUNCH, "render", "no/such.yaml"), "no/such.yaml"),
    ((sys.executable, "-m", "t1jax.sft.pretrain", "--model", "no/such.yaml", "--out", "{tmp}/base"),
     "--model no/such.yaml does not exist"),
    ((sys.executable, "-m", "t1jax.launch.reaper"), "the following arguments are required"),
    ((sys.executable, "-m", "t1jax.agent.train_tokenizer", "--nope"), "unrecognized arguments: --nope"),
]  # fmt: skip


def _run(command, tmp_path, env=None) -> subprocess.CompletedProcess:
    argv = [part.replace("{tmp}", str(tmp_path)) for part in command]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})  # fmt: skip


@pytest.mark.parametrize(("command", "needle"), BAD_INPUT, ids=[" ".join(c[2:]) for c, _ in BAD_INPUT])
def test_bad_input_is_exit_2_and_one_line(tmp_path, command, needle):
    result = _run(command, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and ": error: " in lines[0] and needle in lines[0], result.stderr
    assert "usage:" not in result.stderr and "Traceback" not in result.stderr


def test_train_refuses_a_device_split_before_making_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    result = _run((*T1JAX, "train", "--config", RUN, "--run-dir", str(run_dir)), tmp_path,
                  env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})  # fmt: skip
    assert result.returncode == 2 and "the process sees 2" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not run_dir.exists()


def test_debug_shows_the_traceback_and_keeps_the_status(tmp_path):
    command = (*T1JAX, "--debug", "eval", "--tasks", "tests/data/tasks", "--checkpoint", "no/such")
    result = _run(command, tmp_path)
    assert result.returncode == 2 and "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("t1jax eval: error: checkpoint no/such")


# ---- the contract itself, in process -------------------------------------------------------------


def _fails_with(error: BaseException):
    def body() -> int:
        raise error

    return body


def test_a_value_error_at_work_is_a_failure_not_bad_input(capsys):
    assert run_command("prog", _fails_with(ValueError("nan in the loss")), debug=False) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line == "prog: failed: ValueError: nan in the loss (--debug shows the traceback)"


def test_a_usage_error_is_bad_input(capsys):
    assert run_command("prog", _fails_with(UsageError("--n must be >= 1\n got 0")), debug=False) == 2
    assert capsys.readouterr().err == "prog: error: --n must be >= 1 got 0\n"


def test_checking_input_makes_a_loaders_errors_bad_input_there_only(capsys):
    def loads() -> int:
        with checking_input():
            raise FileNotFoundError("no such config: x.yaml")

    assert run_command("prog", loads) == 2
    assert capsys.readouterr().err == "prog: error: no such config: x.yaml\n"
    with pytest.raises(KeyError):
        with checking_input():
            raise KeyError("not a ValueError nor an OSError: a bug")


def test_the_status_of_the_body_and_ctrl_c(capsys):
    assert run_command("prog", lambda: 0) == 0 and run_command("prog", lambda: 1) == 1
    assert run_command("prog", _fails_with(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "prog: interrupted\n"
