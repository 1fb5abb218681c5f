"""Every task fixture (tests/data/tasks, the fidelity corpus, the malformed tasks) read by Harbor's
own task model (`harbor.models.task.task.Task`; a Terminal-Bench 1.x task first through Harbor's
own `TerminalBenchMapper`) and by `sandbox_service.tasks`, compared field by field: instruction,
agent and verifier timeouts, resources, internet, image and workdir, environment variables,
metadata, steps, the verifier's entry point. Where the two disagree on purpose the reason is in
docs/harbor.md ("Where the task loaders differ"), and the tables below hold each case, so a new
disagreement fails here."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest
from harbor.mappers.terminal_bench import TerminalBenchMapper
from harbor.models.task.config import NetworkMode
from harbor.models.task.task import Task as HarborTask

from sandbox_service.contracts import TaskLayout, TaskLimits
from sandbox_service.tasks import (
    DEFAULT_VERIFIER_TIMEOUT_SEC,
    TB1_DEFAULT_AGENT_TIMEOUT_SEC,
    TaskLoadError,
    load_task,
)

DATA = Path(__file__).resolve().parents[1] / "data"
ROOTS = ("tasks", "fidelity_tasks", "malformed_tasks")
OUR_ENVIRONMENT_DEFAULTS = {"cpus": 1.0, "memory_mb": 2048, "storage_mb": 10240, "gpus": 0}

# Tasks one loader accepts and the other rejects, and why (docs/harbor.md).
ONLY_HARBOR_LOADS = {
    "fidelity_tasks/harbor/compose-with-database": "several compose services: no backend here runs them",
    "malformed_tasks/empty-instruction": "an empty instruction is no task for RL",
    "malformed_tasks/negative-timeout": "Harbor does not check the sign of a timeout",
    "malformed_tasks/unknown-difficulty": "Harbor's metadata is free-form; ours is an enum",
}
ONLY_OURS_LOADS = {
    "tasks/terminal-bench-1/log-parsing": "Harbor's mapper needs a docker-compose.yaml; TB 1.x tasks "
    "may have only a Dockerfile",
}


def task_dirs() -> list[Path]:
    found = []
    for root in ROOTS:
        for marker in ("task.toml", "task.yaml"):
            for path in (DATA / root).rglob(marker):
                if "steps" not in path.relative_to(DATA / root).parts:
                    found.append(path.parent)
    return sorted(set(found))


def harbor_view(task_dir: Path, tmp_path: Path) -> HarborTask:
    """Harbor's reading of a task directory (a TB 1.x one mapped by Harbor first)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # allow_internet, memory = "2G"
        if (task_dir / "task.yaml").exists():
            return HarborTask(TerminalBenchMapper()._map_task(task_dir, tmp_path / task_dir.name))
        return HarborTask(task_dir)


def name_of(task_dir: Path) -> str:
    return str(task_dir.relative_to(DATA))


