"""The agents of `t1jax eval` that are not a model: `oracle` and `nop`, as Harbor has them.

Both are scripted policies behind `t1jax.agent.scripted.ScriptedSampler`, so they reach the
sandbox through exactly the harness path a model does (prompt ids in, a tool call out, the
command typed into the terminal, the observation back). They exist to prove an environment and
its verifier before a model's score is trusted: the oracle must resolve every sound task, the
no-op none.

- `oracle`: first reply: the task's reference solution (`sandbox_service.check_tasks.
  solution.solution_commands`: upload lines, then the line that runs it), each as a `shell` call, the last
  one followed by a completion marker; later replies wait (an empty command) until the marker
  appears in the terminal output, then call `task_complete` and confirm it.
- `nop`: calls `task_complete` at once and confirms it.

A multi-step task's oracle plays each step as above with the step's reference solution
(`sandbox_service.steps.step_view`): the step is the last `[step i of n: name]` header in the
prompt (`prompts.STEP_HEADER`), and only the conversation after it counts.

Invariant: a policy reply depends only on its task and the prompt it is given, so a resumed
evaluation replays exactly.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from sandbox_service.contracts import Task
from sandbox_service.solution import solution_commands
from sandbox_service.steps import step_view
from t1jax.agent import prompts
from t1jax.agent.chat_template import render_tool_call_text
from t1jax.agent.parsing import SHELL, TASK_COMPLETE
from t1jax.agent.scripted import PolicyCall

# The marker is printed by arithmetic, so the typed command line (echoed by the terminal) never
# contains it: only the command's output does.
DONE_MARKER = "__T1JAX_ORACLE_DONE_42"
_DONE_COMMAND = "echo __T1JAX_ORACLE_DONE_$((40+2))"
FIRST_WAIT_SEC = 0.5
POLL_SEC = 5.0


def _shell(command: str, duration: float) -> str:
    return render_tool_call_text(SHELL, {"command": command, "duration": f"{duration:g}"})


def _complete(note: str) -> str:
    return note + "\n\n" + render_tool_call_text(TASK_COMPLETE, {})


_STEP = re.compile(
    re.escape(prompts.STEP_HEADER)
    .replace(r"\{number\}", r"(\d+)")
    .replace(r"\{total\}", r"\d+")
    .replace(r"\{name\}", r"[^\]\n]*")
)


def current_step(prompt_text: str) -> tuple[int, str]:
    """(0-based step, the prompt from that step's header on) of a multi-step task's prompt;
    (0, the whole prompt) when it has no step header."""
    matches = list(_STEP.finditer(prompt_text))
    if not matches:
        return 0, prompt_text
    return int(matches[-1].group(1)) - 1, prompt_text[matches[-1].start() :]


def _previous_replies(text: str) -> list[str]:
    """Texts of the assistant turns already in `text` (a prompt, or its current step's part)."""
    parts = text.split("<|im_start|>assistant\n")[1:-1]  # the last one is the open prompt
    return [part.split("<|im_end|>", 1)[0] for part in parts]


def _trial_of(call: PolicyCall) -> str:
    return call.request_id.rsplit("/", 1)[0]  # the harness names requests f"{trial_id}/{n}"


class TaskBook:
    """Which task each trial plays (the oracle needs the task's solution; the prompt alone does
    not identify it). Thread-safe; the evaluator registers every trial before launching it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[str, Task] = {}

    def register(self, trial_id: str, task: Task) -> None:
        with self._lock:
            self._tasks[trial_id] = task

    def task_of(self, call: PolicyCall) -> Task:
        with self._lock:
            return self._tasks[_trial_of(call)]


def oracle_policy(book: TaskBook, *, max_command_sec: float = 60.0) -> Callable[[PolicyCall], str]:
    """The oracle (module docstring). The solution's lines go out over as many replies as the
    token budget needs (a reply of B bytes is at most B tokens of a byte-level tokenizer); then
    it waits for the completion marker, then completes."""

    def wait(polls: int) -> float:  # 0.5 s, 1 s, 2 s, ... up to POLL_SEC: quick tasks end quickly
        return min(FIRST_WAIT_SEC * 2**polls, POLL_SEC, max_command_sec)

    def policy(call: PolicyCall) -> str:
        if prompts.CONFIRM_COMPLETION in call.last_user_text:
            return _complete("The reference solution ran to its end; confirming.")
        task = book.task_of(call)
        index, text = current_step(call.prompt_text) if task.steps else (0, call.prompt_text)
        *upload, run = solution_commands(step_view(task, index))
        plan = [_shell(line, 0.1) for line in upload] + [_shell(f"{run}; {_DONE_COMMAND}", wait(0))]
        sent = sum(reply.count(f"<function={SHELL}>") for reply in _previous_replies(text))
        if sent < len(plan):
            head = "Running the task's reference solution.\n\n"
            budget = call.max_new_tokens - len(head) - 8
            batch, size = [], 0
            for rendered in plan[sent:]:
                if batch and size + len(rendered.encode()) > budget:
                    break
                batch.append(rendered)
                size += len(rendered.encode()) + 1
            return head + "\n".join(batch)
        if DONE_MARKER in text:
            return _complete("The reference solution finished.")
        return "Waiting for the reference solution to finish.\n\n" + _shell("", wait(sent - len(plan) + 1))

    return policy


def nop_policy() -> Callable[[PolicyCall], str]:
    def policy(call: PolicyCall) -> str:
        return _complete("Doing nothing.")

    return policy
