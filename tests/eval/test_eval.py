"""`t1jax eval`: pass@k against hand-computed values, the oracle and no-op agents on real tasks
(100% and 0%), a model checkpoint through the JAX engine, Harbor's job layout, kill + resume
reproducing the uninterrupted result, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from t1jax.checkpoints import checkpoint_dtype, resolve_checkpoint
from t1jax.cli import main
from t1jax.eval.passk import mean_pass_at_k, pass_at_k
from t1jax.model import Qwen35MoeForCausalLM, load_config, save_pretrained

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "tasks"
N_TASKS = 5


def test_pass_at_k_is_the_unbiased_estimator():
    # By hand: n = 3 attempts, c = 1 resolved: pass@1 = 1/3, pass@2 = 1 - C(2,2)/C(3,2) = 2/3, pass@3 = 1.
    assert pass_at_k(3, 1, 1) == pytest.approx(1 / 3)
    assert pass_at_k(3, 1, 2) == pytest.approx(2 / 3)
    assert pass_at_k(3, 1, 3) == 1.0
    # n = 5, c = 2: pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    # Averaged over tasks; a task with fewer attempts than k is left out of pass@k.
    assert mean_pass_at_k([(3, 1), (3, 3), (3, 0)], 2) == pytest.approx((2 / 3 + 1 + 0) / 3)
    assert mean_pass_at_k([(3, 1), (1, 1)], 2) == pytest.approx(2 / 3)
    assert mean_pass_at_k([(1, 1)], 2) is None
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def run_eval(tmp_path, *args) -> dict:
    out = tmp_path / "job"
    assert main(["eval", "--tasks", str(TASKS), "--out", str(out), "--no-progress", *args]) == 0
    return json.loads((out / "result.json").read_text())


@pytest.mark.sandbox
def test_oracle_resolves_every_task_and_nop_none(tmp_path):
    oracle = run_eval(tmp_path / "oracle", "--agent", "oracle", "--attempts", "1", "--concurrency", "5")
    assert oracle["n_total_trials"] == N_TASKS and oracle["n_errors"] == 0
    assert oracle["resolved_rate"] == 1.0 and oracle["pass_at_k"] == {"1": 1.0}
    assert all(group["resolved_rate"] == 1.0 for group in oracle["by_category"].values())
    nop = run_eval(tmp_path / "nop", "--agent", "nop", "--attempts", "2", "--concurrency", "5")
    assert nop["n_total_trials"] == 2 * N_TASKS and nop["n_errors"] == 0
    assert nop["resolved_rate"] == 0.0 and nop["pass_at_k"] == {"1": 0.0, "2": 0.0}
    # Harbor's layout: per trial, a result, the trajectory (ids and text) and the verifier's files.
    trial = tmp_path / "oracle" / "job" / "t1jax-hello-world__attempt-1"
    result = json.loads((trial / "result.json").read_text())
    assert result["resolved"] and result["tests_passed"] == result["tests_total"] > 0
    # the trajectory in ATIF: the prompt, then each sampler call with its ids and text
    trajectory = json.loads((trial / "agent" / "trajectory.json").read_text())
    assert trajectory["schema_version"].startswith("ATIF-") and trajectory["steps"][0]["source"] == "user"
    assert "hello" in trajectory["steps"][0]["message"].lower()
    calls = [step for step in trajectory["steps"] if step["source"] == "agent"]
    assert calls and all(step["metrics"]["completion_token_ids"] and step["message"] for step in calls)
    assert (trial / "verifier" / "reward.txt").read_text().strip() == "1"
    ctrf = json.loads((trial / "verifier" / "ctrf.json").read_text())
    assert {t["status"] for t in ctrf["results"]["tests"]} == {"passed"}
    # Where it ran, from the backend's own audit: the local backend runs a stand-in root of the
    # task's base image, so the score is marked unfaithful and the substitution is named.
    assert oracle["backends"] == ["local"]
    assert result["environment"]["backend"] == "local" and result["faithful"] is False
    assert result["environment"]["substitutions"], result["environment"]
    assert oracle["n_unfaithful_tasks"] == N_TASKS


def test_a_task_sample_spreads_over_the_tasks_in_id_order():
    from types import SimpleNamespace

    from t1jax.eval.job import EvalSettings, sample_tasks

    tasks = [SimpleNamespace(task_id=f"suite/train-f{i // 10}-{i % 10:04d}") for i in reversed(range(40))]
    picked = [t.task_id for t in sample_tasks(tasks, 4)]
    assert picked == [f"suite/train-f{family}-0000" for family in range(4)]  # one per family
    assert sample_tasks(tasks, 4) == sample_tasks(list(reversed(tasks)), 4)  # order of discovery
    assert [t.task_id for t in sample_tasks(tasks, None)] == sorted(t.task_id for t in tasks)
    assert len(sample_tasks(tasks, 100)) == 40
    # A job of every task keeps the settings it had before the field existed (it resumes).
    assert "task_sample" not in EvalSettings(tasks_dir="x", agent="nop").to_json()
    assert EvalSettings(tasks_dir="x", agent="nop", task_sample=3).to_json()["task_sample"] == 3


@pytest.mark.sandbox
def test_a_task_sample_evaluates_only_those_tasks(tmp_path):
    result = run_eval(tmp_path, "--agent", "nop", "--attempts", "1", "--task-sample", "2")
    assert result["n_tasks"] == 2 and result["n_total_trials"] == 2


@pytest.mark.sandbox
def test_a_task_the_backend_cannot_run_is_skipped_before_any_sandbox(tmp_path):
    """A task asking for a GPU: the audit says the backend cannot run it; the job lists it as
    skipped with the reason, counts it nowhere else, and starts no sandbox for it."""
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "harbor" / "hello-world", tasks / "hello-world")
    shutil.copytree(TASKS / "harbor" / "hello-world", tasks / "needs-gpu")
    toml = tasks / "needs-gpu" / "task.toml"
    text = toml.read_text().replace('name = "t1jax/hello-world"', 'name = "t1jax/needs-gpu"')
    toml.write_text(text.replace("[environment]", "[environment]\ngpus = 1"))
    out = tmp_path / "job"
    assert (
        main(
            [
                "eval",
                "--tasks",
                str(tasks),
                "--out",
                str(out),
                "--no-progress",
                "--agent",
                "oracle",
                "--attempts",
                "1",
            ]
        )
        == 0
    )
    result = json.loads((out / "result.json").read_text())
    # Harbor's n_total_trials is every trial of the job; n_trials those that count
    assert result["n_total_trials"] == 2 and result["n_trials"] == 1 and result["resolved_rate"] == 1.0
    assert [s["task_id"] for s in result["skipped"]] == ["t1jax/needs-gpu"]
    assert "needs_gpu" in result["skipped"][0]["reason"]
    skipped = json.loads((out / "t1jax-needs-gpu__attempt-1" / "result.json").read_text())
    assert skipped["skipped"] and skipped["timings"] is None  # never started


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny Qwen3.5-MoE written as an HF directory in bfloat16."""
    config = load_config(REPO / "configs" / "tiny_cpu.yaml")
    model = Qwen35MoeForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
    directory = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_pretrained(model, directory)
    return directory


