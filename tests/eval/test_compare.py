"""`t1jax compare`: the paired difference of two real evaluation jobs (the oracle, which resolves
every task, against the no-op agent, which resolves none: +1 with an interval of exactly [1, 1],
and -1 reversed the other way), the share of tests passed per trial by hand, the demo's verdict
records, and one-line errors for bad input. The bootstrap itself is tested in test_eval.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from t1jax.cli import main
from t1jax.eval.compare import JobOutcomes, compare_jobs, per_family_subsamples, pool_comparisons

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
    cases = [  # (what the one line says, argv): the same message may answer several inputs
        ("no such job directory", ["compare", str(job), "--against", str(tmp_path / "missing")]),
        ("no trial results", ["compare", str(tmp_path / "empty"), "--against", str(job)]),
        ("share no evaluated task", ["compare", str(other), "--against", str(job)]),
        ("--against takes one job (2 given)", ["compare", str(job), "--against", str(job), str(other)]),
        ("give as many of each, at least 2 (1 jobs, 2 bases)",
         ["compare", "--pool", str(job), "--against", str(job), str(other)]),
        ("--pool pairs the k-th JOB", ["compare", "--pool", str(job), "--against", str(job)]),
        ("share no evaluated task",
         ["compare", "--pool", str(job), str(other), "--against", str(job), str(job)]),
        ("--per-family takes one JOB and one BASE", ["compare", str(job), str(other), "--against", str(job),
                                                     "--per-family", "1"]),
        ("--per-family takes one JOB and one BASE",
         ["compare", "--pool", str(job), str(other), "--against", str(job), str(job), "--per-family", "1"]),
        ("--per-family and --draws take integers >= 1", ["compare", str(job), "--against", str(job),
                                                          "--per-family", "0"]),
        ("--per-family and --draws take integers >= 1", ["compare", str(job), "--against", str(job),
                                                          "--per-family", "2", "--draws", "0"]),
    ]  # fmt: skip
    for message, argv in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err


def write_family_trials(job: Path, resolved: dict[str, int], families: dict[str, str]) -> JobOutcomes:
    """A job of one trial per task, each naming its family (as `t1jax eval` records it)."""
    for index, (task, hit) in enumerate(resolved.items()):
        trial = job / f"t{index}"
        trial.mkdir(parents=True)
        (trial / "result.json").write_text(json.dumps(
            {"task_id": task, "family": families[task], "skipped": False, "resolved": hit,
             "tests_passed": hit, "tests_total": 1}))  # fmt: skip
    return JobOutcomes(job)


def test_pooling_pairs_each_job_with_its_own_base_and_resamples_families_across_pairs(tmp_path):
    """By hand: under seed 0, RL - SFT is +1 on task a and 0 on b; under seed 1, +1 on both: the
    pooled mean is 3/4 over 4 paired tasks, and a's two outcomes are one family, b's another."""
    families = {"a": "f", "b": "g"}
    pairs = [
        (write_family_trials(tmp_path / "rl0", {"a": 1, "b": 0}, families),
         write_family_trials(tmp_path / "sft0", {"a": 0, "b": 0}, families)),
        (write_family_trials(tmp_path / "rl1", {"a": 1, "b": 1}, families),
         write_family_trials(tmp_path / "sft1", {"a": 0, "b": 0}, families)),
    ]  # fmt: skip
    resolved = pool_comparisons(pairs)["resolved"]
    assert resolved.difference == pytest.approx(3 / 4)
    assert (resolved.tasks, resolved.resampled) == (4, "2 families")


def test_pooled_seeds_add_evidence_per_family_not_families(tmp_path):
    """RL resolves the one task of family a that SFT fails, under each of 10 seeds; families b, c, d
    do not move. Counting each seed's a as a unit of its own (40 units, 10 of them a) would call
    that beyond the noise (no a among 40 draws: p = 0.75^40 < 0.01%), but it is one family of four
    (no a among 4 draws: p = 32%), so the interval reaches 0; and it is +1 beyond the noise when
    every family moves."""
    families = {task: task for task in "abcd"}
    one_family = [
        (write_family_trials(tmp_path / f"rl{seed}", {"a": 1, "b": 0, "c": 0, "d": 0}, families),
         write_family_trials(tmp_path / f"sft{seed}", dict.fromkeys("abcd", 0), families))
        for seed in range(10)
    ]  # fmt: skip
    resolved = pool_comparisons(one_family)["resolved"]
    assert resolved.difference == pytest.approx(1 / 4) and resolved.low == 0.0 and not resolved.beyond_noise
    assert (resolved.tasks, resolved.resampled) == (40, "4 families")

    every_family = [
        (write_family_trials(tmp_path / f"all{seed}", dict.fromkeys("abcd", 1), families), sft)
        for seed, (_, sft) in enumerate(one_family[:2])
    ]
    resolved = pool_comparisons(every_family)["resolved"]
    assert (resolved.difference, resolved.low, resolved.high) == (1.0, 1.0, 1.0) and resolved.beyond_noise


def test_pool_on_the_command_line(tmp_path, capsys):
    families = {"a": "f", "b": "g"}
    rl = [write_family_trials(tmp_path / f"rl{s}", {"a": 1, "b": 1}, families).path for s in range(2)]
    sft = [write_family_trials(tmp_path / f"sft{s}", {"a": 0, "b": 0}, families).path for s in range(2)]
    assert main(["compare", "--pool", *map(str, rl), "--against", *map(str, sft), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["against"] for p in report["pairs"]] == [str(p) for p in sft]
    assert (report["tasks"], report["resampled"]) == (4, "2 families")
    assert report["differences"]["resolved"] == {
        "difference": 1.0, "ci95": [1.0, 1.0], "beyond_noise": True, "verdict": "beyond the noise"
    }  # fmt: skip
    assert main(["compare", "--pool", *map(str, rl), "--against", *map(str, sft)]) == 0
    printed = capsys.readouterr().out
    assert "pooled over 2 pairs, 4 paired tasks, resampling 2 families:" in printed
    assert "resolved: +1.000 [+1.000, +1.000] beyond the noise" in printed


def test_at_most_k_tasks_a_family(tmp_path, capsys):
    """By hand: RL - SFT is +1 on both tasks of family f, 0 on both of g and on h's one. At most 1
    a family every draw keeps one task of each: +1/3 on 3 tasks in each of the 20 draws; at most 2
    keeps everything, one draw, which is `compare_jobs` to the digit."""
    families = {"a1": "f", "a2": "f", "b1": "g", "b2": "g", "c": "h"}
    rl = write_family_trials(tmp_path / "rl", {"a1": 1, "a2": 1, "b1": 0, "b2": 0, "c": 0}, families)
    sft = write_family_trials(tmp_path / "sft", dict.fromkeys(families, 0), families)
    one = per_family_subsamples(rl, sft, 1)
    assert (one.tasks, one.families, one.draws) == (3, 3, 20) and one.difference == pytest.approx(1 / 3)
    whole = compare_jobs(rl, sft)["resolved"]
    two = per_family_subsamples(rl, sft, 2, draws=20)
    assert (two.tasks, two.families, two.draws) == (5, 3, 1) and two.difference == pytest.approx(2 / 5)
    assert two.half_width == pytest.approx((whole.high - whole.low) / 2)
    assert two.beyond == int(whole.beyond_noise)

    argv = ["compare", str(rl.path), "--against", str(sft.path), "--per-family"]
    assert main([*argv, "1", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["metric"], r["per_family"], r["tasks"]) for r in report["per_family"]] == [
        ("resolved", 1, 3), ("tests_passed", 1, 3), ("resolved", 2, 5), ("tests_passed", 2, 5)
    ]  # fmt: skip
    assert main([*argv, "1"]) == 0
    assert "resolved, at most 1 a family (3 tasks, 3 families): +0.333" in capsys.readouterr().out
