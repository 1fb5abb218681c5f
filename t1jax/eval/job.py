"""An evaluation job: every task of a directory x `attempts` trials, run through the trial
scheduler, written in Harbor's job layout, resumable (paper §6.1).

Job directory:

    JOB/config.json                 the `EvalSettings` (what decides the results), the job's id and
                                    start, and Harbor's `JobConfig` fields
    JOB/result.json                 aggregate: n_total_trials (every trial, skipped ones too),
                                    n_trials (those that count), n_errors, mean reward, resolved
                                    rate with a bootstrap interval (over template families where
                                    the tasks name one), unbiased pass@k, mean action turns and
                                    trials ended at the turn limit, the same per category and
                                    difficulty, every error with its cause, every skipped task
                                    with why; Harbor's `JobResult` fields (id, times, stats)
    JOB/timing.json                 wall-clock facts (kept out of result.json, which a resumed
                                    job must reproduce exactly)
    JOB/<task>__attempt-<k>/config.json          Harbor's `TrialConfig` (+ ours under "t1jax")
    JOB/<task>__attempt-<k>/result.json          one trial: fate, reward, tests, cause, timings,
                                                 and Harbor's `TrialResult` fields
    JOB/<task>__attempt-<k>/agent/trajectory.json    ATIF, with the training extension
                                                     (`t1jax.harbor.atif`)
    JOB/<task>__attempt-<k>/verifier/{reward.txt, ctrf.json, report.json, test-stdout.txt}
    JOB/<task>__attempt-<k>/steps/<step>/verifier/{reward.txt, ctrf.json, report.json, test-stdout.txt}
                                                 a multi-step task's steps, in Harbor's layout

A multi-step task's trial (Harbor `[[steps]]`; the harness verifies each step) records each step
in result.json twice: Harbor's `step_results` (its `StepResult`: the step's name, its verifier's
`rewards`, an `exception_info` when its verification failed, its agent and verifier times) and
ours, `steps` (the step's agent status and action turns, rewards, tests passed / total,
resolved). The trial's `reward` is Harbor's for the task's `multi_step_reward_strategy` (the mean
over the steps verified, a step that never ran counting in none; or the final step's), and
`resolved` holds only when every step ran and resolved. A one-step trial has neither field.

Harbor reads every one of these files with its own models (`t1jax.harbor.records`, checked by
tests/harbor). A trial result names its task in `task_name` (Harbor's `task_id` is the task's
directory); `task_of` reads either, so jobs written before that read alike.

Invariants:
- A trial directory is complete exactly when its `result.json` exists (written last, by an
  atomic rename). Re-running the same command on the same JOB reruns only the trials without
  one; a JOB started with other `EvalSettings` is refused (a different `--out` is needed).
- Trial names, trial ids and sampling seeds are functions of the task and the attempt only,
  so a resumed job samples what the uninterrupted one would have.
- An errored trial (infrastructure failure) counts as reward 0 and is listed with its cause; a
  task the backend cannot build (or that failed to load) is listed as skipped with the reason
  and counted nowhere else.
- Every trial's result names the environment it ran in (`environment`: the backend, the image,
  every base image replaced by a stand-in; `faithful`: none was), from the backend's own
  `EnvironmentAudit` (`sandbox_service.fidelity`), and result.json counts the unfaithful tasks: a
  score is never silently earned on a different image. A task the audit says the backend cannot
  run is skipped before any sandbox starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_service.cli_contract import UsageError
from sandbox_service.contracts import EnvironmentAudit, Task, VerifierReport
from t1jax.eval.passk import bootstrap_interval, cluster_names, mean_pass_at_k, resampled_units
from t1jax.harbor import records as harbor
from t1jax.rollout.types import SamplingParams
from t1jax.runtime.records import resolved
from t1jax.runtime.scheduler import FailureCause, FinishedTrial, TrialFate, TrialScheduler, TrialSpec
from t1jax.tito.types import TrialStatus

FORMAT_VERSION = 2  # 2: Harbor's fields; a job of format 1 is read, not resumed


@dataclass(frozen=True)
class EvalSettings:
    """Everything that decides an evaluation's results (not how fast it runs). Defaults are the
    paper's evaluation protocol (§6.1): temperature 0.1, top-p 0.95, top-k 20, 3 attempts, 60
    turns; `greedy` overrides the sampling parameters with temperature 0."""

    tasks_dir: str
    agent: str = "model"  # model | oracle | nop | replay (`t1jax eval --rescore`)
    checkpoint: str | None = None
    dtype: str | None = None  # the checkpoint's own unless set
    attempts: int = 3
    greedy: bool = False
    temperature: float = 0.1
    top_p: float = 0.95
    top_k: int = 20
    seed: int = 0
    max_turns: int = 60
    context_window: int = 96_000
    max_tokens_per_turn: int = 8192
    agent_timeout_sec: float | None = None  # None: each task's own
    terminal: str = "tmux"
    prompt_profile: str = "full"  # the harness's system prompt (t1jax.agent.prompts.PROMPT_PROFILES)
    reward_scale: float = 20.0  # S of Eq. 20, for the reported test-count reward
    # Evaluate only this many of the directory's tasks, spread evenly over them (`sample_tasks`).
    task_sample: int | None = None
    # The rest of the harness (`HarnessConfig`'s fields of the same names). A policy must be
    # evaluated under the harness it was trained in (`t1jax eval --harness RUN_CONFIG`): a command
    # deadline of 1 s where training allowed 10 kills a plain `rm` on a loaded machine, and a
    # larger observation reserve ends trials earlier. None: derived from the context window.
    default_command_duration_sec: float = 1.0
    max_command_duration_sec: float = 60.0
    max_output_bytes: int = 10_000
    min_turn_tokens: int | None = None  # None: min(256, the turn's token budget)
    observation_reserve_tokens: int = 256
    summary_max_tokens: int | None = None  # None: an eighth of the context window, in [64, 2048]
    compaction: bool | None = None  # None: on from an 8192-token context window
    max_compactions: int = 8
    # The harness's budget note (`HarnessConfig.budget_note`): the agent is told the time and
    # turns it has left in every observation. Off: the prompts the policy was trained on.
    budget_note: bool = False
    budget_note_format: str | None = None  # None: the harness's default
    rescore_of: str | None = None  # agent replay: the job replayed (t1jax.eval.rescore)

    def __post_init__(self) -> None:
        if self.agent not in ("model", "oracle", "nop", "replay"):
            raise ValueError(f"agent must be model, oracle, nop or replay, got {self.agent!r}")
        if (self.agent == "replay") != (self.rescore_of is not None):
            raise ValueError("agent replay and rescore_of (the job rescored) go together")
        if self.agent == "model" and not self.checkpoint:
            raise ValueError("--agent model needs --checkpoint (an HF directory or a run's checkpoint)")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.task_sample is not None and self.task_sample < 1:
            raise ValueError(f"task sample must be >= 1, got {self.task_sample}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"sampling out of range: temperature {self.temperature} (>= 0), top_p {self.top_p} "
                f"(in (0, 1]), top_k {self.top_k} (>= 0)"
            )

    @property
    def sampling(self) -> SamplingParams:
        if self.greedy:
            return SamplingParams(max_new_tokens=1, temperature=0.0, seed=self.seed)
        return SamplingParams(
            max_new_tokens=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed
        )

    def to_json(self) -> dict[str, Any]:
        settings = dataclasses.asdict(self)
        # A field added later is left out at its default, so a job written before it reads (and
        # resumes) as the same settings.
        for name in _LATER_FIELDS:
            if settings[name] == _DEFAULTS[name]:
                del settings[name]
        return settings


_LATER_FIELDS = ("task_sample", "default_command_duration_sec", "max_command_duration_sec",
                 "max_output_bytes", "min_turn_tokens", "observation_reserve_tokens", "summary_max_tokens",
                 "compaction", "max_compactions", "budget_note", "budget_note_format",
                 "rescore_of")  # fmt: skip
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EvalSettings)}


def sample_tasks(tasks: Sequence[Task], count: int | None) -> list[Task]:
    """`count` of `tasks` spread evenly over them in task-id order (all of them for None or a
    count >= their number): deterministic, and it spans a generated suite's template families,
    whose tasks sit together in id order."""
    ordered = sorted(tasks, key=lambda task: task.task_id)
    if count is None or count >= len(ordered):
        return ordered
    return [ordered[(index * len(ordered)) // count] for index in range(count)]


def task_of(result: Mapping[str, Any]) -> str:
    """The task id of a trial result (`task_name`; a format-1 job's `task_id`)."""
    name = result.get("task_name")
    return name if isinstance(name, str) else result["task_id"]


def verifier_report_of(result: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A trial result's verifier report record (`verifier_report`; a format-1 job's `verifier`)."""
    if "verifier_report" in result:
        return result["verifier_report"]
    old = result.get("verifier")
    return old if isinstance(old, Mapping) and "assertions" in old else None


@dataclass(frozen=True)
class JobContext:
    """What a trial record needs to know of its job for Harbor's fields: the directory, the
    job's id (uuid, kept across resumes) and the dataset's name (Harbor's `source`)."""

    job_dir: Path
    job_id: str
    source: str | None = None


def _agent_kwargs(settings: EvalSettings) -> dict[str, Any]:
    return {k: v for k, v in settings.to_json().items() if k not in ("tasks_dir", "agent", "checkpoint")}


def trial_name(task: Task, attempt: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", task.task_id).strip("-") or "task"
    return f"{slug}__attempt-{attempt}"


def plan_trials(tasks: Sequence[Task], settings: EvalSettings) -> list[TrialSpec]:
    return [
        TrialSpec(trial_name(task, attempt), task, settings.sampling, attempt)
        for task in sorted(tasks, key=lambda t: t.task_id)
        for attempt in range(1, settings.attempts + 1)
    ]


# ---- one trial on disk ---------------------------------------------------------------------------


def harbor_reward(report: VerifierReport | None) -> float:
    """The value Harbor records for a trial: the verifier's reward file, else its outcome."""
    if report is None:
        return 0.0
    if report.reward_value is not None:
        return float(report.reward_value)
    return 1.0 if report.binary_outcome else 0.0


def trial_result(
    trial: FinishedTrial, settings: EvalSettings, environment: EnvironmentAudit | None = None,
    job: JobContext | None = None, finished_at: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The trial's `result.json`: ours, deterministic fields first, `timings` last; then, for a
    trial of a job (`job`), Harbor's `TrialResult` fields."""
    task = trial.task
    trajectory = trial.trajectory
    report = trajectory.verifier_report if trajectory is not None else None
    completed = trial.fate is TrialFate.COMPLETED
    skipped = trial.cause is FailureCause.SANDBOX_UNSUPPORTED
    passed = report.passed if (report is not None and completed) else 0
    total = report.total if report is not None else 0
    error = None if completed or skipped else (trial.cause.value if trial.cause else trial.fate.value)
    ours = {
        "trial_name": trial.trial_id,
        "task_name": task.task_id,
        "attempt": trial.spec.attempt,
        "category": task.category,
        "difficulty": task.difficulty.value,
        "family": task.family,
        "agent": settings.agent,
        "fate": trial.fate.value,
        "skipped": skipped,
        "error": error,
        "detail": trial.detail[:2000],
        "resolved": completed and resolved(report),
        "reward": harbor_reward(report) if completed else 0.0,
        "tests_passed": passed,
        "tests_total": total,
        "test_count_reward": passed / settings.reward_scale,
        "status": trajectory.status.value if trajectory is not None else None,
        "action_turns": trial.action_turns,
        "policy_version": trial.policy_version,
        "verifier_report": None if report is None else _report_json(report),
        **environment_fields(environment),
        **(_steps_fields(task, trajectory) if task.steps else {}),
        "timings": dataclasses.asdict(trial.timings),
    }
    if job is None:
        return ours
    turns = trajectory.turns if trajectory is not None else ()
    tokens = None
    if turns:
        tokens = (sum(len(t.prompt_ids) for t in turns), sum(len(t.completion_ids) for t in turns))
    cause = FailureCause.SANDBOX_UNSUPPORTED.value if skipped else error
    return {
        **ours,
        **harbor.trial_fields(
            job_id=job.job_id, job_dir=job.job_dir, trial_name=trial.trial_id, task_name=task.task_id,
            task_dir=task.source_dir, source=job.source, agent=settings.agent, checkpoint=settings.checkpoint,
            reward=harbor_reward(report) if completed and report is not None else None,
            error=None if cause is None else (cause, trial.detail[:2000]),
            durations=None if not trial.started else ours["timings"],
            finished_at=time.time() if finished_at is None else finished_at, tokens=tokens,
            config=_harbor_config(trial.spec, settings, environment, job),
        ),
        **({"step_results": _harbor_step_results(trajectory)} if task.steps else {}),
    }  # fmt: skip


def _steps_fields(task: Task, trajectory) -> dict[str, Any]:
    """Our record of a multi-step trial's steps (the module docstring), in step order."""
    steps = trajectory.step_reports if trajectory is not None else ()
    return {"multi_step_reward": task.multi_step_reward, "steps": [
        {
            "step": step.name,
            "agent_status": step.agent_status.value,
            "action_turns": step.action_turns,
            "rewards": step.rewards,
            "resolved": resolved(step.report),
            "tests_passed": step.report.passed,
            "tests_total": step.report.total,
            "failure": step.failure or None,
            "verifier_report": _report_json(step.report),
        }
        for step in steps
    ]}  # fmt: skip


def _harbor_step_results(trajectory) -> list[dict[str, Any]]:
    """Harbor's `TrialResult.step_results` of a multi-step trial: one `StepResult` a step run."""
    results = []
    for step in trajectory.step_reports if trajectory is not None else ():
        start, agent_end = step.started_at, step.started_at + step.agent_sec
        verify_end = agent_end + step.verify_sec
        exception = None
        if step.failure:
            exception = {
                "exception_type": harbor.error_type(step.failure),
                "exception_message": step.report.detail[:2000],
                "exception_traceback": "",
                "occurred_at": harbor.iso(verify_end),
            }
        results.append(
            {
                "step_name": step.name,
                "agent_result": None,
                "verifier_result": None if step.rewards is None else {"rewards": dict(step.rewards)},
                "exception_info": exception,
                "agent_execution": {"started_at": harbor.iso(start), "finished_at": harbor.iso(agent_end)},
                "verifier": {"started_at": harbor.iso(agent_end), "finished_at": harbor.iso(verify_end)},
            }
        )
    return results


def environment_fields(environment: EnvironmentAudit | None) -> dict[str, Any]:
    """What a trial's result says about where it ran (None: the provider could not be asked)."""
    if environment is None:
        return {"environment": None, "faithful": None}
    return {
        "environment": {
            "backend": environment.backend,
            "image": environment.image,
            "substitutions": [
                {"requested": sub.requested, "used": sub.used} for sub in environment.substitutions
            ],
            "describe": environment.describe(),
        },
        "faithful": environment.faithful,
    }


def skipped_result(
    task: Task, attempt: int, settings: EvalSettings, environment: EnvironmentAudit | None,
    job: JobContext | None = None, reason: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The result of a trial never started: the backend's audit says it cannot run the task
    (or `reason`, e.g. a rescore that has nothing to replay)."""
    ours = {
        "trial_name": trial_name(task, attempt),
        "task_name": task.task_id,
        "attempt": attempt,
        "category": task.category,
        "difficulty": task.difficulty.value,
        "family": task.family,
        "agent": settings.agent,
        "fate": TrialFate.FAILED.value,
        "skipped": True,
        "error": None,
        "detail": (reason or environment.describe())[:2000],
        "resolved": False,
        "reward": 0.0,
        "tests_passed": 0,
        "tests_total": 0,
        "test_count_reward": 0.0,
        "status": None,
        "action_turns": 0,
        "policy_version": None,
        "verifier_report": None,
        **environment_fields(environment),
        "timings": None,
    }
    if job is None:
        return ours
    return {
        **ours,
        **harbor.trial_fields(
            job_id=job.job_id, job_dir=job.job_dir, trial_name=ours["trial_name"], task_name=task.task_id,
            task_dir=task.source_dir, source=job.source, agent=settings.agent, checkpoint=settings.checkpoint,
            reward=None, error=(FailureCause.SANDBOX_UNSUPPORTED.value, ours["detail"]), durations=None,
            finished_at=time.time(), tokens=None,
            config=_harbor_config(TrialSpec(ours["trial_name"], task, settings.sampling, attempt), settings,
                                  environment, job),
        ),
    }  # fmt: skip


def _report_json(report: VerifierReport) -> dict[str, Any]:
    return {
        "parsed": report.parsed,
        "failure_cause": report.failure_cause.value,
        "binary_outcome": report.binary_outcome,
        "reward_value": report.reward_value,
        "detail": report.detail[:2000],
        "assertions": [{"name": a.name, "passed": a.passed} for a in report.assertions],
    }


def ctrf_json(report: VerifierReport) -> dict[str, Any]:
    """The per-assertion record in CTRF form (`results.tests[{name, status}]`), as Harbor's
    test.sh writes it with pytest-json-ctrf."""
    tests = [{"name": a.name, "status": "passed" if a.passed else "failed"} for a in report.assertions]
    return {
        "results": {
            "tool": {"name": "t1jax-verifier"},
            "summary": {"tests": len(tests), "passed": report.passed, "failed": len(tests) - report.passed},
            "tests": tests,
        }
    }


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def _harbor_config(spec, settings, environment, job) -> dict[str, Any]:
    return {k: v for k, v in trial_config(spec, settings, environment, job).items() if k != "t1jax"}


def trial_config(
    spec: TrialSpec, settings: EvalSettings, environment: EnvironmentAudit | None, job: JobContext
) -> dict[str, Any]:
    """A trial's `config.json`: Harbor's `TrialConfig`, ours under "t1jax"."""
    config = harbor.trial_config(
        job_id=job.job_id, job_dir=Path(job.job_dir).resolve(), trial_name=spec.trial_id,
        task_dir=spec.task.source_dir,
        agent=harbor.agent_config(settings.agent, settings.checkpoint, _agent_kwargs(settings)),
        backend=None if environment is None else environment.backend,
    )  # fmt: skip
    if settings.rescore_of is not None:  # Harbor's regrade: the trial derives from the source's
        config["source_trial"] = {"action": "regrade", "type": "local",
                                  "path": str(Path(settings.rescore_of) / spec.trial_id)}  # fmt: skip
    config["t1jax"] = {
        "task_id": spec.task.task_id,
        "attempt": spec.attempt,
        "sampling": dataclasses.asdict(spec.sampling),
    }
    return config


def write_trial(
    job_dir: Path, trial: FinishedTrial, settings: EvalSettings, decode, environment=None,
    job: JobContext | None = None, annotation: Mapping[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Write one trial's directory; `result.json` goes last, so its presence means complete.
    `annotation`: fields added to the result (a rescore's account of its replay)."""
    from t1jax.harbor.atif import trajectory_record

    job = job or JobContext(Path(job_dir), harbor.trial_uuid("", str(Path(job_dir).resolve())))
    directory = job_dir / trial.trial_id
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    _write_json(directory / "config.json", trial_config(trial.spec, settings, environment, job))
    record = trajectory_record(trial, decode, harbor.agent_info(settings.agent, settings.checkpoint))
    if record is not None:
        _write_json(directory / "agent" / "trajectory.json", record)
    report = trial.trajectory.verifier_report if trial.trajectory is not None else None
    if report is not None:
        (directory / "verifier").mkdir(exist_ok=True)
        (directory / "verifier" / "reward.txt").write_text(f"{harbor_reward(report):g}\n")
        _write_json(directory / "verifier" / "ctrf.json", ctrf_json(report))
        _write_json(directory / "verifier" / "report.json", _report_json(report))
        # the verifier's console output as the sandbox kept it (its tail; stdout and stderr
        # interleaved, so there is no separate test-stderr.txt)
        (directory / "verifier" / "test-stdout.txt").write_text(report.output_tail)
    for step in trial.trajectory.step_reports if trial.trajectory is not None else ():
        verifier = directory / "steps" / step.name / "verifier"  # Harbor's TrialPaths.step_verifier_dir
        verifier.mkdir(parents=True)
        if step.rewards is not None:
            (verifier / "reward.txt").write_text(f"{step.rewards['reward']:g}\n")
        _write_json(verifier / "ctrf.json", ctrf_json(step.report))
        _write_json(verifier / "report.json", _report_json(step.report))
        (verifier / "test-stdout.txt").write_text(step.report.output_tail)
    result = {**trial_result(trial, settings, environment, job), **(annotation or {})}
    _write_json(directory / "result.json", result)
    return result


# ---- the job -------------------------------------------------------------------------------------


def aggregate(results: Iterable[Mapping[str, Any]], load_errors: Sequence[tuple[str, str]], attempts: int):
    """result.json from the trials' results (fresh or resumed alike) and the load errors."""
    results = sorted(results, key=lambda r: r["trial_name"])
    counted = [r for r in results if not r["skipped"]]
    skipped_tasks: dict[str, str] = {}
    for r in results:
        if r["skipped"]:
            skipped_tasks.setdefault(task_of(r), r["detail"])
    for path, reason in load_errors:
        skipped_tasks.setdefault(path, f"failed to load: {reason}")

    def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        per_task: dict[str, list[bool]] = defaultdict(list)
        for r in rows:
            per_task[task_of(r)].append(bool(r["resolved"]))
        n = len(rows)
        out: dict[str, Any] = {
            "n_trials": n,
            "n_tasks": len(per_task),
            "n_errors": sum(r["error"] is not None for r in rows),
            "n_resolved": sum(bool(r["resolved"]) for r in rows),
            "resolved_rate": _ratio(sum(bool(r["resolved"]) for r in rows), n),
            "mean_reward": _ratio(sum(r["reward"] for r in rows), n),
            "mean_test_fraction": _ratio(
                sum(r["tests_passed"] / r["tests_total"] if r["tests_total"] else 0.0 for r in rows), n
            ),
            "mean_test_count_reward": _ratio(sum(r["test_count_reward"] for r in rows), n),
            # how long the agent acts, and how often the harness's turn budget ends it rather than
            # the agent (paper §6, Fig. 15 reports turns per checkpoint): RL that learns to act on
            # past a task's last step shows here first
            "mean_action_turns": _ratio(sum(r["action_turns"] for r in rows), n),
            "n_turn_limit": sum(r["status"] == TrialStatus.MAX_TURNS.value for r in rows),
        }
        counts = [(len(v), sum(v)) for v in per_task.values()]
        out["pass_at_k"] = {str(k): _round(mean_pass_at_k(counts, k)) for k in range(1, attempts + 1)}
        # over template families where the tasks name one (`Task.family`): they flip together
        tasks = sorted(per_task)
        families = {task_of(r): r["family"] for r in rows if r.get("family")}
        interval = bootstrap_interval([per_task[t] for t in tasks], clusters=cluster_names(tasks, families))
        out["resolved_rate_ci95"] = None if interval is None else [_round(v) for v in interval]
        out["ci95_resampled"] = resampled_units(tasks, families)
        return out

    def grouped(key: str) -> dict[str, Any]:
        groups: dict[str, list] = defaultdict(list)
        for r in counted:
            groups[r[key]].append(r)
        return {name: summary(rows) for name, rows in sorted(groups.items())}

    overall = summary(counted)
    # One entry per task that ran on a stand-in image (its environment is the same for every attempt).
    unfaithful: dict[str, str] = {}
    for r in counted:
        if r.get("faithful") is False:
            unfaithful.setdefault(task_of(r), r["environment"]["describe"])
    return {
        "format_version": FORMAT_VERSION,
        "n_total_trials": len(results),  # Harbor's meaning: every trial of the job
        "n_trials": len(counted),
        "n_errors": overall["n_errors"],
        "n_skipped_tasks": len(skipped_tasks),
        **{k: v for k, v in overall.items() if k not in ("n_trials", "n_errors")},
        "by_category": grouped("category"),
        "by_difficulty": grouped("difficulty"),
        "errors": [
            {
                "trial_name": r["trial_name"],
                "task_id": task_of(r),
                "cause": r["error"],
                "detail": r["detail"][:300],
            }
            for r in counted
            if r["error"] is not None
        ],
        "skipped": [{"task_id": t, "reason": why[:500]} for t, why in sorted(skipped_tasks.items())],
        "backends": sorted({r["environment"]["backend"] for r in counted if r.get("environment")}),
        "n_unfaithful_tasks": len(unfaithful),
        "unfaithful": [{"task_id": t, "environment": e} for t, e in sorted(unfaithful.items())],
    }


def _ratio(numerator: float, denominator: int) -> float | None:
    return _round(numerator / denominator) if denominator else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 6)


class EvalJob:
    """One job directory (module docstring). `run` launches the unfinished trials on
    `scheduler`, writes each as it finishes, and returns the aggregate (also in result.json)."""

    def __init__(self, job_dir: str | Path, settings: EvalSettings, tasks: Sequence[Task], load_errors=()):
        self.job_dir = Path(job_dir)
        self.settings = settings
        self.tasks = list(tasks)
        self.load_errors = [(str(getattr(e, "path", "?")), str(e)) for e in load_errors]
        self.specs = plan_trials(self.tasks, settings)
        self.environments: dict[str, EnvironmentAudit] = {}
        self.identity: dict[str, str] = {}  # the job's Harbor id and start (config.json)
        # trials not to run, with why (listed as skipped); fields to add to a trial's result
        self.not_runnable: dict[str, str] = {}
        self.annotate: Callable[[str], Mapping[str, Any]] | None = None

    def audit_environments(self, provider) -> None:
        """Ask `provider` how it will run each task (no sandbox starts); results name it, and the
        tasks it cannot run are skipped with its reason."""
        from sandbox_service.fidelity import environment_audit

        self.environments = {task.task_id: environment_audit(task, provider) for task in self.tasks}

    @property
    def context(self) -> JobContext:
        return JobContext(self.job_dir, self.identity["id"], Path(self.settings.tasks_dir).name or None)

    def prepare(self) -> tuple[list[TrialSpec], dict[str, dict[str, Any]]]:
        """Create or check the job directory; returns (trials to run, results already on disk)."""
        config_path = self.job_dir / "config.json"
        ours = {"format_version": FORMAT_VERSION, "settings": self.settings.to_json()}
        if config_path.exists():
            existing = json.loads(config_path.read_text())
            if {k: existing.get(k) for k in ours} != ours:
                changed = sorted(
                    key
                    for key in set(existing.get("settings", {})) | set(ours["settings"])
                    if existing.get("settings", {}).get(key) != ours["settings"].get(key)
                )
                # bad input (the --out of another job), refused before any trial runs
                if not changed and existing.get("format_version") != FORMAT_VERSION:
                    raise UsageError(
                        f"{self.job_dir} holds a job of format {existing.get('format_version')} (an older "
                        f"t1jax; this one writes format {FORMAT_VERSION}): it reads, but cannot be resumed; "
                        "pass another --out"
                    )
                differ = ", ".join(changed) or "format"
                raise UsageError(
                    f"{self.job_dir} holds a job with other settings ({differ} differ); "
                    "resume it with the same arguments or pass another --out"
                )
            self.identity = {"id": existing["id"], "started_at": existing["started_at"]}
        else:
            import uuid

            self.job_dir.mkdir(parents=True, exist_ok=True)
            self.identity = {"id": str(uuid.uuid4()), "started_at": harbor.iso(time.time())}
            settings = self.settings
            config = {
                **harbor.job_config(
                    job_dir=self.job_dir, tasks_dir=settings.tasks_dir, attempts=settings.attempts,
                    agent=settings.agent, checkpoint=settings.checkpoint,
                    agent_kwargs=_agent_kwargs(settings),
                ),
                **ours,
                **self.identity,
            }  # fmt: skip
            _write_json(config_path, config)
        done: dict[str, dict[str, Any]] = {}
        todo: list[TrialSpec] = []
        for spec in self.specs:
            result_path = self.job_dir / spec.trial_id / "result.json"
            environment = self.environments.get(spec.task.task_id)
            reason = self.not_runnable.get(spec.trial_id)
            if reason is not None and not result_path.exists():
                result_path.parent.mkdir(parents=True, exist_ok=True)
                _write_json(result_path.parent / "config.json", trial_config(spec, self.settings, environment,
                                                                             self.context))  # fmt: skip
                skipped = skipped_result(
                    spec.task, spec.attempt, self.settings, environment, self.context, reason
                )
                _write_json(result_path, skipped)
            if environment is not None and not environment.runnable and not result_path.exists():
                result_path.parent.mkdir(parents=True, exist_ok=True)
                _write_json(result_path.parent / "config.json", trial_config(spec, self.settings, environment,
                                                                             self.context))  # fmt: skip
                skipped = skipped_result(spec.task, spec.attempt, self.settings, environment, self.context)
                _write_json(result_path, skipped)
            if result_path.exists():
                done[spec.trial_id] = json.loads(result_path.read_text())
            else:
                todo.append(spec)
        return todo, done

    def run(
        self,
        scheduler: TrialScheduler,
        decode: Callable[[Sequence[int]], str],
        *,
        on_trial: Callable[[dict[str, Any], int, int], None] | None = None,
        poll_sec: float = 0.5,
        on_poll: Callable[[int], None] | None = None,
        stop: threading.Event | None = None,
    ) -> dict[str, Any]:
        """Run the trials not yet written (each result.json as its trial finishes), then the
        aggregate. `stop` (set by a signal handler): raise KeyboardInterrupt at the next poll,
        after cancelling the running trials; the finished ones are kept for the next run."""
        started = time.time()
        todo, results = self.prepare()
        rollout = scheduler.start(todo) if todo else None
        delivered = 0
        try:
            while rollout is not None and delivered < len(todo):
                if stop is not None and stop.is_set():
                    raise KeyboardInterrupt("stop requested")
                trial = rollout.next(timeout_sec=poll_sec)
                if trial is None:
                    if on_poll is not None:
                        on_poll(rollout.running())
                    continue
                delivered += 1
                if trial.fate is TrialFate.CANCELLED:  # interrupted: not a result, rerun on resume
                    continue
                results[trial.trial_id] = write_trial(
                    self.job_dir, trial, self.settings, decode, self.environments.get(trial.task.task_id),
                    self.context, None if self.annotate is None else self.annotate(trial.trial_id),
                )
                if on_trial is not None:
                    on_trial(results[trial.trial_id], len(results), len(self.specs))
        finally:
            if rollout is not None:
                rollout.cancel()
                rollout.join()
        ours = aggregate(results.values(), self.load_errors, self.settings.attempts)
        finished = [r for r in results.values() if "agent_info" in r]  # Harbor's fields (format 2)
        result = {**harbor.job_fields(self.identity, finished, len(self.specs), time.time()), **ours}
        _write_json(self.job_dir / "result.json", result)
        _write_json(
            self.job_dir / "timing.json",
            {"finished_at": time.time(), "wall_sec_this_run": time.time() - started, "trials_run": len(todo)},
        )
        return result


def trial_results(job_dir: str | Path) -> list[dict[str, Any]]:
    """Every trial's result.json in a job directory, in trial-directory order (read once; the
    functions below take this list)."""
    return [json.loads(path.read_text()) for path in sorted(Path(job_dir).glob("*/result.json"))]


def task_families(results: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Task id -> template family (`Task.family`) of the trials that name one."""
    return {task_of(result): result["family"] for result in results if result.get("family")}


def per_task(results: Iterable[Mapping[str, Any]], key: str = "resolved") -> dict[str, list[float]]:
    """Each task's trial outcomes (`key` of the trials' results); skipped trials are left out,
    errored ones count as written (0)."""
    outcomes: dict[str, list[float]] = defaultdict(list)
    for result in results:
        if not result["skipped"]:
            outcomes[task_of(result)].append(float(result[key]))
    return dict(outcomes)