@pytest.mark.sandbox
def test_a_model_checkpoint_is_evaluated_through_the_engine(tmp_path, tiny_checkpoint):
    assert resolve_checkpoint(tiny_checkpoint) == tiny_checkpoint
    assert checkpoint_dtype(tiny_checkpoint) == jnp.bfloat16  # loaded as stored, as transformers does
    result = run_eval(
        tmp_path,
        "--checkpoint", str(tiny_checkpoint), "--attempts", "2", "--max-turns", "1",
        "--max-tokens-per-turn", "16", "--context-window", "1024", "--prompt-profile", "compact",
        "--concurrency", "4",
    )  # fmt: skip
    # A random policy resolves nothing, but every trial ran: no errors, nothing skipped.
    assert result["n_total_trials"] == 2 * N_TASKS and result["n_errors"] == 0 and not result["skipped"]
    assert result["resolved_rate"] == 0.0
    trial = json.loads((tmp_path / "job" / "hello-world__attempt-1" / "result.json").read_text())
    assert trial["status"] == "max_turns" and trial["policy_version"] == 0


@pytest.mark.sandbox
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_eval_resumes_to_the_same_result(tmp_path, stop):
    """SIGKILL the evaluator after a few trials, re-run the same command: it runs only the missing
    trials, reaps what the killed process left, and writes exactly the uninterrupted result.
    SIGTERM: the evaluator cancels its running trials, reclaims their sandboxes and exits 143,
    keeping the finished trials; the same command then completes the job alike."""
    args = ["--tasks", str(TASKS), "--agent", "oracle", "--attempts", "3", "--concurrency", "2"]
    args.append("--no-progress")
    reference = run_eval(tmp_path / "reference", *args[2:])
    job = tmp_path / "job"
    command = [sys.executable, "-m", "t1jax.cli", "eval", *args, "--out", str(job)]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while len(list(job.glob("*/result.json"))) < 4:
        assert process.poll() is None, "the evaluator ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    if stop == signal.SIGTERM:
        assert process.returncode == 128 + signal.SIGTERM, stderr
        assert f"stopped by signal {int(signal.SIGTERM)}" in stderr and "Traceback" not in stderr
        # it reclaimed its own sandboxes: the next run's leak check has nothing to reap
        import hashlib

        from sandbox_service.__main__ import DEFAULT_CACHE_DIR
        from sandbox_service.backends.local import LocalBackend

        run_id = "eval-" + hashlib.sha256(str(job.resolve()).encode()).hexdigest()[:12]
        backend = LocalBackend(cache_dir=REPO / DEFAULT_CACHE_DIR)
        try:
            assert backend.live_sandboxes(run_id) == []
        finally:
            backend.close()
    else:
        assert process.returncode == -signal.SIGKILL
    finished_before = {p.parent.name for p in job.glob("*/result.json")}
    assert 4 <= len(finished_before) < 3 * N_TASKS and not (job / "result.json").exists()
    resumed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=os.environ)
    assert resumed.returncode == 0, resumed.stderr
    from t1jax.harbor.records import RUN_FIELDS, RUN_STATS_FIELDS

    def results_of(job_result):  # without the facts of one run (its id, clock and token counts)
        stats = {k: v for k, v in job_result["stats"].items() if k not in RUN_STATS_FIELDS}
        return {**{k: v for k, v in job_result.items() if k not in RUN_FIELDS}, "stats": stats}

    assert results_of(json.loads((job / "result.json").read_text())) == results_of(reference)
    assert json.loads((job / "timing.json").read_text())["trials_run"] == 3 * N_TASKS - len(finished_before)