@pytest.mark.parametrize("task_dir", task_dirs(), ids=name_of)
def test_harbor_and_our_loader_read_the_same_task(task_dir, tmp_path):
    name = name_of(task_dir)
    try:
        ours = load_task(task_dir)
    except TaskLoadError as error:
        ours, our_error = None, error
    try:
        harbor = harbor_view(task_dir, tmp_path)
    except Exception as error:  # Harbor raises pydantic, TOML and file errors alike
        harbor, harbor_error = None, error
    if ours is None or harbor is None:
        if ours is None and harbor is None:
            return  # both reject it
        if harbor is None:
            assert name in ONLY_OURS_LOADS, f"only our loader accepts {name}: {harbor_error}"
        else:
            assert name in ONLY_HARBOR_LOADS, f"only Harbor accepts {name}: {our_error}"
        return
    assert name not in ONLY_HARBOR_LOADS and name not in ONLY_OURS_LOADS, f"{name} now loads in both"
    config = harbor.config
    raw = tomllib.loads(harbor.paths.config_path.read_text())
    tb1 = ours.layout is TaskLayout.TERMINAL_BENCH_1

    # instruction (Harbor strips a canary line; a multi-step task's is its first step's for us)
    if config.steps:
        assert (
            harbor.instruction == ""
            and ours.instruction.strip() == harbor.step_instruction(config.steps[0].name).strip()
        )
    else:
        assert harbor.instruction.strip() == ours.instruction.strip()

    # metadata
    difficulty = config.metadata.get("difficulty")
    if difficulty is not None:
        assert str(getattr(difficulty, "value", difficulty)) == ours.difficulty.value
    if "category" in config.metadata:
        assert config.metadata["category"] == ours.category
    if "tags" in config.metadata:
        assert tuple(config.metadata["tags"]) == ours.tags

    # timeouts: where the task sets one, the same; where it does not, each tool's own default
    # (ours: Harbor's agent default is none, so TaskLimits' 3600 s; the verifier 900 s, the paper's wall)
    step_limits = ours.steps[0].limits if ours.steps else ours.limits
    first = config.steps[0] if config.steps else None
    agent_timeout = (first.agent.timeout_sec if first else None) or config.agent.timeout_sec
    if agent_timeout is not None:
        assert step_limits.agent_timeout_sec == agent_timeout
    else:
        assert step_limits.agent_timeout_sec == (
            TB1_DEFAULT_AGENT_TIMEOUT_SEC if tb1 else TaskLimits().agent_timeout_sec
        )
    verifier_set = "timeout_sec" in raw.get("verifier", {}) or (
        first is not None and "timeout_sec" in raw["steps"][0].get("verifier", {})
    )
    verifier_timeout = (
        first.verifier.timeout_sec
        if first and "timeout_sec" in raw["steps"][0].get("verifier", {})
        else config.verifier.timeout_sec
    )
    if verifier_set:
        assert step_limits.verifier_timeout_sec == verifier_timeout
    else:
        assert step_limits.verifier_timeout_sec == DEFAULT_VERIFIER_TIMEOUT_SEC

    # resources: set ones agree; unset ones are Harbor's None ("the environment's") and our default
    environment = config.environment
    for field, default in OUR_ENVIRONMENT_DEFAULTS.items():
        value = getattr(environment, field)
        assert getattr(ours.environment, field) == (default if value is None else value), field
    # internet: Harbor's network mode, ours a boolean
    assert environment.network_mode in (NetworkMode.PUBLIC, NetworkMode.NO_NETWORK)
    assert ours.environment.allow_internet == (environment.network_mode is NetworkMode.PUBLIC)
    assert ours.environment.docker_image == environment.docker_image
    if environment.workdir is not None:
        assert ours.environment.workdir == environment.workdir
    else:  # Harbor leaves it to the image's WORKDIR; we read that from the Dockerfile (or /app)
        assert ours.environment.workdir_from in ("Dockerfile", "default")
    assert dict(ours.environment.env) == environment.env
    assert dict(ours.verifier_env) == config.verifier.env
    assert dict(ours.solution_env) == config.solution.env

    # the verifier's entry point
    if tb1:
        mapped = harbor.paths.test_path.read_text()
        assert mapped.startswith(
            (task_dir / ours.test_script).read_text().replace("$TEST_DIR", "/tests").rstrip("\n")
        )
    elif not config.steps:
        assert harbor.paths.discovered_test_path_for(environment.os) == ours.tests_dir / ours.test_script

    # steps
    assert [s.name for s in ours.steps] == [s.name for s in config.steps or []]
    if config.steps:
        strategy = config.multi_step_reward_strategy
        assert ours.multi_step_reward == ("mean" if strategy is None else strategy.value)
    for index, (step, theirs) in enumerate(zip(ours.steps, config.steps or [], strict=True)):
        assert step.instruction.strip() == harbor.step_instruction(theirs.name).strip()
        assert step.min_reward == theirs.min_reward
        agent = theirs.agent.timeout_sec or config.agent.timeout_sec
        assert step.limits.agent_timeout_sec == (TaskLimits().agent_timeout_sec if agent is None else agent)
        step_raw = raw["steps"][index].get("verifier", {})
        if "timeout_sec" in step_raw:
            assert step.limits.verifier_timeout_sec == theirs.verifier.timeout_sec
        elif "timeout_sec" in raw.get("verifier", {}):
            assert step.limits.verifier_timeout_sec == config.verifier.timeout_sec
        test = harbor.paths.discovered_step_test_path_for(theirs.name, environment.os) or (
            harbor.paths.discovered_test_path_for(environment.os)
        )
        assert test == step.tests_dir / "test.sh"


def test_the_fixtures_cover_both_layouts_steps_and_the_disagreements():
    names = {name_of(d) for d in task_dirs()}
    assert set(ONLY_HARBOR_LOADS) | set(ONLY_OURS_LOADS) <= names
    assert any("terminal-bench-1" in n for n in names) and "fidelity_tasks/harbor/multi-step" in names
