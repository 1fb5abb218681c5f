"""Steps of generated tasks done in an evaluation, grouped by the mistakes each step offers.

A task of the generated suite (`t1jax.data.suite`) is 1-3 numbered steps; each step's tests are
named after it (`test_step{N}_{check}`) and the task's `solution/plan.json` lists the mistakes
the step offers the demonstrator (`sed` without `-i`, a script without `chmod +x`, ...). Counting,
over an evaluation job's trials, the steps done among those offering each named mistake says
*what* a policy does differently, where the resolved rate says only how often it finishes: the
demo's summary counts the demonstrator's habits this way, so a reader sees the SFT policy copy them
and RL teach them away on held-out tasks.

Invariants:
- A step is done when its trial's verifier reported every test of that step, and each passed; a
  trial whose verifier reported none of them (an infrastructure error, a verifier timeout) did
  none of its steps. Skipped trials are left out, as in every other rate of a job.
- A step offering several of the named mistakes counts under each of them and once under
  `ANY_NAMED`; `OTHER_STEPS` counts the steps offering none, so `ANY_NAMED` + `OTHER_STEPS` counts
  every step of every planned task exactly once.
- Tasks without a plan (not written by `t1jax tasks generate`) are left out: a job of only such
  tasks offers no steps, and every count is 0 of 0.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from t1jax.data.suite import PLAN_FILE, step_of_test
from t1jax.eval.job import task_of, verifier_report_of

ANY_NAMED = "any of them"
OTHER_STEPS = "other steps"


@dataclass(frozen=True)
class StepCount:
    """`done` of `offered` steps (a task evaluated k times offers its steps k times)."""

    done: int
    offered: int

    def to_json(self) -> dict[str, int]:
        return {"done": self.done, "offered": self.offered}


def task_plans(tasks_dir: str | Path) -> dict[str, dict]:
    """Task id -> plan of every generated task directly under `tasks_dir` (TASK/solution/plan.json;
    the plan names its task as the task's own id, `[task] name`)."""
    plans = {}
    for path in sorted(Path(tasks_dir).glob(f"*/solution/{PLAN_FILE}")):
        plan = json.loads(path.read_text())
        plans[plan["task_id"]] = plan
    return plans


def steps_by_mistake(
    results: Iterable[Mapping[str, Any]], plans: Mapping[str, dict], mistakes: Sequence[str]
) -> dict[str, StepCount]:
    """For each name in `mistakes` (then `ANY_NAMED`, then `OTHER_STEPS`): the steps done of those
    offering it, over the trials' results (`t1jax.eval.job.trial_results`) of the tasks in `plans`."""
    counts = {name: [0, 0] for name in (*mistakes, ANY_NAMED, OTHER_STEPS)}
    for result in results:
        plan = plans.get(task_of(result))
        if result["skipped"] or plan is None:
            continue
        outcomes: dict[int, list[bool]] = defaultdict(list)
        for assertion in (verifier_report_of(result) or {}).get("assertions", ()):
            number = step_of_test(assertion["name"])
            if number is not None:
                outcomes[number].append(bool(assertion["passed"]))
        for step in plan["steps"]:
            done = bool(outcomes[step["number"]]) and all(outcomes[step["number"]])
            offered = {mistake["name"] for mistake in step["mistakes"]}
            named = [name for name in mistakes if name in offered]
            for name in [*named, ANY_NAMED] if named else [OTHER_STEPS]:
                counts[name][0] += done
                counts[name][1] += 1
    return {name: StepCount(done, offered) for name, (done, offered) in counts.items()}
