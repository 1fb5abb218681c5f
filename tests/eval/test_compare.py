"""`t1jax compare`: the paired difference of two real evaluation jobs (the oracle, which resolves
every task, against the no-op agent, which resolves none: +1 with an interval of exactly [1, 1],
and -1 reversed the other way), the share of tests passed per trial by hand, the demo's verdict
records, and one-line errors for bad input. The bootstrap itself is tested in test_eval.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from t1jax.cli import main
from t1jax.eval.compare import JobOutcomes, compare_jobs

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "tasks"
N_TASKS = 5


def write_trials(job: Path, trials) -> Path:
    """A job directory of hand-written trial results: (task, resolved, tests passed, tests total)."""
    for index, (task, resolved, passed, total) in enumerate(trials):
        trial = job / f"t{index}"
        trial.mkdir(parents=True)
        (trial / "result.json").write_text(json.dumps(
            {"task_id": task, "skipped": False, "resolved": resolved, "tests_passed": passed,
             "tests_total": total}))  # fmt: skip
    return job


def test_share_of_tests_passed_is_the_per_task_mean_of_each_trials_share(tmp_path):
    job = JobOutcomes(
        write_trials(tmp_path, [("a", 0, 1, 4), ("a", 0, 3, 4), ("b", 0, 0, 0), ("c", 1, 2, 2)])
    )
    assert job.tests_passed == {"a": [0.25, 0.75], "b": [0.0], "c": [1.0]}  # b: the verifier reported none
    assert job.rate("tests_passed") == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert job.rate("resolved") == pytest.approx(1 / 3)


def test_only_shared_tasks_are_paired(tmp_path):
    """By hand: shared tasks a (1 - 0) and b (0 - 0): +0.5; task c is in one job only."""
    job = JobOutcomes(write_trials(tmp_path / "job", [("a", 1, 2, 2), ("b", 0, 1, 2), ("c", 1, 2, 2)]))
    base = JobOutcomes(write_trials(tmp_path / "base", [("a", 0, 1, 2), ("b", 0, 1, 2)]))
    differences = compare_jobs(job, base)
    assert differences["resolved"].difference == pytest.approx(0.5) and differences["resolved"].tasks == 2
    assert differences["tests_passed"].difference == pytest.approx(0.25)
    assert differences["resolved"].resampled == "2 tasks"


def run_eval(out: Path, agent: str) -> Path:
    args = ["eval", "--tasks", str(TASKS), "--out", str(out), "--no-progress", "--agent", agent]
    assert main([*args, "--attempts", "1", "--concurrency", str(N_TASKS)]) == 0
    return out


@pytest.mark.sandbox
def test_the_oracle_beats_doing_nothing_beyond_the_noise(tmp_path, capsys):
    oracle, nop = run_eval(tmp_path / "oracle", "oracle"), run_eval(tmp_path / "nop", "nop")
    capsys.readouterr()
    assert main(["compare", str(oracle), "--against", str(nop), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [row] = report["jobs"]
    assert row["resolved"] == 1.0 and report["against"]["resolved"] == 0.0 and row["tasks"] == N_TASKS
    resolved = row["differences"]["resolved"]
    # every task's difference is +1, so every resample's mean is +1
    assert resolved == {
        "difference": 1.0,
        "ci95": [1.0, 1.0],
        "beyond_noise": True,
        "verdict": "beyond the noise",
    }
    tests = row["differences"]["tests_passed"]
    assert tests["difference"] == pytest.approx(row["tests_passed"] - report["against"]["tests_passed"])
    assert row["tests_passed"] == 1.0 and tests["beyond_noise"]

    differences = compare_jobs(JobOutcomes(nop), JobOutcomes(oracle))  # the other way round
    assert differences["resolved"].difference == -1.0 and differences["resolved"].reversed
    assert differences["resolved"].verdict == "reversed beyond the noise"

    assert main(["compare", str(oracle), str(nop), "--against", str(nop)]) == 0  # the table
    printed = capsys.readouterr().out
    assert "+1.000 [+1.000, +1.000] *" in printed and "+0.000 [+0.000, +0.000]" in printed
    assert f"resampling {N_TASKS} tasks" in printed


def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys):
    job = write_trials(tmp_path / "job", [("a", 1, 1, 1)])
    other = write_trials(tmp_path / "other", [("b", 1, 1, 1)])
    (tmp_path / "empty").mkdir()
    cases = {
        "no such job directory": ["compare", str(job), "--against", str(tmp_path / "missing")],
        "no trial results": ["compare", str(tmp_path / "empty"), "--against", str(job)],
        "share no evaluated task": ["compare", str(other), "--against", str(job)],
    }
    for message, argv in cases.items():
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err
