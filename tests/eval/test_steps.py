"""Steps of generated tasks done in an evaluation, by the mistakes they offer (`t1jax.eval.steps`):
the rules on hand-written results with hand-counted answers, then the real verifier's reports of
the oracle (every step done) and of the no-op agent (some step of every task not done) on
generated tasks in real sandboxes."""

from __future__ import annotations

import json
import shutil

import pytest

from t1jax.cli import main
from t1jax.data.suite import SuiteConfig, generate_suite, step_of_test
from t1jax.eval.job import task_of, trial_results
from t1jax.eval.steps import ANY_NAMED, OTHER_STEPS, StepCount, steps_by_mistake, task_plans


def step(number, *mistakes):
    return {"number": number, "mistakes": [{"name": name, "actions": ["x"]} for name in mistakes]}


def trial(task, passed=None, skipped=False):
    """A trial's result as `t1jax eval` writes it: `passed` maps test names to outcomes (None: the
    verifier reported nothing)."""
    if passed is None:
        return {"task_id": task, "skipped": skipped, "verifier": None}
    assertions = [{"name": name, "passed": ok} for name, ok in passed.items()]
    return {"task_id": task, "skipped": skipped, "verifier": {"assertions": assertions}}


def test_a_step_is_done_when_every_one_of_its_tests_passed():
    plans = {
        "t/a": {"steps": [step(1, "sed-without-i"), step(2, "no-chmod", "wc-prints-name"), step(3)]},
        "t/b": {"steps": [step(1, "no-chmod"), step(2, "overwrite")]},
    }
    results = [
        # step 1 done (both its tests), step 2 not (one of two failed), step 3 done
        trial("t/a", {"test_outputs::test_step1_runs": True, "test_outputs::test_step1_prints": True,
                      "test_outputs::test_step2_exists": True, "test_outputs::test_step2_counts": False,
                      "test_outputs::test_step3_done": True}),  # fmt: skip
        # the same task again: step 1's tests missing from the report, so not done; step 3 failed
        trial("t/a", {"test_step2_exists": True, "test_step2_counts": True, "test_step3_done": False}),
        trial("t/b", None),  # the verifier reported nothing: no step done
        trial("t/b", {"test_step1_x": True, "test_step2_y": True}, skipped=True),  # left out
        trial("t/elsewhere", {"test_step1_x": True}),  # no plan: left out
    ]
    counts = steps_by_mistake(results, plans, ["sed-without-i", "no-chmod", "wc-prints-name"])
    assert counts == {
        "sed-without-i": StepCount(1, 2),  # a1 done, then missing
        "no-chmod": StepCount(1, 3),  # a2 (failed, then done) and b1 (not reported)
        "wc-prints-name": StepCount(1, 2),  # the same step a2: it offers both
        ANY_NAMED: StepCount(2, 5),  # a1, a2 (each twice) and b1, each step once however many it offers
        OTHER_STEPS: StepCount(1, 3),  # a3 (done, then failed) and b2 ("overwrite" was not asked)
    }
    nothing = StepCount(0, 0)
    assert steps_by_mistake([], plans, ["no-chmod"]) == {"no-chmod": nothing, ANY_NAMED: nothing,
                                                     OTHER_STEPS: nothing}
    assert step_of_test("test_outputs::test_step12_exists") == 12 and step_of_test("test_step3_x") == 3
    assert step_of_test("test_outputs::test_hello") is None
    assert step_of_test("test_outputs::my_test_step1_x") is None


@pytest.mark.sandbox
def test_the_oracle_does_every_step_of_generated_tasks_and_doing_nothing_not(tmp_path):
    generate_suite(tmp_path / "suite", SuiteConfig(n=16, seed=4))
    tasks = tmp_path / "tasks"
    for directory in sorted((tmp_path / "suite" / "train").iterdir())[:4]:
        shutil.copytree(directory, tasks / directory.name)
    plans = task_plans(tasks)
    assert len(plans) == 4
    names = sorted({m["name"] for plan in plans.values() for s in plan["steps"] for m in s["mistakes"]})
    jobs = {}
    for agent in ("oracle", "nop"):
        jobs[agent] = tmp_path / agent
        args = ["eval", "--tasks", str(tasks), "--out", str(jobs[agent]), "--no-progress", "--agent", agent]
        assert main([*args, "--attempts", "1", "--concurrency", "4"]) == 0

    oracle = steps_by_mistake(trial_results(jobs["oracle"]), plans, names)
    all_steps = [s for plan in plans.values() for s in plan["steps"]]
    for name in names:  # each mistake is offered by as many steps as the plans say, all done
        offering = sum(any(m["name"] == name for m in s["mistakes"]) for s in all_steps)
        assert oracle[name] == StepCount(offering, offering), name
    unnamed = sum(not s["mistakes"] for s in all_steps)
    assert oracle[OTHER_STEPS] == StepCount(unnamed, unnamed)
    named = len(all_steps) - unnamed
    assert oracle[ANY_NAMED] == StepCount(named, named)

    # each task alone: the no-op agent leaves some step of every task undone (its tests fail some)
    nop = trial_results(jobs["nop"])
    for task_id, plan in plans.items():
        results = [r for r in nop if task_of(r) == task_id]
        counts = steps_by_mistake(results, {task_id: plan}, [])
        assert counts[OTHER_STEPS].offered == len(plan["steps"])
        assert counts[OTHER_STEPS].done < len(plan["steps"]), task_id
    assert json.loads((jobs["nop"] / "result.json").read_text())["resolved_rate"] == 0.0
