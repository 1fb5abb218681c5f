"""Every text the harness shows the model: system prompt, tools, observations, compaction requests.

Kept in one place so the prompt is pinned (one version per trial, reproducible) and reviewable.
`PROMPT_PROFILES` names the system prompt + tool schemas a trial starts with (`HarnessConfig.
prompt_profile`): `full` (default, Terminus-style, ~1100 tokens of the project BPE) and `compact`
(~40 tokens: no tool schemas, for tiny models trained from scratch on short contexts), and
`compact-once`: compact, and the first `task_complete` ends the trial (no confirmation round).

A multi-step task's instruction for step i is `step_instruction(...)`: a header
`[step i+1 of n: name]` (`STEP_HEADER`, the one marker a scripted policy may look for) and the
step's own instruction; from the second step on it is a new user turn (`next_step_message`) in
the same conversation, saying that the previous step is over and that its work stays in place.
A one-step task's instruction is shown as it is, with no header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from t1jax.agent.chat_template import Message, ToolSpec
from t1jax.agent.parsing import SHELL, TASK_COMPLETE

SYSTEM_PROMPT = (
    "You are an AI assistant tasked with solving command-line tasks in a Linux environment. You "
    "will be given a task description and access to a bash terminal through tools.\n\n"
    "In every reply, first analyse the current state and plan your next steps in a few sentences, "
    "then call one or more tools. The shell tool types a command into the terminal, presses Enter, "
    "waits `duration` seconds and returns the new terminal output. Choose short durations for quick "
    "commands and longer ones for builds or installs; call shell with an empty command to wait for "
    "a command that is still running. Long outputs are shortened to their beginning and end.\n\n"
    "When the task is complete, call task_complete. You will be asked to confirm; call it again to "
    "finish. Your work is then checked by tests you cannot see."
)

TOOLS = (
    ToolSpec(
        name=SHELL,
        description="Type a command into the bash terminal, press Enter, wait, and return the new output.",
        parameters={
            "type": "object",
            "properties": {
                "command": {
                    "type": "string",
                    "description": "The command line to run; empty to only wait for more output; a "
                    "single key name such as C-c (interrupt) or C-d is sent as that key.",
                },
                "duration": {
                    "type": "number",
                    "description": "Seconds to wait for output before returning (default 1, at most 60).",
                },
            },
            "required": ["command"],
        },
    ),
    ToolSpec(
        name=TASK_COMPLETE,
        description="Declare the task complete. Must be called twice in a row to finish.",
        parameters={"type": "object", "properties": {}, "required": []},
    ),
)

CONFIRM_COMPLETION = (
    "Are you sure you want to mark the task as complete? Your solution will be graded and you will "
    "not be able to change it. If so, call task_complete again. Otherwise continue working."
)

SUMMARY_REQUEST = (
    "Your context window is almost full. The conversation so far will be replaced by a summary that "
    "you write now, and you will continue the task from that summary alone. Write it for yourself: "
    "(1) the actions you took and their results, (2) what you learned about the environment, files "
    "and tools, (3) the problems you hit and how you dealt with them, (4) the current status and the "
    "next steps. Be specific: exact paths, commands, values and error messages. Reply with the "
    "summary in plain text only, without tool calls."
)


# For models that learn the call format from demonstrations rather than from a schema: every token
# of the system turn is paid on every training row and every sampler call.
COMPACT_SYSTEM_PROMPT = (
    "Solve the task in the bash shell. Each reply: a short note, then one shell tool call. "
    "When done, call task_complete, then call it again to confirm."
)
# The same without the confirmation round. Terminus-2 asks a model that declares completion to
# confirm it, so that a premature declaration can be taken back; a tiny model that learns the
# protocol from demonstrations confirms by reflex (99.0% of 1,039 requests in an RL run), and the
# round cost it ~112 of a demonstration's ~613 tokens (the request alone is 86 tokens of the
# project BPE) and one of its ~4.8 sampler calls.
COMPACT_ONCE_SYSTEM_PROMPT = (
    "Solve the task in the bash shell. Each reply: a short note, then one shell tool call. "
    "When done, call task_complete."
)


@dataclass(frozen=True)
class PromptProfile:
    """The system prompt and the tool schemas the chat template renders into the system turn
    (no schemas: the system turn is the prompt alone), and the completion protocol: with a
    `confirmation` text, a `task_complete` is answered by it and only a second one in the next
    reply ends the trial; with None the first one ends it. The parser accepts the same calls
    whichever profile a trial uses; the system prompt must describe the profile's protocol."""

    system_prompt: str
    tools: tuple[ToolSpec, ...]
    confirmation: str | None = CONFIRM_COMPLETION


PROMPT_PROFILES = {
    "full": PromptProfile(SYSTEM_PROMPT, TOOLS),
    "compact": PromptProfile(COMPACT_SYSTEM_PROMPT, ()),
    "compact-once": PromptProfile(COMPACT_ONCE_SYSTEM_PROMPT, (), confirmation=None),
}


STEP_HEADER = "[step {number} of {total}: {name}]"
STEP_OVER = (
    "The previous step is over and has been checked (its results are not shown). Everything you did "
    "stays in the environment: files, and the processes you left running. Here is the next step."
)


def step_instruction(instruction: str, index: int, total: int, name: str) -> str:
    """Step `index` (0-based) of `total`'s instruction as the model reads it (module docstring)."""
    return STEP_HEADER.format(number=index + 1, total=total, name=name) + "\n\n" + instruction


def next_step_message(step_text: str) -> str:
    """The user turn that opens a later step: `STEP_OVER`, then `step_instruction(...)`'s text."""
    return f"{STEP_OVER}\n\n{step_text}"


def initial_messages(instruction: str, workdir: str, system_prompt: str = SYSTEM_PROMPT) -> list[Message]:
    return [
        Message("system", system_prompt),
        Message("user", f"Task description:\n{instruction}\n\nThe terminal is a bash shell in {workdir}."),
    ]


def compacted_messages(
    instruction: str,
    workdir: str,
    summary: str,
    summary_note: str,
    recent_output: str,
    system_prompt: str = SYSTEM_PROMPT,
) -> list[Message]:
    """The history a new segment starts from after compaction."""
    parts = [
        f"Task description:\n{instruction}\n\nThe terminal is a bash shell in {workdir}.",
        "Your earlier context was compacted to save space.",
    ]
    if summary:
        parts.append(f"Summary of your work so far, written by you{summary_note}:\n{summary}")
    else:
        parts.append(f"No summary of the earlier work is available{summary_note}.")
    if recent_output:
        parts.append(f"Most recent terminal output:\n{recent_output}")
    parts.append("Continue working on the task from here.")
    return [Message("system", system_prompt), Message("user", "\n\n".join(parts))]


def parse_error_message(errors: Sequence[str]) -> str:
    listed = "\n".join(f"- {error}" for error in errors)
    return (
        f"Your previous reply could not be executed and no command was run:\n{listed}\n"
        "Reply with your analysis followed by one or more <tool_call> blocks in the required format."
    )


def warnings_note(warnings: Sequence[str]) -> str:
    return "\n".join(f"[note: {warning}]" for warning in warnings)
