"""Metrics of a rollout batch: what the trials did, where their time went, and what the
oversampling cut away (paper §4.4, §9.3, §10). Flat `name -> float` dicts for `metrics.jsonl`.

- `rollout_metrics(trials)`: fates and failure causes, turns and tokens per trial, the wall-time
  split (queue / create / sampler / sandbox exec / verify / close), plus `t1jax.agent.metrics`
  (finish statuses, compaction) and `t1jax.tito.audit` (boundary cases, drift, re-tokenised history)
  over the trials that were assembled.
- `selection_metrics(batch)`: the composition of the admitted, dropped, cancelled and failed sets
  of one oversampling step by category, difficulty and turn count, and for each axis the total
  variation distance between what was launched and what was admitted: the selection bias of §9.3
  as one number per axis per step (0: the tail was cut without favouring anything).
- `group_metrics(outcomes)`: with several rollouts of one task in a batch
  (`schedule.rollouts_per_task` > 1), how many such groups there were and the share whose
  rewards, and whose resolved outcomes, differ: a group that scored the same throughout gives a
  per-task baseline nothing to prefer (the controller passes the (task, reward, resolved) of the
  admitted trials: what the learner trains on).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from t1jax.agent.metrics import trial_metrics
from t1jax.runtime.scheduler import CollectedBatch, FailureCause, FinishedTrial, TrialFate
from t1jax.tito.audit import audit_metrics


def turns_bucket(action_turns: int) -> str:
    """Turn counts: exact below 8, then in powers of two: 0, 1, ..., 7, 8-15, 16-31, ..."""
    if action_turns < 8:
        return str(action_turns)
    low = 1 << (action_turns.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rollout_metrics(trials: Iterable[FinishedTrial], prefix: str = "rollout") -> dict[str, float]:
    trials = list(trials)
    metrics: dict[str, float] = {f"{prefix}/trials": float(len(trials))}
    fates = Counter(trial.fate for trial in trials)
    for fate in TrialFate:
        metrics[f"{prefix}/{fate.value}"] = float(fates[fate])
    causes = Counter(trial.cause for trial in trials if trial.cause is not None)
    for cause in FailureCause:
        if causes[cause]:
            metrics[f"{prefix}/failed_{cause.value}"] = float(causes[cause])
    played = [trial for trial in trials if trial.trajectory is not None]
    metrics[f"{prefix}/never_started"] = float(sum(not trial.started for trial in trials))
    if played:
        turns = [trial.action_turns for trial in played]
        metrics[f"{prefix}/turns_mean"] = _mean(turns)
        metrics[f"{prefix}/turns_max"] = float(max(turns))
        completion = [sum(len(t.completion_ids) for t in trial.trajectory.turns) for trial in played]
        context = [
            sum(
                len(seg.turns[-1].prompt_ids) + len(seg.turns[-1].completion_ids)
                for seg in trial.trajectory.segments
            )
            for trial in played
        ]
        metrics[f"{prefix}/completion_tokens_mean"] = _mean(completion)
        metrics[f"{prefix}/completion_tokens_total"] = float(sum(completion))
        metrics[f"{prefix}/stream_tokens_mean"] = _mean(context)
        metrics[f"{prefix}/stream_tokens_max"] = float(max(context))
    started = [trial for trial in trials if trial.started]
    for phase in ("queue", "create", "agent", "generate", "environment", "verify", "close"):
        metrics[f"{prefix}/time_{phase}_sec_mean"] = _mean([getattr(t.timings, phase) for t in started])
    total = sum(t.timings.total for t in started)
    if total > 0:
        for phase in ("queue", "create", "generate", "environment", "verify", "close"):
            metrics[f"{prefix}/time_{phase}_fraction"] = (
                sum(getattr(t.timings, phase) for t in started) / total
            )
    metrics.update({f"{prefix}/{k}": v for k, v in trial_metrics(t.trajectory for t in played).items()})
    # Partial rollouts: trials continued from an earlier rollout, the tokens they did not have to
    # generate again, and how many of those an older policy version sampled (context only).
    continued = [trial for trial in trials if trial.continued and trial.trajectory is not None]
    metrics[f"{prefix}/continued_trials"] = float(len(continued))
    metrics[f"{prefix}/reused_tokens"] = float(
        sum(
            len(t.completion_ids) for trial in continued for t in trial.trajectory.turns[: trial.reused_turns]
        )
    )
    metrics[f"{prefix}/reused_tokens_older_version"] = float(
        sum(
            s.audit.masked_older_version
            for trial in continued
            if trial.assembly
            for s in trial.assembly.samples
        )
    )
    samples = [s for trial in trials if trial.assembly is not None for s in trial.assembly.samples]
    if samples:
        metrics.update({f"{prefix}/{k}": v for k, v in audit_metrics(samples).items()})
    return metrics


AXES = {
    "category": lambda trial: trial.category,
    "difficulty": lambda trial: trial.difficulty.value,
    "turns": lambda trial: turns_bucket(trial.action_turns),
}


def composition(trials: Iterable[FinishedTrial], axis: str) -> Counter[str]:
    return Counter(AXES[axis](trial) for trial in trials)


def total_variation(launched: Counter[str], kept: Counter[str]) -> float:
    """0.5 * sum |p - q| between two count distributions (0 when either is empty)."""
    n, m = sum(launched.values()), sum(kept.values())
    if not n or not m:
        return 0.0
    return 0.5 * sum(abs(launched[key] / n - kept[key] / m) for key in set(launched) | set(kept))


def selection_metrics(batch: CollectedBatch, prefix: str = "tail") -> dict[str, float]:
    """Counts per class and axis value, per-value admission rates, and the bias per axis.

    The turns axis describes each trial as it ended (a cancelled trial by the turns it had run),
    so cancelled and admitted turn counts are not comparable as a launch distribution; its
    distance is reported between the admitted and the cancelled sets instead (how much longer the
    trials the tail cut were)."""
    classes = {
        "admitted": batch.admitted,
        "dropped": batch.dropped,
        "cancelled": batch.cancelled,
        "failed": batch.failed,
        "paused": batch.paused,
    }
    launched = batch.all
    metrics: dict[str, float] = {
        f"{prefix}/launched": float(len(launched)),
        f"{prefix}/n_admit": float(batch.n_admit),
        f"{prefix}/wall_sec": batch.wall_sec,
    }
    for name, trials in classes.items():
        metrics[f"{prefix}/{name}"] = float(len(trials))
    metrics[f"{prefix}/cancelled_never_started"] = float(sum(not t.started for t in batch.cancelled))
    for axis in AXES:
        counts = {name: composition(trials, axis) for name, trials in classes.items()}
        everything = composition(launched, axis)
        for value in sorted(everything):
            for name in classes:
                metrics[f"{prefix}/{axis}/{value}/{name}"] = float(counts[name][value])
            metrics[f"{prefix}/{axis}/{value}/admitted_rate"] = counts["admitted"][value] / everything[value]
        if axis == "turns":
            metrics[f"{prefix}/bias_turns"] = total_variation(counts["cancelled"], counts["admitted"])
        else:
            metrics[f"{prefix}/bias_{axis}"] = total_variation(everything, counts["admitted"])
    return metrics


def group_metrics(outcomes: Iterable[tuple[str, float, bool]], prefix: str = "reward") -> dict[str, float]:
    """Over (task id, reward, resolved) of each trial trained on: `{prefix}/groups`, the tasks with
    more than one trial; `{prefix}/groups_reward_varies` / `groups_resolved_varies`, the share of
    those whose rewards / resolved outcomes are not all equal. Empty when no task has two."""
    by_task: dict[str, list[tuple[float, bool]]] = {}
    for task_id, reward, solved in outcomes:
        by_task.setdefault(task_id, []).append((reward, solved))
    groups = [group for group in by_task.values() if len(group) > 1]
    if not groups:
        return {}
    return {
        f"{prefix}/groups": float(len(groups)),
        f"{prefix}/groups_reward_varies": sum(len({r for r, _ in g}) > 1 for g in groups) / len(groups),
        f"{prefix}/groups_resolved_varies": sum(len({s for _, s in g}) > 1 for g in groups) / len(groups),
    }
