"""Trial records for people and notebooks: a finished trial's trajectory as JSON (token ids and
decoded text), shared by the evaluator's job directories and the controller's run directories.

Each segment's stitched stream is stored once (its last turn's prompt + completion, ids and
text), then every turn's own record (its completion ids and text, where its glue starts, finish
reason, policy version), so a record grows linearly with the trial, not quadratically.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sandbox_service.contracts import VerifierReport
from t1jax.runtime.scheduler import FinishedTrial


def resolved(report: VerifierReport | None) -> bool:
    """Harbor's notion: every reported assertion passed; without a per-assertion record, the
    verifier's own task-level outcome."""
    if report is None:
        return False
    if report.parsed and report.total > 0:
        return report.passed == report.total
    return report.binary_outcome is True


def trajectory_json(trial: FinishedTrial, decode: Callable[[Sequence[int]], str]) -> dict[str, Any] | None:
    """Each segment's stitched stream once (ids and text), then every turn's own record."""
    trajectory = trial.trajectory
    if trajectory is None:
        return None
    segments = []
    for segment in trajectory.segments:
        last = segment.turns[-1]
        stream = [int(t) for t in last.full_ids]
        turns = [
            {
                "kind": turn.kind.value,
                "request_id": turn.request_id,
                "prompt_tokens": len(turn.prompt_ids),
                "glue_start": turn.glue_start,
                "completion_ids": [int(t) for t in turn.completion_ids],
                "completion_text": decode(turn.completion_ids),
                "finish_reason": turn.finish_reason.value,
                "policy_version": turn.policy_version,
                "generate_sec": round(turn.generate_sec, 4),
            }
            for turn in segment.turns
        ]
        segments.append(
            {"index": segment.index, "stream_ids": stream, "stream_text": decode(stream), "turns": turns}
        )
    return {
        "trial_id": trajectory.trial_id,
        "task_id": trajectory.task_id,
        "status": trajectory.status.value,
        "cause": trajectory.cause.value,
        "detail": trajectory.detail,
        "stats": dataclasses.asdict(trajectory.stats),
        "compactions": [dataclasses.asdict(event) for event in trajectory.compactions],
        "segments": segments,
    }


def trial_summary(trial: FinishedTrial) -> dict[str, Any]:
    """One line about a trial's fate (for logs and run directories)."""
    return {
        "trial_id": trial.trial_id,
        "task_id": trial.task.task_id,
        "category": trial.category,
        "difficulty": trial.difficulty.value,
        "fate": trial.fate.value,
        "cause": None if trial.cause is None else trial.cause.value,
        "detail": trial.detail[:500],
        "reward": None if trial.reward is None else trial.reward.reward,
        "tests_passed": None if trial.reward is None else trial.reward.passed,
        "tests_total": None if trial.reward is None else trial.reward.total,
        "action_turns": trial.action_turns,
        "policy_version": trial.policy_version,
        "timings": dataclasses.asdict(trial.timings),
    }
