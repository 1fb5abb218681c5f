"""`t1jax eval` on multi-step Harbor tasks, on the local backend: the oracle plays each step's
reference solution; a copy of the task whose middle step's solution does nothing fails exactly
that step. Each trial's result.json records every step (Harbor's `step_results` and ours,
`steps`), the per-step verifier files sit in Harbor's `steps/<name>/verifier/`, the trial's
reward is Harbor's mean over the steps, and a rescore replays the same steps to the same
rewards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from t1jax.cli import main

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "tests" / "data" / "multi_step_tasks" / "three-steps"


def broken_middle_copy(tasks: Path) -> None:
    """The three-step task, renamed, with a middle step whose reference solution does nothing."""
    copy = tasks / "broken-middle"
    shutil.copytree(TASK, copy)
    toml = copy / "task.toml"
    toml.write_text(toml.read_text().replace("multistep/three-steps", "multistep/broken-middle"))
    (copy / "steps" / "02-count" / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")


def test_eval_records_each_step_and_scores_the_trial_as_harbor(tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(TASK, tasks / "three-steps")
    broken_middle_copy(tasks)
    out = tmp_path / "job"
    args = ["eval", "--tasks", str(tasks), "--out", str(out), "--no-progress", "--agent", "oracle"]
    assert main([*args, "--attempts", "1", "--concurrency", "2"]) == 0
    job = json.loads((out / "result.json").read_text())
    assert job["n_trials"] == 2 and job["n_errors"] == 0
    assert job["mean_reward"] == pytest.approx((1 + 2 / 3) / 2, abs=1e-3)
    assert job["resolved_rate"] == 0.5

    good = json.loads((out / "multistep-three-steps__attempt-1" / "result.json").read_text())
    assert good["reward"] == 1.0 and good["resolved"] and good["multi_step_reward"] == "mean"
    assert [s["step"] for s in good["steps"]] == ["01-write", "02-count", "03-finish"]
    assert all(
        s["resolved"] and s["agent_status"] == "completed" and s["failure"] is None for s in good["steps"]
    )
    assert [r["step_name"] for r in good["step_results"]] == ["01-write", "02-count", "03-finish"]
    assert [r["verifier_result"] for r in good["step_results"]] == [{"rewards": {"reward": 1.0}}] * 3
    assert good["verifier_result"] == {"rewards": {"reward": 1.0}}

    bad_dir = out / "multistep-broken-middle__attempt-1"
    bad = json.loads((bad_dir / "result.json").read_text())
    assert [s["rewards"] for s in bad["steps"]] == [{"reward": 1.0}, {"reward": 0.0}, {"reward": 1.0}]
    assert [s["resolved"] for s in bad["steps"]] == [True, False, True]
    assert bad["steps"][1]["tests_passed"] == 1 and bad["steps"][1]["tests_total"] == 2
    assert bad["reward"] == pytest.approx(2 / 3) and not bad["resolved"]
    assert bad["verifier_result"]["rewards"]["reward"] == pytest.approx(2 / 3)
    assert bad["tests_passed"] == 4 and bad["tests_total"] == 5  # every step's assertions, named by step
    failed = [a["name"] for a in bad["verifier_report"]["assertions"] if not a["passed"]]
    assert (
        len(failed) == 1 and failed[0].startswith("02-count::") and failed[0].endswith("test_count_is_three")
    )
    # Harbor's per-step layout: steps/<name>/verifier/
    for name, reward in (("01-write", "1"), ("02-count", "0"), ("03-finish", "1")):
        verifier = bad_dir / "steps" / name / "verifier"
        assert (verifier / "reward.txt").read_text().strip() == reward
        assert json.loads((verifier / "report.json").read_text())["parsed"] is True
    assert (bad_dir / "verifier" / "reward.txt").read_text().strip() == f"{2 / 3:g}"

    # A rescore types the recorded replies into fresh sandboxes through the same harness: the same
    # steps are verified again, to the same rewards.
    rescored = tmp_path / "rescored"
    assert main(["eval", "--rescore", str(out), "--out", str(rescored), "--no-progress"]) == 0
    again = json.loads((rescored / "multistep-broken-middle__attempt-1" / "result.json").read_text())
    assert [s["rewards"] for s in again["steps"]] == [s["rewards"] for s in bad["steps"]]
    assert again["reward"] == pytest.approx(2 / 3)
