"""`harbor run` itself (Harbor 0.26.0's command line, job runner, trial, verifier and models)
driving t1jax: the t1jax environment under Harbor's oracle agent (the bundled tasks resolve; a
task whose solution fakes its verification is caught), and the t1jax agent in its oracle mode
and with a tiny random checkpoint behind the JAX engine, in t1jax's own venv (`T1JAX_PYTHON`)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from harbor.models.job.result import JobResult
from harbor.models.trajectories.trajectory import Trajectory
from harbor.models.trial.result import TrialResult

from t1jax.harbor.atif import EXTENSION

REPO = Path(__file__).resolve().parents[2]
HARBOR_TASKS = REPO / "tests" / "data" / "tasks" / "harbor"
ENVIRONMENT = "t1jax.harbor.environment:T1jaxEnvironment"


def t1jax_python() -> str:  # the project's venv, as conftest.py's `t1jax` runs it
    return os.environ.get("T1JAX_PYTHON", str(REPO / ".venv" / "bin" / "python"))
AGENT = "t1jax.harbor.agent:T1jaxAgent"


def harbor_run(jobs: Path, name: str, *args: str, timeout: float = 600) -> tuple[JobResult, dict[str, TrialResult]]:
    """`harbor run ARGS` into jobs/name; the job's result and its trials' results, read by
    Harbor's own models."""
    harbor = Path(sys.executable).parent / "harbor"
    env = {**os.environ, "T1JAX_PYTHON": t1jax_python(),
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8")}  # fmt: skip
    done = subprocess.run(
        [str(harbor), "run", *args, "-o", str(jobs), "--job-name", name, "-y", "-q"],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"harbor run exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    job = jobs / name
    result = JobResult.model_validate_json((job / "result.json").read_text())
    trials = {}
    for directory in sorted(p for p in job.iterdir() if (p / "result.json").exists()):
        trial = TrialResult.model_validate_json((directory / "result.json").read_text())
        trials[trial.task_name] = trial
    return result, trials


def reward(trial: TrialResult) -> float | None:
    return None if trial.verifier_result is None else trial.verifier_result.rewards["reward"]


def trial_dir(jobs: Path, name: str, task: str) -> Path:
    (directory,) = [p for p in (jobs / name).iterdir() if p.name.startswith(task.split("/")[-1] + "__")]
    return directory


def test_harbor_oracle_resolves_the_bundled_tasks_in_the_t1jax_environment(tmp_path):
    result, trials = harbor_run(tmp_path, "oracle", "-p", str(HARBOR_TASKS), "-a", "oracle", "-e", ENVIRONMENT,
                                "-n", "3")  # fmt: skip
    names = {p.name for p in HARBOR_TASKS.iterdir()}
    assert {name.split("/")[-1] for name in trials} == names and result.n_total_trials == len(names)
    assert {name: reward(t) for name, t in trials.items()} == {name: 1.0 for name in trials}
    assert all(t.exception_info is None for t in trials.values())
    for name in trials:  # the rewards are our verifier's: its per-assertion report came back with them
        verifier = trial_dir(tmp_path, "oracle", name) / "verifier"
        report = json.loads((verifier / "report.json").read_text())
        assert report["parsed"] and report["assertions"] and all(a["passed"] for a in report["assertions"])
        assert (verifier / "reward.txt").read_text() == "1\n"


# A solution that does not do the task but fakes its verification: a `pytest` first on PATH that
# passes everything, and a daemon that keeps a reward file of 1 in /logs/verifier (Harbor's
# verifier deletes the reward files before the test runs; the daemon writes them again).
_TAMPER = textwrap.dedent(
    """\
    #!/bin/bash
    mkdir -p /usr/local/bin /logs/verifier
    printf '#!/bin/sh\\necho "2 passed"\\nexit 0\\n' > /usr/local/bin/pytest
    chmod 755 /usr/local/bin/pytest
    setsid sh -c 'while true; do mkdir -p /logs/verifier; echo "{\\"reward\\": 1}" > /logs/verifier/reward.json; sleep 0.05; done' > /dev/null 2>&1 < /dev/null &
    """
)


@pytest.fixture
def tamper_task(tmp_path) -> Path:
    task = tmp_path / "tasks" / "tamper"
    shutil.copytree(HARBOR_TASKS / "hello-world", task)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace('name = "t1jax/hello-world"', 'name = "t1jax/tamper"'))
    (task / "solution" / "solve.sh").write_text(_TAMPER)
    return task


def test_the_tamper_works_where_the_tests_run_in_the_agents_sandbox(tamper_task):
    """Positive control: Harbor's verifier protocol carried out literally in the agent's sandbox
    (tests copied to /tests, the reward files deleted, test.sh run, the reward file read) is
    fooled by the tampering solution: the reward it reads is 1 for a task not done."""
    from sandbox_service.providers import ProviderSettings, open_provider
    from sandbox_service.solution import solution_commands
    from sandbox_service.tasks import load_task

    task = load_task(tamper_task)
    sandbox = open_provider(ProviderSettings(backend="local")).create(task, run_id="harbor-tamper-control")
    try:
        for line in solution_commands(task):
            assert sandbox.exec(line, 60).exit_code == 0
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            tar.add(tamper_task / "tests", arcname=".")
        tests = base64.b64encode(archive.getvalue()).decode()
        script = (f"mkdir -p /tests && echo {tests} | base64 -d | tar -xz -C /tests && "
                  "rm -f /logs/verifier/reward.txt /logs/verifier/reward.json && "
                  "(/tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1; sleep 0.3; "
                  "cat /logs/verifier/reward.json /logs/verifier/reward.txt; test -e /app/hello.txt || echo NOT-DONE")  # fmt: skip
        out = sandbox.exec(script, 120).stdout
    finally:
        sandbox.close()
    # Harbor reads reward.json first: 1; test.sh, fooled by the fake pytest, wrote 1 as well
    assert out.splitlines() == ['{"reward": 1}', "1", "NOT-DONE"]


def test_a_tampering_solution_is_caught_through_the_t1jax_environment(tmp_path, tamper_task):
    _, trials = harbor_run(tmp_path, "tamper", "-p", str(tamper_task), "-a", "oracle", "-e", ENVIRONMENT)
    (trial,) = trials.values()
    assert trial.exception_info is None and reward(trial) == 0.0
    verifier = trial_dir(tmp_path, "tamper", "tamper") / "verifier"
    report = json.loads((verifier / "report.json").read_text())
    # the task's own tests ran under our verifier's toolchain: both failed, nothing faked counted
    assert report["parsed"] and [a["passed"] for a in report["assertions"]] == [False, False]
    assert not (verifier / "reward.json").exists()


def _trajectories(jobs: Path, name: str) -> dict[str, Trajectory]:
    out = {}
    for path in sorted((jobs / name).glob("*/agent/trajectory.json")):
        out[path.parent.parent.name.split("__")[0]] = Trajectory.model_validate_json(path.read_text())
    return out


def test_the_t1jax_agent_in_oracle_mode_resolves_the_bundled_tasks(tmp_path):
    result, trials = harbor_run(tmp_path, "agent-oracle", "-p", str(HARBOR_TASKS), "-a", AGENT,
                                "--ak", "mode=oracle", "-e", ENVIRONMENT, "-n", "3")  # fmt: skip
    assert {name: reward(t) for name, t in trials.items()} == {name: 1.0 for name in trials} and len(trials) == 3
    for trial in trials.values():
        assert trial.agent_info.name == "t1jax" and trial.exception_info is None
        summary = trial.agent_result.metadata["t1jax"]
        assert summary["status"] == "completed" and summary["detail"] == "task_complete confirmed"
        assert trial.agent_result.n_input_tokens > 0 and trial.agent_result.n_output_tokens > 0
    trajectories = _trajectories(tmp_path, "agent-oracle")
    assert set(trajectories) == {p.name for p in HARBOR_TASKS.iterdir()}
    for trajectory in trajectories.values():
        extension = trajectory.extra["t1jax"]
        assert extension["extension"] == EXTENSION and extension["status"] == "completed"
        # the oracle's first reply types the reference solution into the terminal (tmux, as in t1jax eval)
        first = next(step for step in trajectory.steps if step.source == "agent")
        assert "<function=shell>" in first.message


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random tiny Qwen3.5-MoE in bfloat16, written by t1jax in its own venv."""
    directory = tmp_path_factory.mktemp("ckpt") / "tiny"
    code = (
        "import sys, jax.numpy as jnp; from flax import nnx; "
        "from t1jax.model import Qwen35MoeForCausalLM, load_config, save_pretrained; "
        "config = load_config('configs/tiny_cpu.yaml'); "
        "model = Qwen35MoeForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(2)); "
        "save_pretrained(model, sys.argv[1])"
    )
    subprocess.run([t1jax_python(), "-c", code, str(directory)], cwd=REPO, check=True, timeout=600)
    return directory


def test_the_t1jax_agent_evaluates_a_checkpoint_through_the_engine(tmp_path, tiny_checkpoint):
    result, trials = harbor_run(
        tmp_path, "agent-model", "-p", str(HARBOR_TASKS), "-i", "hello-world", "-i", "sales-report",
        "-a", AGENT, "-m", str(tiny_checkpoint), "--ak", "max_turns=1", "--ak", "max_tokens_per_turn=16",
        "--ak", "context_window=1024", "--ak", "prompt_profile=compact", "--ak", "concurrency=2",
        "-e", ENVIRONMENT, "-n", "2",
    )  # fmt: skip
    # a random policy resolves nothing, but both trials ran the harness to its turn limit
    assert sorted(name.split("/")[-1] for name in trials) == ["hello-world", "sales-report"]
    assert all(t.exception_info is None and reward(t) == 0.0 for t in trials.values())
    for trial in trials.values():
        assert trial.agent_result.metadata["t1jax"]["status"] == "max_turns"
        assert trial.agent_info.model_info.name == "tiny"
    for trajectory in _trajectories(tmp_path, "agent-model").values():
        (turn,) = [step for step in trajectory.steps if step.source == "agent"]
        assert len(turn.metrics.completion_token_ids) == len(turn.metrics.logprobs) > 0
        assert trajectory.extra["t1jax"]["policy_versions"] == [0]


def test_a_checkpoint_that_is_not_there_is_one_line_in_the_trial(tmp_path):
    _, trials = harbor_run(tmp_path, "missing", "-p", str(HARBOR_TASKS / "hello-world"), "-a", AGENT,
                           "-m", str(tmp_path / "no-such-checkpoint"), "-e", ENVIRONMENT)  # fmt: skip
    (trial,) = trials.values()
    assert trial.exception_info is not None and trial.exception_info.exception_type == "WorkerError"
    message = trial.exception_info.exception_message
    assert "no-such-checkpoint" in message and len(message.splitlines()) == 1
