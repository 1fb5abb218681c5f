"""Harbor's fields in the job records `t1jax eval` writes: job and trial `config.json` /
`result.json` that Harbor's own models (`JobConfig`, `JobResult`, `TrialConfig`, `TrialResult`)
and its job reader (`harbor.viewer.scanner.JobScanner`, the viewer's API) accept and read as
meaning what we meant.

This module owns the mapping from a finished trial / a job to Harbor's field names and shapes;
it does not import `harbor` (the writer runs in the project's venv, Harbor needs Python 3.12),
so `tests/harbor` checks every field against the installed package instead.

Invariants:
- Every Harbor field we write is one of its model's fields with its type; our own fields sit
  beside them under names Harbor does not use (its models ignore unknown keys).
- `stats` of a job's result.json is what `JobStats.from_trial_results` plus Harbor's `Mean` metric
  and `compute_pass_at_k_by_evals` derive from the trial results on disk (the tests recompute it).
- A trial has `verifier_result` exactly when its verifier ran to a reward we count, and
  `exception_info` exactly when it errored or was skipped (`error_type` names our cause in
  Harbor's CamelCase `...Error` convention, so its error policy treats it as an unknown error).
- Times are ISO 8601 in UTC. A trial's phase times are rebuilt from its measured phase
  durations, ending at the moment its record was written (the scheduler measures durations,
  not instants).
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# t1jax agent -> Harbor name
AGENT_NAMES = {"oracle": "oracle", "nop": "nop", "model": "t1jax", "replay": "t1jax-replay"}
SCHEMA_VERSION = 1  # Harbor's JobResult / TrialResult / TrialConfig schema_version
# A trial's Harbor id is a function of its job's id and its name (a resumed job keeps both).
_TRIAL_NAMESPACE = uuid.UUID("5b0f7c52-3a57-4bb4-9d0e-5f3a9f0c1e21")


def t1jax_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("t1jax")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def iso(unix_time: float) -> str:
    return datetime.fromtimestamp(unix_time, UTC).isoformat()


def error_type(cause: str) -> str:
    """Our failure cause (`sandbox_create_failed`) in Harbor's exception naming
    (`SandboxCreateFailedError`)."""
    return "".join(part.capitalize() for part in cause.split("_") if part) + "Error"


def task_digest(task_dir: Path) -> str:
    """sha256 over the task directory's files (relative path and content, in path order).
    Harbor's own `Task.checksum` is dirhash's protocol over a filtered tree, a different digest
    of the same content (docs/harbor.md)."""
    digest = hashlib.sha256()
    root = Path(task_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def agent_info(agent: str, checkpoint: str | None) -> dict[str, Any]:
    """Harbor's `AgentInfo`: the agent's name and version, the model for a checkpoint."""
    info: dict[str, Any] = {"name": AGENT_NAMES[agent], "version": t1jax_version()}
    if agent == "model":
        info["model_info"] = {"name": Path(str(checkpoint)).name or str(checkpoint), "provider": "t1jax"}
    return info


def agent_config(agent: str, checkpoint: str | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Harbor's `AgentConfig` for the agent (the oracle and no-op agents by Harbor's own names,
    a checkpoint as the t1jax agent for `harbor run --agent-import-path`)."""
    if agent == "model":
        return {
            "import_path": "t1jax.harbor.agent:T1jaxAgent",
            "model_name": checkpoint,
            "kwargs": dict(kwargs),
        }
    return {"name": AGENT_NAMES[agent], "kwargs": dict(kwargs)}


def trial_uuid(job_id: str, trial_name: str) -> str:
    return str(uuid.uuid5(_TRIAL_NAMESPACE, f"{job_id}/{trial_name}"))


def trial_config(
    *, job_id: str, job_dir: Path, trial_name: str, task_dir: Path, agent: Mapping[str, Any],
    backend: str | None,
) -> dict[str, Any]:  # fmt: skip
    """Harbor's `TrialConfig` of one trial."""
    return {
        "schema_version": SCHEMA_VERSION,
        "task": {"path": str(task_dir)},
        "trial_name": trial_name,
        "trials_dir": str(job_dir),
        "agent": dict(agent),
        "environment": {
            "import_path": "t1jax.harbor.environment:T1jaxEnvironment",
            "kwargs": {"backend": backend},
        },
        "job_id": job_id,
    }


