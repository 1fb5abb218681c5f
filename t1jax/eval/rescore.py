"""`t1jax eval --rescore JOB_DIR`: score a finished job's trials again without running its agent.

No sandbox outlives its trial, so a trial's final environment is not kept; it is rebuilt: a fresh
sandbox of the task, the trial's recorded sampler replies (`agent/trajectory.json`, ATIF, the
completion ids exactly) typed into it through the same harness, then the task's verifier as it is
now. No model runs. The new job (`JOB_DIR-rescored` unless `--out`) has the old job's settings,
trials and names (agent `replay`), so `t1jax compare NEW --against JOB_DIR` pairs them trial by
trial; each trial's result says what was replayed (`rescore`) and its Harbor config names the
source trial (`source_trial`, Harbor's regrade).

Invariants:
- A trial that cannot be rescored is listed as skipped with the reason (it never finished, was
  skipped, has no recorded replies, or was written before ATIF trajectories); nothing of the old
  job is changed.
- The replay sends the recorded ids whatever the environment answers, and records the first call
  whose prompt differs from the recorded one (`diverged_at_call`: the environment answered
  differently, e.g. timing-dependent output), so a rescore that did not reproduce the state is
  visible. Past the recorded replies (a trial the deadline or a cancel cut short) it completes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from t1jax.agent import prompts
from t1jax.agent.chat_template import render_tool_call_text
from t1jax.agent.parsing import TASK_COMPLETE


@dataclass(frozen=True)
class RecordedTrial:
    """One old trial's sampler calls, in order: the prompt ids each was given and the ids it sent."""

    source: Path
    prompts: tuple[tuple[int, ...], ...]
    completions: tuple[tuple[int, ...], ...]
    reward: float | None = None


def recorded_trial(trial_dir: Path) -> RecordedTrial | str:
    """The trial's recorded calls, or why it cannot be replayed."""
    result_path = trial_dir / "result.json"
    if not result_path.exists():
        return "the trial never finished in the source job"
    result = json.loads(result_path.read_text())
    if result.get("skipped"):
        return f"the trial was skipped in the source job: {result.get('detail', '')[:300]}"
    path = trial_dir / "agent" / "trajectory.json"
    if not path.exists():
        return "the trial has no recorded trajectory (no sandbox was created for it)"
    document = json.loads(path.read_text())
    if "steps" not in document:
        return "the trajectory was written before ATIF trajectories (job format 1): no replies to replay"
    prompts_, completions = [], []
    previous: list[int] | None = None
    for step in document["steps"]:
        if step["source"] != "agent":
            previous = None
            continue
        metrics = step["metrics"]
        if metrics.get("prompt_token_ids") is not None:
            prompt = list(metrics["prompt_token_ids"])
        else:
            prompt = list(previous or []) + list(step["extra"]["t1jax"]["prompt_glue_ids"])
        completion = list(metrics["completion_token_ids"])
        prompts_.append(tuple(prompt))
        completions.append(tuple(completion))
        previous = prompt + completion
    if not completions:
        return "the trial has no recorded replies"
    return RecordedTrial(trial_dir, tuple(prompts_), tuple(completions), result.get("reward"))


@dataclass
class Replay:
    """The replay policy's state over a job: which trial replays what, what happened."""

    records: Mapping[str, RecordedTrial]
    _lock: threading.Lock = field(default_factory=threading.Lock)
    diverged: dict[str, int] = field(default_factory=dict)
    replayed: dict[str, int] = field(default_factory=dict)
    extra: dict[str, int] = field(default_factory=dict)

    def policy(self, call):
        trial, number = call.request_id.rsplit("/", 1)
        index = int(number) - 1  # the harness numbers a trial's requests from 1
        record = self.records[trial]
        with self._lock:
            if index < len(record.completions):
                self.replayed[trial] = index + 1
                prompt = tuple(int(t) for t in call.prompt_ids)
                if trial not in self.diverged and prompt != record.prompts[index]:
                    self.diverged[trial] = index + 1
                return list(record.completions[index])
            self.extra[trial] = self.extra.get(trial, 0) + 1
        note = "The recorded replies are exhausted; ending the trial."
        if prompts.CONFIRM_COMPLETION in call.last_user_text:
            note = "Confirming."
        return note + "\n\n" + render_tool_call_text(TASK_COMPLETE, {})

    def annotation(self, trial_id: str) -> dict[str, Any]:
        record = self.records[trial_id]
        with self._lock:
            return {
                "rescore": {
                    "source_trial": str(record.source),
                    "recorded_calls": len(record.completions),
                    "replayed_calls": self.replayed.get(trial_id, 0),
                    "extra_calls": self.extra.get(trial_id, 0),
                    "diverged_at_call": self.diverged.get(trial_id),
                    "source_reward": record.reward,
                }
            }


def plan_rescore(source: Path, trial_ids) -> tuple[Replay, dict[str, str]]:
    """(the replay of every trial that can be replayed, {trial id: why not} for the others)."""
    records, not_runnable = {}, {}
    for trial_id in trial_ids:
        recorded = recorded_trial(source / trial_id)
        if isinstance(recorded, str):
            not_runnable[trial_id] = f"not rescored: {recorded}"
        else:
            records[trial_id] = recorded
    return Replay(records), not_runnable


def source_settings(job_dir: Path) -> dict[str, Any]:
    """The `EvalSettings` fields of a finished job (ValueError naming what is wrong)."""
    path = job_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"--rescore {job_dir}: no config.json; is it a `t1jax eval` job directory?")
    try:
        settings = json.loads(path.read_text())["settings"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--rescore {job_dir}: config.json has no t1jax settings") from None
    if settings.get("agent") == "replay":
        settings = {**settings, "agent": "replay"}
    return settings
