"""The demonstrator: a scripted, deliberately imperfect agent whose trials become SFT data.

A task of the synthetic suite carries its demonstration plan (`solution/plan.json`, written by
`t1jax.data.suite`): per numbered step, the inspection commands, the actions, and the idiom's
plausible-but-wrong variants with the rate the demonstrator uses one of them. `script_for`
draws one demonstration from a plan (which steps go wrong, and how); `Demonstrator` is the
policy (`t1jax.agent.scripted.Policy`) of any number of concurrent trials, each identified by
its trial id, that replays those scripts through the real harness.

Reply format (what the SFT model learns to write): a note that restates the step, `Step k: <the
step's sentence>` (ending `I look first.` before an inspection command and `Now I act.` on the
turn after it), a blank line, one `shell` call; after the last step `All steps are done.` and
`task_complete`; asked to confirm, `Confirmed.` and `task_complete` again. Restating the step is
the "analyse and plan" part of a Terminus reply; for a tiny model it also turns a long-range
lookup (which instruction line is next, and what it names) into a copy of the line followed by a
local translation of it into a command, which is far easier to learn. The demonstrator
never reacts to what a command printed (a failed mistake goes uncorrected), as rejection-sampled
trajectories that still earned partial credit would not: the verifier, not the demonstrator,
says what went wrong.

Invariant: a script is a pure function of (plan, rng state, habits); the inspection of a step
always precedes its action, so the observation the action's slot value comes from is in the
context.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sandbox_service.contracts import Task
from t1jax.agent.chat_template import render_tool_call_text
from t1jax.agent.parsing import SHELL, TASK_COMPLETE
from t1jax.agent.prompts import CONFIRM_COMPLETION
from t1jax.agent.scripted import PolicyCall
from t1jax.data.suite import PLAN_FILE

DONE_REPLY = "All steps are done.\n\n" + render_tool_call_text(TASK_COMPLETE, {})
CONFIRM_REPLY = "Confirmed.\n\n" + render_tool_call_text(TASK_COMPLETE, {})


def shell_reply(note: str, command: str) -> str:
    return f"{note}\n\n" + render_tool_call_text(SHELL, {"command": command})


@dataclass(frozen=True)
class DemoScript:
    """One demonstration of one task: the action replies in order, and which steps went wrong.

    `mistakes` holds (step number, mistake name) for every step done the wrong way; after the
    replies the demonstrator declares completion and confirms it."""

    task_id: str
    replies: tuple[str, ...]
    mistakes: tuple[tuple[int, str], ...]

    @property
    def num_steps(self) -> int:
        return len(self.replies)


def load_plan(task: Task) -> dict:
    """The demonstration plan of a suite task (`solution/plan.json` next to `solve.sh`)."""
    if task.solution_script is None:
        raise ValueError(f"task {task.task_id} has no solution directory, hence no {PLAN_FILE}")
    path = Path(task.solution_script).parent / PLAN_FILE
    if not path.is_file():
        raise ValueError(
            f"task {task.task_id} has no {path.relative_to(task.source_dir)}: only tasks written by "
            f"`t1jax tasks generate` can be demonstrated"
        )
    return json.loads(path.read_text())


def script_for(plan: dict, rng: random.Random, habits: Mapping[str, float] | None = None) -> DemoScript:
    """Draw one demonstration: each step is done its correct way, or (with the idiom's mistake
    rate) one of its mistakes chosen uniformly.

    `habits` (mistake name -> rate): mistakes the demonstrator makes by habit. A step that offers
    one is done that wrong way at the habit's rate instead (the first habit it offers, in the
    step's order), whatever its idiom's rate. Above 0.5 the mistake is the demonstration's mode,
    so a policy imitating it makes the mistake when it decodes greedily: a systematic error that
    only the verifier's reward can teach away, as a rejection-sampled SFT set inherits its
    sampler's systematic errors."""
    replies: list[str] = []
    mistakes: list[tuple[int, str]] = []
    habits = habits or {}
    for step in plan["steps"]:
        note = f"Step {step['number']}: {step['sentence']}"
        for command in step["inspect"]:
            replies.append(shell_reply(f"{note} I look first.", command))
        actions = step["actions"]
        habitual = next((m for m in step["mistakes"] if m["name"] in habits), None)
        if habitual is not None:
            if rng.random() < habits[habitual["name"]]:
                actions = habitual["actions"]
                mistakes.append((step["number"], habitual["name"]))
        elif step["mistakes"] and rng.random() < step["mistake_rate"]:
            mistake = rng.choice(step["mistakes"])
            actions = mistake["actions"]
            mistakes.append((step["number"], mistake["name"]))
        for command in actions:
            replies.append(shell_reply(f"{note} Now I act." if step["inspect"] else note, command))
    return DemoScript(plan["task_id"], tuple(replies), tuple(mistakes))


def previous_replies(call: PolicyCall) -> int:
    """Assistant turns already in the prompt (the trailing generation prompt excluded)."""
    return call.prompt_text.count("<|im_start|>assistant\n") - 1


class Demonstrator:
    """Policy for `ScriptedSampler`: routes each request to its trial's script by request id
    (`<trial id>/<n>`, the harness's convention). Thread-safe."""

    def __init__(self) -> None:
        self._scripts: dict[str, DemoScript] = {}
        self._lock = threading.Lock()

    def add(self, trial_id: str, script: DemoScript) -> None:
        with self._lock:
            if trial_id in self._scripts:
                raise ValueError(f"trial id {trial_id!r} already has a script")
            self._scripts[trial_id] = script

    def remove(self, trial_id: str) -> None:
        with self._lock:
            self._scripts.pop(trial_id, None)

    def __call__(self, call: PolicyCall) -> str:
        trial_id = call.request_id.rsplit("/", 1)[0]
        with self._lock:
            script = self._scripts[trial_id]
        done = previous_replies(call)
        # Asked to confirm; or completion was declared already and the confirmation request did
        # not fit the observation (a long trial near the end of its context window).
        if CONFIRM_COMPLETION in call.last_user_text or done > len(script.replies):
            return CONFIRM_REPLY
        return script.replies[done] if done < len(script.replies) else DONE_REPLY
