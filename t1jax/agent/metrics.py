"""Flat metrics over a batch of trajectories: outcomes, turns, and context compaction.

`trial_metrics(trajectories)` returns `agent/*` and `compaction/*` numbers for a run directory.
Compaction is measured the way paper §9.2 says it must be watched: how often it ran, how often
it failed and why, how much of each summary survived into the next segment, and how often it
thrashed (a compacted segment that held at most one action turn).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from t1jax.tito.types import CompactionFailure, Trajectory, TrialStatus


def trial_metrics(trajectories: Iterable[Trajectory]) -> dict[str, float]:
    trajectories = list(trajectories)
    count = len(trajectories)
    metrics: dict[str, float] = {"agent/trials": float(count)}
    statuses = Counter(t.status for t in trajectories)
    for status in TrialStatus:
        metrics[f"agent/status_{status.value}"] = float(statuses[status])
    if count:
        for name in (
            "action_turns",
            "summary_turns",
            "parse_errors",
            "commands_run",
            "command_timeouts",
            "outputs_truncated",
            "generate_sec",
            "environment_sec",
            "wall_sec",
        ):
            metrics[f"agent/mean_{name}"] = sum(getattr(t.stats, name) for t in trajectories) / count
    events = [event for t in trajectories for event in t.compactions]
    metrics["compaction/events"] = float(len(events))
    metrics["compaction/trials_compacted"] = float(sum(bool(t.compactions) for t in trajectories))
    failures = Counter(event.failure for event in events)
    for cause in CompactionFailure:
        if cause is not CompactionFailure.NONE:
            metrics[f"compaction/failed_{cause.value}"] = float(failures[cause])
    metrics["compaction/failure_rate"] = (
        (sum(not e.succeeded for e in events) / len(events)) if events else 0.0
    )
    written = sum(e.summary_chars for e in events)
    metrics["compaction/summary_chars_kept_fraction"] = (
        sum(e.summary_chars_kept for e in events) / written if written else 0.0
    )
    metrics["compaction/mean_summary_tokens"] = (
        (sum(e.summary_tokens for e in events) / len(events)) if events else 0.0
    )
    metrics["compaction/thrashing"] = float(sum(e.segment_action_turns <= 1 for e in events))
    return metrics
