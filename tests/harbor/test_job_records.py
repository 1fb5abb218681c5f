"""Every job directory `t1jax eval` writes, read by Harbor's own code: its pydantic models
(`JobConfig`, `JobResult`, `TrialConfig`, `TrialResult`, ATIF `Trajectory`), its job scanner
and viewer API, its reward-file parser, its stats and pass@k, and what it reads compared with
what we meant, field by field."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from harbor.metrics.mean import Mean
from harbor.models.agent.name import AgentName
from harbor.models.job.config import JobConfig
from harbor.models.job.result import JobResult, JobStats
from harbor.models.trajectories.trajectory import Trajectory
from harbor.models.trial.config import TrialConfig
from harbor.models.trial.paths import TrialPaths
from harbor.models.trial.result import TrialResult
from harbor.utils.pass_at_k import compute_pass_at_k_by_evals
from harbor.verifier.verifier import Verifier
from harbor.viewer.scanner import JobScanner
from harbor.viewer.server import create_app

from t1jax.harbor.atif import EXTENSION, token_streams
from t1jax.harbor.records import AGENT_NAMES

JOBS = ("oracle", "nop", "skipped", "rescored")


def trial_dirs(job: Path) -> list[Path]:
    return sorted(p for p in job.iterdir() if p.is_dir())


def ours(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", JOBS)
def test_harbor_models_accept_every_file_of_the_job(jobs, name):
    job = jobs[name]
    config = JobConfig.model_validate_json((job / "config.json").read_text())
    result = JobResult.model_validate_json((job / "result.json").read_text())
    mine = ours(job / "result.json")
    assert (
        config.job_name == job.name and config.n_attempts == ours(job / "config.json")["settings"]["attempts"]
    )
    assert [d.path for d in config.datasets] == [Path(ours(job / "config.json")["settings"]["tasks_dir"])]
    assert result.n_total_trials == len(trial_dirs(job)) == mine["n_total_trials"]
    assert result.started_at <= result.finished_at
    for directory in trial_dirs(job):
        TrialConfig.model_validate_json((directory / "config.json").read_text())
        TrialResult.model_validate_json((directory / "result.json").read_text())
        if (directory / "agent" / "trajectory.json").exists():
            Trajectory.model_validate_json((directory / "agent" / "trajectory.json").read_text())


@pytest.mark.parametrize("name", JOBS)
def test_what_harbor_reads_of_each_trial_is_what_we_wrote(jobs, name):
    for directory in trial_dirs(jobs[name]):
        mine = ours(directory / "result.json")
        result = TrialResult.model_validate_json((directory / "result.json").read_text())
        assert result.trial_name == mine["trial_name"] == directory.name
        assert result.task_name == mine["task_name"]
        task_dir = Path(ours(directory / "config.json")["task"]["path"])
        assert result.task_id.get_local_path() == task_dir.resolve()
        assert (task_dir / "task.toml").exists() or (task_dir / "task.yaml").exists()
        assert result.trial_uri == directory.resolve().as_uri()
        # the agent by Harbor's own name: `harbor run` with this config runs the same agent
        assert result.agent_info.name == AGENT_NAMES[mine["agent"]]
        if mine["agent"] in ("oracle", "nop"):
            assert AgentName(mine["agent"]).value == AGENT_NAMES[mine["agent"]]
        config = TrialConfig.model_validate_json((directory / "config.json").read_text())
        assert config == result.config and config.agent.name == AGENT_NAMES[mine["agent"]]
        # a rescored trial is Harbor's regrade of its source trial
        if mine["agent"] == "replay":
            assert config.is_regrade and config.source_trial.path == Path(mine["rescore"]["source_trial"])
        else:
            assert not config.is_regrade
        assert config.task.get_task_id() == result.task_id and config.trial_name == directory.name
        assert str(config.job_id) == ours(jobs[name] / "config.json")["id"]
        if mine["skipped"] or mine["error"] is not None:
            # no reward counted; the cause named as Harbor names exceptions
            assert result.verifier_result is None and not result.reward_valid
            cause = "sandbox_unsupported" if mine["skipped"] else mine["error"]
            assert (
                result.exception_info.exception_type
                == "".join(p.capitalize() for p in cause.split("_")) + "Error"
            )
            assert result.exception_info.exception_message == mine["detail"]
        else:
            assert result.exception_info is None and result.reward_valid
            assert result.verifier_result.rewards == {"reward": mine["reward"]}
            # Harbor's own reward-file parser reads the same value from verifier/
            parsed = Verifier._parse_reward_text(SimpleNamespace(trial_paths=TrialPaths(directory)))
            assert parsed == {"reward": mine["reward"]}
            assert (mine["reward"] == 1.0) == mine["resolved"]
        # token counts are the trajectory's own
        if (directory / "agent" / "trajectory.json").exists():
            trajectory = Trajectory.model_validate_json((directory / "agent" / "trajectory.json").read_text())
            calls = [s for s in trajectory.steps if s.source == "agent"]
            assert result.agent_result.n_input_tokens == sum(s.metrics.prompt_tokens for s in calls)
            assert result.agent_result.n_output_tokens == sum(s.metrics.completion_tokens for s in calls)
        # phases in order, each as long as we measured it
        if mine["timings"] is None:
            assert result.started_at is None and result.agent_execution is None
            continue
        phases = (result.environment_setup, result.agent_execution, result.verifier)
        assert result.started_at == phases[0].started_at and phases[-1].finished_at <= result.finished_at
        for before, after in zip(phases, phases[1:], strict=False):
            assert before.finished_at == after.started_at
        for phase, key in zip(phases, ("create", "agent", "verify"), strict=True):
            assert abs(
                (phase.finished_at - phase.started_at) - timedelta(seconds=mine["timings"][key])
            ) < timedelta(milliseconds=1)


@pytest.mark.parametrize("name", JOBS)
def test_job_stats_are_what_harbor_derives_from_the_trials(jobs, name):
    """JobStats.from_trial_results, Harbor's Mean metric over valid rewards and its pass@k, on
    the trial results on disk, equal the stats we wrote."""
    job = jobs[name]
    result = JobResult.model_validate_json((job / "result.json").read_text())
    trials = [TrialResult.model_validate_json((d / "result.json").read_text()) for d in trial_dirs(job)]
    expected = JobStats.from_trial_results(trials, n_total_trials=result.n_total_trials)
    rewards: dict[str, list] = {}
    for trial in trials:
        key = JobStats.format_agent_evals_key(trial.agent_info.name, None, trial.source or "adhoc")
        if trial.reward_valid:
            rewards.setdefault(key, []).append(trial.verifier_result.rewards)
    for key, values in rewards.items():
        expected.evals[key].metrics.append(Mean().compute(values))
    for key, pass_at_k in compute_pass_at_k_by_evals(trials).items():
        expected.evals[key].pass_at_k = pass_at_k
    assert result.stats.model_dump() == expected.model_dump()
    mine = ours(job / "result.json")
    assert result.stats.n_completed_trials == mine["n_total_trials"]
    assert result.stats.n_errored_trials == mine["n_errors"] + sum(
        ours(d / "result.json")["skipped"] for d in trial_dirs(job)
    )


def test_the_skipped_task_is_an_errored_trial_to_harbor_and_skipped_to_us(jobs):
    mine = ours(jobs["skipped"] / "result.json")
    assert mine["n_trials"] == 1 and mine["n_total_trials"] == 2 and mine["resolved_rate"] == 1.0
    result = JobResult.model_validate_json((jobs["skipped"] / "result.json").read_text())
    (stats,) = result.stats.evals.values()
    assert stats.n_errors == 1 and list(stats.exception_stats) == ["SandboxUnsupportedError"]
    assert stats.metrics == [{"mean": 1.0}]  # over the trials with a valid reward, as Harbor computes


@pytest.mark.parametrize("name", JOBS)
def test_harbors_job_scanner_and_viewer_read_the_job(jobs, name):
    job = jobs[name]
    scanner = JobScanner(job.parent)
    assert scanner.get_job_config(job.name) is not None and scanner.get_job_result(job.name) is not None
    assert scanner.list_trials(job.name) == [d.name for d in trial_dirs(job)]
    for trial in scanner.list_trials(job.name):
        assert scanner.get_trial_config(job.name, trial) is not None
        assert scanner.get_trial_result(job.name, trial) is not None
    client = TestClient(create_app(job.parent))
    listing = client.get("/api/jobs")
    assert listing.status_code == 200
    (summary,) = [item for item in listing.json()["items"] if item["name"] == job.name]
    agent = ours(trial_dirs(job)[0] / "result.json")["agent"]
    assert summary["n_total_trials"] == len(trial_dirs(job)) and summary["agents"] == [AGENT_NAMES[agent]]
    trials = client.get(f"/api/jobs/{job.name}/trials", params={"page_size": 100})
    assert trials.status_code == 200
    rows = {row["name"]: row for row in trials.json()["items"]}
    assert sorted(rows) == [d.name for d in trial_dirs(job)]
    for directory in trial_dirs(job):
        mine = ours(directory / "result.json")
        row = rows[directory.name]
        assert row["task_name"] == mine["task_name"]
        assert row["reward"] == (None if mine["skipped"] or mine["error"] else mine["reward"])
        detail = client.get(f"/api/jobs/{job.name}/trials/{directory.name}")
        assert detail.status_code == 200 and detail.json()["trial_name"] == directory.name
        output = client.get(f"/api/jobs/{job.name}/trials/{directory.name}/verifier-output").json()
        if mine["verifier_report"] is not None:
            assert output["stdout"] == (directory / "verifier" / "test-stdout.txt").read_text()
            tests = json.loads(output["ctrf"])["results"]["tests"]
            assert [t["name"] for t in tests] == [a["name"] for a in mine["verifier_report"]["assertions"]]
        trajectory = client.get(f"/api/jobs/{job.name}/trials/{directory.name}/trajectory")
        assert trajectory.status_code == 200
        assert (trajectory.json() is None) == (not (directory / "agent" / "trajectory.json").exists())


@pytest.mark.parametrize("name", ("oracle", "nop", "rescored"))
def test_each_trajectory_is_atif_with_the_training_extension(jobs, name):
    for directory in trial_dirs(jobs[name]):
        document = ours(directory / "agent" / "trajectory.json")
        trajectory = Trajectory.model_validate(document)
        mine = ours(directory / "result.json")
        extension = trajectory.extra["t1jax"]
        assert extension["extension"] == EXTENSION and extension["trial_id"] == directory.name
        assert extension["status"] == mine["status"] and extension["cause"] == "none"
        assert extension["policy_versions"] == [0] and extension["routing"]["kept"] is False
        calls = [step for step in trajectory.steps if step.source == "agent"]
        assert len([c for c in calls if c.extra["t1jax"]["kind"] == "action"]) == mine["action_turns"]
        for step in calls:
            assert (
                len(step.metrics.completion_token_ids)
                == len(step.metrics.logprobs)
                == step.metrics.completion_tokens
            )
            assert step.extra["t1jax"]["policy_version"] == 0 and step.llm_call_count == 1
        # the ids rebuild, turn by turn, into streams whose prompts are each turn's own length
        streams = token_streams(document)
        assert len(streams) == 1 + len(extension["compactions"])
        assert trajectory.final_metrics.total_steps == len(trajectory.steps)
        assert trajectory.final_metrics.total_completion_tokens == sum(
            s.metrics.completion_tokens for s in calls
        )
        last = calls[-1].metrics
        assert len(streams[-1]) == last.prompt_tokens + last.completion_tokens
