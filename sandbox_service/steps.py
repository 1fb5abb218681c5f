"""Multi-step Harbor tasks: each step's view of the task, what runs before a step, when a trial
stops, and the trial's reward, as Harbor defines them.

This module owns the semantics of `Task.steps` (Harbor's `[[steps]]` and `steps/<name>/`; read
from Harbor's `MultiStepTrial` and `TaskConfig`): a trial runs the steps in order in one sandbox
(files and processes carried over); before step i the files of `steps/<name>/workdir/` are put in
the workdir and its `setup.sh` run (`setup_commands`); the agent gets the step's instruction; the
step's verifier runs (`Sandbox.verify`, on `step_view(task, i)`: its tests, its deadlines, the
same integrity rules as a one-step task); the trial stops early when the step's reward is below
its `min_reward` or its verification produced no result (`stops_after`). The trial's reward is
`trial_reward`: "mean" (Harbor's default) is the mean of each reward key over the steps that
produced a verifier result (a key a step lacks counts 0), "final" the last step's.
`combined_report` folds the per-step reports into one `VerifierReport` (assertions named
`<step>::<test>`, the trial's reward) for callers that score a trial by one report.

Invariants:
- `step_view(task, i)` is a one-step `Task` (no `steps`) with step i's instruction, tests,
  solution, deadlines and verifier environment; `step_view(task, 0)` of a multi-step task has the
  task's own instruction and tests (the loader makes the task its first step's view).
- A step's reward is its report's reward value when the verifier wrote one, else 1.0 / 0.0 from
  its binary outcome, else None (no result: the step counts in no mean).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from sandbox_service.contracts import AssertionResult, FailureCause, Task, VerifierReport
from sandbox_service.solution import archive_lines

STEP_ARCHIVE = "/tmp/.t1jax-step.b64"


def step_count(task: Task) -> int:
    """How many times the agent acts and the verifier runs in a trial of `task` (1 without steps)."""
    return max(1, len(task.steps))


def step_view(task: Task, index: int) -> Task:
    """Step `index` of `task` as a one-step task (see the module docstring); `task` itself when it
    has no steps (index 0)."""
    if not task.steps:
        if index != 0:
            raise IndexError(f"task {task.task_id!r} has one step, not {index + 1}")
        return task
    step = task.steps[index]
    return dataclasses.replace(
        task,
        instruction=step.instruction,
        tests_dir=step.tests_dir,
        tests_layers=step.tests_layers,
        test_script=Path("test.sh"),
        solution_script=step.solution_script,
        limits=step.limits,
        verifier_env={**task.verifier_env, **step.verifier_env},
        steps=(),
    )


def step_name(task: Task, index: int) -> str:
    return task.steps[index].name if task.steps else "main"


def setup_commands(task: Task, index: int, *, workdir: str) -> list[str]:
    """Shell lines (as `solution_commands`'s: each complete, under 1200 characters) that put step
    `index`'s `workdir/` files into `workdir` and run its `setup.sh` there, as Harbor does before
    the step's agent; [] when the step has none. The last line's status is the setup's."""
    step = task.steps[index] if task.steps else None
    if step is None or step.workdir_dir is None or not step.workdir_dir.is_dir():
        return []
    quoted = shlex.quote(workdir)
    lines = archive_lines(step.workdir_dir, STEP_ARCHIVE)
    unpack = f"mkdir -p {quoted} && base64 -d {STEP_ARCHIVE} | tar -xzf - -C {quoted} --no-same-owner"
    unpack += f" && rm -f {STEP_ARCHIVE}"
    if (step.workdir_dir / "setup.sh").is_file():
        unpack += f" && cd {quoted} && bash {shlex.quote(workdir.rstrip('/') + '/setup.sh')}"
    return [*lines, unpack]


def step_rewards(report: VerifierReport) -> dict[str, float] | None:
    """The step's rewards as Harbor keys them ({"reward": r}), or None when it produced no result."""
    if report.reward_value is not None:
        return {"reward": float(report.reward_value)}
    if report.binary_outcome is not None:
        return {"reward": 1.0 if report.binary_outcome else 0.0}
    return None


def stops_after(task: Task, index: int, report: VerifierReport) -> bool:
    """Whether the trial ends after step `index` (Harbor: no verifier result, or a reward below the
    step's `min_reward`; a missing gated key counts as -inf). Always True after the last step."""
    if index + 1 >= step_count(task):
        return True
    rewards = step_rewards(report)
    if rewards is None:
        return True
    threshold = task.steps[index].min_reward
    if threshold is None:
        return False
    gates = {"reward": float(threshold)} if isinstance(threshold, int | float) else dict(threshold)
    return any(rewards.get(key, float("-inf")) < float(value) for key, value in gates.items())


def trial_reward(task: Task, reports: Sequence[VerifierReport]) -> dict[str, float] | None:
    """The trial's rewards from its steps' reports, in step order (see the module docstring)."""
    if not reports:
        return None
    if task.multi_step_reward == "final":
        return step_rewards(reports[-1])
    verified = [rewards for rewards in map(step_rewards, reports) if rewards is not None]
    if not verified:
        return None
    keys = sorted({key for rewards in verified for key in rewards})
    return {key: sum(rewards.get(key, 0.0) for rewards in verified) / len(verified) for key in keys}


def combined_report(task: Task, reports: Sequence[VerifierReport]) -> VerifierReport:
    """One report for the whole trial: every step's assertions (`<step>::<name>`), one failed
    assertion `<step>::(not run)` for each step a trial that stopped early never reached, parsed
    only if every step's report was, passed (`binary_outcome`) only if every step ran and passed,
    and the trial's reward (`trial_reward`'s "reward")."""
    if not task.steps:
        return reports[0]
    assertions = [
        AssertionResult(f"{step_name(task, i)}::{a.name}", a.passed)
        for i, report in enumerate(reports)
        for a in report.assertions
    ]
    assertions += [AssertionResult(f"{step.name}::(not run)", False) for step in task.steps[len(reports) :]]
    outcomes = [report.binary_outcome for report in reports]
    binary = None if None in outcomes else (len(reports) == len(task.steps) and all(outcomes))
    details = "; ".join(f"{step_name(task, i)}: {r.detail}" for i, r in enumerate(reports) if r.detail)
    if len(reports) < len(task.steps):
        details = f"stopped after step {len(reports)} of {len(task.steps)}; {details}"
    return VerifierReport(
        assertions=tuple(assertions),
        parsed=bool(reports) and all(report.parsed for report in reports),
        failure_cause=next((r.failure_cause for r in reports if r.failure_cause != FailureCause.NONE),
                           FailureCause.NONE),
        binary_outcome=binary,
        reward_value=(trial_reward(task, reports) or {}).get("reward"),
        detail=details,
        output_tail=reports[-1].output_tail if reports else "",
    )  # fmt: skip


def per_step_json(task: Task, reports: Sequence[VerifierReport]) -> list[Mapping]:
    """One JSON object a step: its name, rewards, passed / total and failure cause."""
    return [
        {
            "step": step_name(task, i),
            "rewards": step_rewards(report),
            "passed": report.passed,
            "total": report.total,
            "parsed": report.parsed,
            "failure_cause": report.failure_cause.value,
            "detail": report.detail,
        }
        for i, report in enumerate(reports)
    ]