def phase_times(durations: Mapping[str, float] | None, finished_at: float) -> dict[str, Any]:
    """Harbor's trial `started_at` / `finished_at` and per-phase `TimingInfo` from our phase
    durations (queue, create, agent, verify, close) ending at `finished_at`."""
    if durations is None:  # never started
        return {"started_at": None, "finished_at": iso(finished_at)}
    close_start = finished_at - durations["close"]
    verify_start = close_start - durations["verify"]
    agent_start = verify_start - durations["agent"]
    create_start = agent_start - durations["create"]
    return {
        "started_at": iso(create_start),
        "finished_at": iso(finished_at),
        "environment_setup": {"started_at": iso(create_start), "finished_at": iso(agent_start)},
        "agent_execution": {"started_at": iso(agent_start), "finished_at": iso(verify_start)},
        "verifier": {"started_at": iso(verify_start), "finished_at": iso(close_start)},
    }


def trial_fields(
    *, job_id: str, job_dir: Path, trial_name: str, task_name: str, task_dir: Path, source: str | None,
    agent: str, checkpoint: str | None, reward: float | None, error: tuple[str, str] | None,
    durations: Mapping[str, float] | None, finished_at: float, tokens: tuple[int, int] | None,
    config: Mapping[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Harbor's `TrialResult` fields of one trial. `reward`: the verifier's reward when it counts
    (None: no valid reward); `error`: (cause, detail) of an errored or skipped trial;
    `tokens`: (prompt, completion) tokens over the trial's sampler calls; `config`: the trial's
    `TrialConfig` (its config.json's)."""
    directory = Path(job_dir) / trial_name
    fields: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "id": trial_uuid(job_id, trial_name),
        "task_name": task_name,
        "trial_name": trial_name,
        "trial_uri": directory.resolve().as_uri(),
        "task_id": {"path": str(task_dir)},
        "source": source,
        "task_checksum": task_digest(task_dir),
        "config": dict(config),
        "agent_info": agent_info(agent, checkpoint),
        "agent_result": None
        if tokens is None
        else {
            "n_input_tokens": tokens[0],
            "n_output_tokens": tokens[1],
            "n_cache_tokens": 0,
            "cost_usd": 0.0,
        },
        "verifier_result": None if reward is None else {"rewards": {"reward": reward}},
        "exception_info": None
        if error is None
        else {
            "exception_type": error_type(error[0]),
            "exception_message": error[1],
            "exception_traceback": "",
            "occurred_at": iso(finished_at),
        },
        **phase_times(durations, finished_at),
    }
    return fields


def evals_key(result: Mapping[str, Any]) -> str:
    """Harbor's `JobStats.format_agent_evals_key` of a trial result."""
    info = result["agent_info"]
    model = (info.get("model_info") or {}).get("name")
    dataset = result.get("source") or "adhoc"
    return f"{info['name']}__{model}__{dataset}" if model else f"{info['name']}__{dataset}"


def _eligible_ks(max_k: int) -> list[int]:
    """The k Harbor reports pass@k for: powers of two from 2 and multiples of 5, up to `max_k`."""
    ks = {k for k in (2**e for e in range(1, 64)) if k <= max_k} | set(range(5, max_k + 1, 5))
    return sorted(ks)


def _harbor_pass_at_k(results: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Harbor's pass@k for one evals group: tasks' binary rewards, k as `_eligible_ks`; empty
    when a reward is not 0 or 1."""
    per_task: dict[str, list[int]] = defaultdict(list)
    for r in results:
        if r.get("verifier_result") is None or _reward_invalid(r):
            continue
        value = r["verifier_result"]["rewards"]["reward"]
        if value not in (0, 1):
            return {}
        per_task[r["task_name"]].append(int(value))
    if not per_task:
        return {}
    out = {}
    for k in _eligible_ks(min(len(v) for v in per_task.values())):
        total = 0.0
        for successes in per_task.values():
            n, c = len(successes), sum(successes)
            total += 1.0 if n - c < k else 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))
        out[str(k)] = total / len(per_task)
    return out


def _reward_invalid(result: Mapping[str, Any]) -> bool:
    # Our exception types are unknown to Harbor's error policy, which keeps their rewards valid;
    # we never write a reward on an errored trial, so a reward is valid exactly when present.
    return result.get("verifier_result") is None


def job_stats(results: Iterable[Mapping[str, Any]], n_total_trials: int) -> dict[str, Any]:
    """Harbor's `JobStats` of a finished job from its trials' results (module invariant)."""
    results = sorted(results, key=lambda r: r["trial_name"])
    evals: dict[str, dict[str, Any]] = {}
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    n_errored = 0
    n_input = n_output = None
    for r in results:
        key = evals_key(r)
        groups[key].append(r)
        stats = evals.setdefault(
            key, {"n_trials": 0, "n_errors": 0, "metrics": [], "pass_at_k": {}, "reward_stats": {},
                  "exception_stats": {}},
        )  # fmt: skip
        if not _reward_invalid(r):
            stats["n_trials"] += 1
            for name, value in r["verifier_result"]["rewards"].items():
                stats["reward_stats"].setdefault(name, {}).setdefault(repr(float(value)), []).append(
                    r["trial_name"]
                )
        if r.get("exception_info") is not None:
            stats["exception_stats"].setdefault(r["exception_info"]["exception_type"], []).append(
                r["trial_name"]
            )
            stats["n_errors"] += 1
            n_errored += 1
        context = r.get("agent_result")
        if context is not None:
            n_input = (n_input or 0) + context["n_input_tokens"]
            n_output = (n_output or 0) + context["n_output_tokens"]
    for key, rows in groups.items():
        rewards = [r["verifier_result"]["rewards"]["reward"] for r in rows if not _reward_invalid(r)]
        if rewards:
            evals[key]["metrics"] = [{"mean": sum(rewards) / len(rewards)}]
        evals[key]["pass_at_k"] = _harbor_pass_at_k(rows)
    return {
        "n_completed_trials": len(results),
        "n_errored_trials": n_errored,
        "n_running_trials": 0,
        "n_pending_trials": max(n_total_trials - len(results), 0),
        "n_cancelled_trials": 0,
        "n_retries": 0,
        "evals": evals,
        "n_input_tokens": n_input,
        "n_cache_tokens": None if n_input is None else 0,
        "n_output_tokens": n_output,
        "cost_usd": None if n_input is None else 0.0,
    }


def job_fields(job: Mapping[str, Any], results: Iterable[Mapping[str, Any]], n_total_trials: int,
               finished_at: float) -> dict[str, Any]:  # fmt: skip
    """Harbor's `JobResult` fields: `job` is the job's identity from its config.json (`id`,
    `started_at`, kept across resumes)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "id": job["id"],
        "started_at": job["started_at"],
        "updated_at": iso(finished_at),
        "finished_at": iso(finished_at),
        "n_total_trials": n_total_trials,
        "stats": job_stats(results, n_total_trials),
    }


def job_config(*, job_dir: Path, tasks_dir: str, attempts: int, agent: str, checkpoint: str | None,
               agent_kwargs: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Harbor's `JobConfig` fields of a job."""
    job_dir = Path(job_dir).resolve()
    return {
        "schema_version": SCHEMA_VERSION,
        "job_name": job_dir.name,
        "jobs_dir": str(job_dir.parent),
        "n_attempts": attempts,
        "agents": [agent_config(agent, checkpoint, agent_kwargs)],
        "environment": {"import_path": "t1jax.harbor.environment:T1jaxEnvironment"},
        "datasets": [{"path": tasks_dir}],
    }


# The JobResult fields that are facts of one run (its identity and wall clock), not of its
# results: a resumed job reproduces everything else in result.json exactly.
RUN_FIELDS = ("id", "started_at", "updated_at", "finished_at")
# ... and the stats that count tokens: a trial's prompts hold terminal output, whose length
# depends on timing (how far a command got when the screen was read)
RUN_STATS_FIELDS = ("n_input_tokens", "n_cache_tokens", "n_output_tokens", "cost_usd")


def verifier_reward(report) -> float:
    """The reward Harbor records for a verifier report (`sandbox_service.contracts.VerifierReport`):
    the task's reward file when it wrote one, else its pass/fail outcome; 0 for no report."""
    if report is None:
        return 0.0
    if report.reward_value is not None:
        return float(report.reward_value)
    return 1.0 if report.binary_outcome else 0.0


def verifier_report_json(report) -> dict[str, Any]:
    """A verifier report as `verifier/report.json`."""
    return {
        "parsed": report.parsed,
        "failure_cause": report.failure_cause.value,
        "binary_outcome": report.binary_outcome,
        "reward_value": report.reward_value,
        "detail": report.detail[:2000],
        "assertions": [{"name": a.name, "passed": a.passed} for a in report.assertions],
    }


def ctrf(report) -> dict[str, Any]:
    """A verifier report's per-assertion record in CTRF form (`results.tests[{name, status}]`), as
    a Harbor task's test.sh writes it with pytest-json-ctrf."""
    tests = [{"name": a.name, "status": "passed" if a.passed else "failed"} for a in report.assertions]
    return {
        "results": {
            "tool": {"name": "t1jax-verifier"},
            "summary": {"tests": len(tests), "passed": report.passed, "failed": len(tests) - report.passed},
            "tests": tests,
        }
    }
