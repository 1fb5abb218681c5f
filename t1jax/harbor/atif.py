"""A finished trial as an ATIF trajectory (Harbor's `agent/trajectory.json`), with the fields
RL training needs and ATIF lacks in a documented extension (docs/harbor.md, "ATIF extension").

Mapping (one ATIF step per event, `step_id` from 1):
- a segment's first prompt (the rendered system prompt and instruction, or the compacted
  context after a summary) is a `user` step whose message is the decoded prompt;
- every sampler call (an action or a summary turn) is an `agent` step: `message` the decoded
  completion, `metrics.completion_token_ids` and `metrics.logprobs` the sampled ids and the
  sampler's log-probs, `metrics.prompt_token_ids` the whole prompt where the turn does not
  extend the previous one (else None: `extra.t1jax.prompt_glue_ids` holds only what was appended,
  and the whole prompt is the previous turn's prompt + completion + that glue), `observation` the
  decoded glue the harness fed back before the next call.

The extension lives under `extra["t1jax"]` (Harbor's models allow `extra` on the trajectory and
on each step; everything else is ATIF's own fields):
- trajectory: `extension` (its version), `trial_id`, `task_id`, `status`, `cause` (the trial's
  failure cause, `none` when it has none), `trajectory_cause`, `detail`, `stats`, `compactions`,
  `boundaries` (the TITO assembler's boundary records when the trial was assembled, else None),
  `policy_versions`, `routing` (the routing record's reference: which turns recorded routing,
  its shape, and whether it is kept: routing arrays are not written to this file);
- agent step: `segment`, `turn`, `kind`, `request_id`, `finish_reason`, `policy_version`,
  `glue_start`, `prompt_glue_ids` (see above), `generate_sec`, `routing_rows` / `routing_start`.

Invariant: the token streams can be rebuilt from the file alone, id for id (tests/harbor checks
it against the trial's own turns and Harbor's `Trajectory` model validates the file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

EXTENSION = "t1jax-training/1"
SCHEMA_VERSION = "ATIF-v1.6"


def _extends(previous, turn) -> bool:
    """The turn's prompt starts with the previous turn's whole stream (token-in, no re-render)."""
    n = len(previous.prompt_ids) + len(previous.completion_ids)
    return turn.glue_start == n and len(turn.prompt_ids) >= n


def trajectory_record(
    trial, decode: Callable[[Sequence[int]], str], agent_info: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The trial's ATIF document (a dict Harbor's `Trajectory` accepts); None when no sandbox
    was ever created for it (no trajectory)."""
    trajectory = trial.trajectory
    if trajectory is None:
        return None
    model_name = (agent_info.get("model_info") or {}).get("name")
    steps: list[dict[str, Any]] = []
    routing_turns, routing_shape = 0, None
    prompt_total = completion_total = 0
    versions: set[int] = set()
    for segment in trajectory.segments:
        turns = segment.turns
        first = turns[0]
        steps.append(
            {
                "step_id": len(steps) + 1,
                "source": "user",
                "message": decode([int(t) for t in first.prompt_ids]),
                "extra": {
                    "t1jax": {"segment": segment.index, "prompt_ids": [int(t) for t in first.prompt_ids]}
                },
            }
        )
        for index, turn in enumerate(turns):
            extends = index > 0 and _extends(turns[index - 1], turn)
            glue = [int(t) for t in turn.prompt_ids[turn.glue_start :]] if extends else None
            following = turns[index + 1] if index + 1 < len(turns) else None
            observation = None
            if following is not None and _extends(turn, following):
                fed_back = decode([int(t) for t in following.prompt_ids[following.glue_start :]])
                observation = {"results": [{"content": fed_back}]}
            if turn.routing is not None:
                routing_turns += 1
                routing_shape = [int(d) for d in turn.routing.shape[1:]]
            versions.add(int(turn.policy_version))
            prompt_total += len(turn.prompt_ids)
            completion_total += len(turn.completion_ids)
            step: dict[str, Any] = {
                "step_id": len(steps) + 1,
                "source": "agent",
                "message": decode(turn.completion_ids),
                "llm_call_count": 1,
                "metrics": {
                    "prompt_tokens": len(turn.prompt_ids),
                    "completion_tokens": len(turn.completion_ids),
                    "prompt_token_ids": None if extends else [int(t) for t in turn.prompt_ids],
                    "completion_token_ids": [int(t) for t in turn.completion_ids],
                    "logprobs": [float(p) for p in turn.logprobs],
                },
                "extra": {
                    "t1jax": {
                        "segment": segment.index,
                        "turn": index,
                        "kind": turn.kind.value,
                        "request_id": turn.request_id,
                        "finish_reason": turn.finish_reason.value,
                        "policy_version": int(turn.policy_version),
                        "glue_start": turn.glue_start,
                        "prompt_glue_ids": glue,
                        "generate_sec": round(turn.generate_sec, 4),
                        "routing_rows": None if turn.routing is None else int(len(turn.routing)),
                        "routing_start": int(turn.routing_start),
                    }
                },
            }
            if model_name:
                step["model_name"] = model_name
            if observation is not None:
                step["observation"] = observation
            steps.append(step)
    assembly = getattr(trial, "assembly", None)
    cause = getattr(trial, "cause", None)
    extension = {
        "extension": EXTENSION,
        "trial_id": trajectory.trial_id,
        "task_id": trajectory.task_id,
        "fate": trial.fate.value,
        "status": trajectory.status.value,
        "cause": "none" if cause is None else cause.value,
        "trajectory_cause": trajectory.cause.value,
        "detail": trajectory.detail[:2000],
        "stats": dataclasses.asdict(trajectory.stats),
        "compactions": [_plain(dataclasses.asdict(event)) for event in trajectory.compactions],
        "boundaries": None
        if assembly is None
        else [_plain(dataclasses.asdict(record)) for record in assembly.boundaries],
        "policy_versions": sorted(versions),
        "routing": {"turns_with_routing": routing_turns, "shape": routing_shape, "kept": False},
    }
    agent = {"name": agent_info["name"], "version": agent_info["version"]}
    if model_name:
        agent["model_name"] = model_name
    return {
        "schema_version": SCHEMA_VERSION,
        "session_id": trajectory.trial_id,
        "agent": agent,
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": prompt_total,
            "total_completion_tokens": completion_total,
            "total_steps": len(steps),
        },
        "extra": {"t1jax": extension},
    }


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """Enum members as their values (dataclasses.asdict keeps them)."""
    return {k: getattr(v, "value", v) for k, v in record.items()}


def token_streams(document: Mapping[str, Any]) -> list[list[int]]:
    """Each segment's stitched stream (the last turn's prompt + completion), rebuilt from an
    ATIF document this module wrote: the check that the file alone reproduces the ids."""
    streams: list[list[int]] = []
    prompt: list[int] | None = None
    previous: list[int] | None = None
    for step in document["steps"]:
        ours = (step.get("extra") or {}).get("t1jax", {})
        if step["source"] == "user":
            if previous is not None:
                streams.append(previous)
            prompt, previous = None, None
            continue
        metrics = step["metrics"]
        if metrics["prompt_token_ids"] is not None:
            prompt = list(metrics["prompt_token_ids"])
        else:
            prompt = list(previous) + list(ours["prompt_glue_ids"])
        previous = prompt + list(metrics["completion_token_ids"])
    if previous is not None:
        streams.append(previous)
    return streams