def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys):
    assert main(["eval", "--tasks", str(tmp_path / "missing"), "--agent", "nop"]) == 2
    assert main(["eval", "--tasks", str(TASKS)]) == 2  # the model agent without a checkpoint
    assert main(["eval", "--tasks", str(TASKS), "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert main(["eval", "--tasks", str(TASKS), "--agent", "nop", "--top-p", "0"]) == 2
    assert main(["eval", "--tasks", str(TASKS), "--agent", "nop", "--task-sample", "0"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "--task-sample must be >= 1" in errors[-1]
    assert len(errors) == 5 and all(line.startswith("t1jax eval: error: ") for line in errors), errors
    assert "not a directory" in errors[0] and "--checkpoint" in errors[1] and "does not exist" in errors[2]
    # A job directory started with other settings is refused, not mixed.
    run_eval(tmp_path / "a", "--agent", "nop", "--attempts", "1")
    assert main(["eval", "--tasks", str(TASKS), "--agent", "nop", "--attempts", "2", "--out",
                 str(tmp_path / "a" / "job"), "--no-progress"]) == 2  # fmt: skip
    assert "holds a job with other settings (attempts differ)" in capsys.readouterr().err


def test_the_harness_comes_from_a_training_config_and_flags_override_it(tmp_path, capsys):
    """`--harness CONFIG`: the trials run under the harness section a policy was trained with (the
    demo's rl.yaml: 10 s command deadlines, not the evaluation default of 1 s), a flag over it."""
    import argparse

    from t1jax.eval.cli import add_arguments, eval_harness, harness_settings
    from t1jax.eval.job import EvalSettings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rl = REPO / "configs" / "demo" / "rl.yaml"
    args = parser.parse_args(
        ["--tasks", str(TASKS), "--agent", "nop", "--harness", str(rl), "--max-turns", "3"]
    )
    settings = EvalSettings(tasks_dir=str(TASKS), agent="nop", **harness_settings(args))
    harness = eval_harness(settings, settings.context_window, scripted=True)
    assert harness.default_command_duration_sec == 10.0 and harness.max_command_duration_sec == 30.0
    assert harness.observation_reserve_tokens == 64 and harness.min_turn_tokens == 64
    assert (
        harness.max_output_bytes == 1000
        and harness.prompt_profile == "compact-once"
        and harness.terminal == "exec"
    )
    assert harness.context_window == 1024 and not harness.compaction and harness.max_turns == 3  # the flag
    # Without a file: the paper's evaluation harness, and a job's settings read as before the fields.
    plain = EvalSettings(
        tasks_dir=str(TASKS), agent="nop", **harness_settings(parser.parse_args(["--tasks", "x"]))
    )
    assert eval_harness(plain, plain.context_window, scripted=True).default_command_duration_sec == 1.0
    assert "default_command_duration_sec" not in plain.to_json() and "max_output_bytes" in settings.to_json()
    # A file without a harness section, an unknown key, a bad value: one line each, exit 2.
    (tmp_path / "none.yaml").write_text("run: {steps: 1}\n")
    (tmp_path / "typo.yaml").write_text("harness: {max_turn: 3}\n")
    (tmp_path / "bad.yaml").write_text("harness: {max_turns: 0}\n")
    for name in ("none", "typo", "bad", "missing"):
        assert (
            main(
                ["eval", "--tasks", str(TASKS), "--agent", "nop", "--harness", str(tmp_path / f"{name}.yaml")]
            )
            == 2
        )
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 4 and all(line.startswith("t1jax eval: error: --harness ") for line in errors), (
        errors
    )
    assert "no harness section" in errors[0] and "harness.max_turn is not a harness setting" in errors[1]
    assert "max_turns must be > 0" in errors[2] and "cannot read it" in errors[3]


def test_intervals_resample_tasks_and_a_paired_difference_excludes_zero_only_when_it_should():
    from t1jax.eval.passk import bootstrap_interval, paired_difference

    assert bootstrap_interval([[1, 1], [1, 1]]) == (1.0, 1.0)
    low, high = bootstrap_interval([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]])
    assert low < 0.5 < high  # the mean over tasks is 0.5
    assert bootstrap_interval([]) is None
    better = {f"t{i}": [1.0, 1.0] for i in range(12)}
    worse = {f"t{i}": [0.0, 0.0] if i < 10 else [1.0, 1.0] for i in range(12)}
    mean, low, high = paired_difference(better, worse)
    assert mean == pytest.approx(10 / 12) and low > 0
    mean, low, high = paired_difference(better, better)
    assert (mean, low, high) == (0.0, 0.0, 0.0)
    noisy = {f"t{i}": [float(i % 2)] for i in range(12)}
    shifted = {f"t{i}": [float((i + 1) % 2)] for i in range(12)}
    assert paired_difference(noisy, shifted)[1] < 0 < paired_difference(noisy, shifted)[2]


def test_the_job_interval_resamples_the_families_its_tasks_name():
    """`t1jax eval`'s result.json: task a0 (family A) resolved, b0-b2 (family B) not, rate 1/4.
    Two families drawn with replacement: AA (1), AB / BA (1/4), BB (0), so [0, 1]. Over the four
    tasks a draw of a0 four times (p 1/256) is below the 2.5% tail: the interval stops short of 1.
    A task that names no family is its own unit."""
    from t1jax.eval.job import aggregate

    def rows(families):
        return [
            {"trial_name": f"{task}__attempt-1", "task_id": task, "family": family, "skipped": False,
             "resolved": task == "a0", "error": None, "detail": "", "reward": float(task == "a0"),
             "tests_passed": 1, "tests_total": 1, "test_count_reward": 0.05, "category": "c",
             "difficulty": "easy", "action_turns": 2, "status": "completed"}  # fmt: skip
            for task, family in families.items()
        ]

    by_family = aggregate(rows({"a0": "A", "b0": "B", "b1": "B", "b2": "B"}), [], 1)
    assert by_family["resolved_rate"] == 0.25 and by_family["resolved_rate_ci95"] == [0.0, 1.0]
    assert by_family["ci95_resampled"] == "2 families"
    by_task = aggregate(rows({"a0": "", "b0": "", "b1": "", "b2": ""}), [], 1)
    assert by_task["resolved_rate_ci95"][1] < 1.0 and by_task["ci95_resampled"] == "4 tasks"
    mixed = aggregate(rows({"a0": "", "b0": "B", "b1": "B", "b2": "B"}), [], 1)
    assert mixed["ci95_resampled"] == "1 family and 1 task without one"
    assert mixed["resolved_rate_ci95"] == [0.0, 1.0]  # the same two units as by family


def test_the_job_counts_action_turns_and_trials_the_turn_limit_ended():
    """By hand: category x has trials of 2 and 8 turns (the second ended by the turn budget),
    category y one of 5 turns that errored: 15 / 3 = 5.0 turns a trial overall, 1 at the limit;
    per category 5.0 and 1, 5.0 and 0. A skipped task counts in neither."""
    from t1jax.eval.job import aggregate

    def row(task, category, turns, status, *, skipped=False):
        error = "sampler_error" if status == "error" else None
        return {"trial_name": f"{task}__attempt-1", "task_id": task, "family": task, "skipped": skipped,
                "resolved": False, "error": error, "detail": "", "reward": 0.0, "tests_passed": 0,
                "tests_total": 2, "test_count_reward": 0.0, "category": category, "difficulty": "easy",
                "action_turns": turns, "status": status}  # fmt: skip

    trials = [row("a", "x", 2, "completed"), row("b", "x", 8, "max_turns"), row("c", "y", 5, "error"),
              row("d", "y", 0, None, skipped=True)]  # fmt: skip
    result = aggregate(trials, [], 1)
    assert result["mean_action_turns"] == 5.0 and result["n_turn_limit"] == 1
    x, y = result["by_category"]["x"], result["by_category"]["y"]
    assert x["mean_action_turns"] == 5.0 and x["n_turn_limit"] == 1
    assert y["mean_action_turns"] == 5.0 and y["n_turn_limit"] == 0


def test_a_cluster_bootstrap_resamples_whole_families():
    """By hand: family A (1 task, difference 1) and family B (3 tasks, difference 0). Drawing two
    families with replacement gives AA (mean 1, p 1/4), AB or BA (1/4, p 1/2), BB (0, p 1/4): the
    95% interval is [0, 1] and the 30% and 70% quantiles are both 1/4. Resampling tasks one by
    one instead almost never draws the A task four times: its interval stops well short of 1."""
    from t1jax.eval.passk import paired_difference

    better = {"a0": [1.0], "b0": [0.0], "b1": [0.0], "b2": [0.0]}
    worse = {task: [0.0] for task in better}
    families = {"a0": "A", "b0": "B", "b1": "B", "b2": "B"}
    assert paired_difference(better, worse, clusters=families) == (0.25, 0.0, 1.0)
    assert paired_difference(better, worse, clusters=families, level=0.4)[1:] == (0.25, 0.25)
    assert paired_difference(better, worse)[2] < 1.0
    # every task its own cluster (named or not) is the task bootstrap, draw for draw
    rng = np.random.default_rng(1)
    a = {f"t{i}": list(rng.random(3)) for i in range(20)}
    b = {f"t{i}": list(rng.random(3)) for i in range(20)}
    assert paired_difference(a, b, clusters={t: t for t in a}) == paired_difference(a, b)
    assert paired_difference(a, b, clusters={"t0": "t0"}) == paired_difference(a, b)
