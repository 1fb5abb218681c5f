"""A multi-step job `t1jax eval` wrote, read by Harbor's own code: Harbor loads the bundled
multi-step task as one with steps (the same names and instructions we read), its `TrialResult`
accepts each trial's `step_results`, and Harbor's own multi-step reward selection over those
step results gives the reward we recorded, for the task's strategy and for the other one."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from harbor.models.task.config import MultiStepRewardStrategy, TaskConfig
from harbor.models.task.task import Task as HarborTask
from harbor.models.trajectories.trajectory import Trajectory
from harbor.models.trial.result import TrialResult
from harbor.trial.trial import Trial

from tests.harbor.conftest import REPO, t1jax

TASK = REPO / "tests" / "data" / "multi_step_tasks" / "three-steps"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """The oracle on the three-step task and on a copy whose middle step's solution does nothing."""
    tasks = tmp_path_factory.mktemp("multi-step-tasks")
    shutil.copytree(TASK, tasks / "three-steps")
    shutil.copytree(TASK, tasks / "broken-middle")
    toml = tasks / "broken-middle" / "task.toml"
    toml.write_text(toml.read_text().replace("multistep/three-steps", "multistep/broken-middle"))
    (tasks / "broken-middle" / "steps" / "02-count" / "solution" / "solve.sh").write_text(
        "#!/bin/bash\ntrue\n"
    )
    out = tmp_path_factory.mktemp("multi-step-job") / "job"
    t1jax("eval", "--tasks", str(tasks), "--agent", "oracle", "--attempts", "1", "--concurrency", "2",
          "--out", str(out), "--no-progress")  # fmt: skip
    return out


def harbor_reward(result: TrialResult, config: TaskConfig):
    """Harbor's `Trial._select_multi_step_reward` over `result.step_results`."""
    trial = SimpleNamespace(task=SimpleNamespace(config=config), result=result)
    trial._aggregate_step_rewards = functools.partial(Trial._aggregate_step_rewards, trial)
    return Trial._select_multi_step_reward(trial)


def test_harbor_reads_the_task_as_multi_step():
    task = HarborTask(TASK)
    assert task.has_steps
    assert [step.name for step in task.config.steps] == ["01-write", "02-count", "03-finish"]
    assert (
        task.step_instruction("02-count").strip()
        == (TASK / "steps/02-count/instruction.md").read_text().strip()
    )


def test_harbor_accepts_the_step_results_and_selects_the_reward_we_recorded(job):
    config = TaskConfig.model_validate_toml((TASK / "task.toml").read_text())
    final = config.model_copy(update={"multi_step_reward_strategy": MultiStepRewardStrategy.FINAL})
    seen = {}
    for directory in sorted(p for p in job.iterdir() if p.is_dir()):
        mine = json.loads((directory / "result.json").read_text())
        result = TrialResult.model_validate_json((directory / "result.json").read_text())
        assert [s.step_name for s in result.step_results] == ["01-write", "02-count", "03-finish"]
        assert all(s.verifier.started_at <= s.verifier.finished_at for s in result.step_results)
        assert result.reward_valid
        selected = harbor_reward(result, config)
        assert selected.rewards["reward"] == pytest.approx(mine["reward"])
        assert result.verifier_result.rewards["reward"] == pytest.approx(mine["reward"])
        seen[mine["task_name"]] = (
            [s.verifier_result.rewards["reward"] for s in result.step_results],
            harbor_reward(result, final).rewards["reward"],
        )
        # the whole conversation is one ATIF trajectory; each later step's instruction is the
        # observation fed back after the previous step's last reply
        trajectory = Trajectory.model_validate_json((directory / "agent" / "trajectory.json").read_text())
        fed_back = [
            r.content for step in trajectory.steps if step.observation for r in step.observation.results
        ]
        for name in ("02-count", "03-finish"):
            instruction = (TASK / "steps" / name / "instruction.md").read_text().strip()
            assert sum(instruction in text and "The previous step is over" in text for text in fed_back) == 1
    assert seen["multistep/three-steps"] == ([1, 1, 1], 1)
    assert seen["multistep/broken-middle"] == ([1, 0, 1], 1)  # "final": the last step's reward
