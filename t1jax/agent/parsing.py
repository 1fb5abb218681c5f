"""Parse an assistant reply into tool calls: `shell(command, duration)` and `task_complete()`.

The reply format is Qwen3.5's: free text (analysis and plan), then one or more blocks

    <tool_call>
    <function=shell>
    <parameter=command>
    grep -rn "TODO" /app | head
    </parameter>
    <parameter=duration>
    1.0
    </parameter>
    </function>
    </tool_call>

A Qwen3-style JSON body (`<tool_call>{"name": "shell", "arguments": {...}}</tool_call>`) is accepted
too. Parameter values are the text between the tags minus one leading and one trailing newline;
shell commands need no escaping.

Invariant: `parse_reply` never raises. Any problem is an entry in `ParsedReply.errors`, and a
reply with errors runs no command at all (the harness answers with the errors instead);
`warnings` are reported but do not block execution.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from t1jax.agent.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

SHELL = "shell"
TASK_COMPLETE = "task_complete"
_FUNCTION = re.compile(r"^<function=([^>\n]*)>\n?(.*?)\n?</function>$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ShellCommand:
    command: str  # typed into the terminal, followed by Enter; "" only waits
    duration_sec: float  # how long to wait for output (tmux) / the deadline (exec)


@dataclass(frozen=True)
class ParsedReply:
    commands: tuple[ShellCommand, ...] = ()
    task_complete: bool = False
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors


def parse_reply(
    text: str, *, default_duration_sec: float, max_duration_sec: float, truncated: bool = False
) -> ParsedReply:
    """Parse `text` (the completion, without its stop token). `truncated` says the reply hit the
    per-turn token limit, which makes an unclosed block's error message say so."""
    errors: list[str] = []
    warnings: list[str] = []
    commands: list[ShellCommand] = []
    task_complete = False
    bodies, tail_text = _split_blocks(text, errors, truncated)
    for index, body in enumerate(bodies, start=1):
        call = _parse_block(body.strip("\n"), index, errors)
        if call is None:
            continue
        name, arguments = call
        if name == SHELL:
            command = _shell_command(
                arguments, index, default_duration_sec, max_duration_sec, errors, warnings
            )
            if command is not None:
                commands.append(command)
        elif name == TASK_COMPLETE:
            if arguments:
                warnings.append(
                    f"tool call {index}: task_complete takes no parameters; ignored {sorted(arguments)}"
                )
            task_complete = True
        else:
            errors.append(
                f"tool call {index}: unknown function {name!r}; the tools are {SHELL} and {TASK_COMPLETE}"
            )
    if not bodies and not errors:
        errors.append(
            "no tool call found: call shell to run a command, or task_complete when the task is done"
        )
    if bodies and tail_text.strip():
        warnings.append("text after the last tool call was ignored")
    return ParsedReply(tuple(commands), task_complete, tuple(errors), tuple(warnings))


def _split_blocks(text: str, errors: list[str], truncated: bool) -> tuple[list[str], str]:
    bodies: list[str] = []
    position = 0
    while True:
        open_at = text.find(TOOL_CALL_OPEN, position)
        stray_close = text.find(TOOL_CALL_CLOSE, position)
        if stray_close != -1 and (open_at == -1 or stray_close < open_at):
            errors.append(f"{TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}")
            position = stray_close + len(TOOL_CALL_CLOSE)
            continue
        if open_at == -1:
            return bodies, text[position:]
        close_at = text.find(TOOL_CALL_CLOSE, open_at + len(TOOL_CALL_OPEN))
        nested = text.find(TOOL_CALL_OPEN, open_at + len(TOOL_CALL_OPEN))
        if close_at == -1 or (nested != -1 and nested < close_at):
            reason = (
                " (the reply was cut off at the per-turn token limit)" if truncated and close_at == -1 else ""
            )
            errors.append(
                f"tool call {len(bodies) + 1}: {TOOL_CALL_OPEN} is never closed by {TOOL_CALL_CLOSE}{reason}"
            )
            if close_at == -1:
                return bodies, ""
            position = nested
            continue
        bodies.append(text[open_at + len(TOOL_CALL_OPEN) : close_at])
        position = close_at + len(TOOL_CALL_CLOSE)


def _parse_block(body: str, index: int, errors: list[str]) -> tuple[str, dict[str, str]] | None:
    if body.lstrip().startswith("{"):
        return _parse_json_block(body, index, errors)
    match = _FUNCTION.match(body.strip())
    if match is None:
        errors.append(f"tool call {index}: expected <function=NAME> ... </function> inside {TOOL_CALL_OPEN}")
        return None
    name, inner = match.group(1).strip(), match.group(2)
    arguments: dict[str, str] = {}
    for parameter in _PARAMETER.finditer(inner):
        key, value = parameter.group(1).strip(), parameter.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if key in arguments:
            errors.append(f"tool call {index}: parameter {key!r} given twice")
        arguments[key] = value
    leftover = _PARAMETER.sub("", inner).strip()
    if leftover:
        errors.append(f"tool call {index}: unexpected text inside <function={name}>: {leftover[:80]!r}")
    return name, arguments


def _parse_json_block(body: str, index: int, errors: list[str]) -> tuple[str, dict[str, str]] | None:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        errors.append(f"tool call {index}: invalid JSON ({error.msg} at position {error.pos})")
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        errors.append(f'tool call {index}: JSON tool call needs a string "name"')
        return None
    raw_arguments = payload.get("arguments", {})
    if isinstance(raw_arguments, str):
        try:
            raw_arguments = json.loads(raw_arguments)
        except json.JSONDecodeError:
            raw_arguments = None
    if not isinstance(raw_arguments, dict):
        errors.append(f'tool call {index}: "arguments" must be a JSON object')
        return None
    return payload["name"], {
        str(k): v if isinstance(v, str) else json.dumps(v) for k, v in raw_arguments.items()
    }


def _shell_command(
    arguments: dict[str, str],
    index: int,
    default_duration_sec: float,
    max_duration_sec: float,
    errors: list[str],
    warnings: list[str],
) -> ShellCommand | None:
    unknown = sorted(set(arguments) - {"command", "duration"})
    if unknown:
        errors.append(f"tool call {index}: shell has no parameter(s) {unknown}; use command and duration")
        return None
    if "command" not in arguments:
        errors.append(f"tool call {index}: shell needs a command parameter")
        return None
    duration = default_duration_sec
    if "duration" in arguments:
        try:
            duration = float(arguments["duration"].strip())
        except ValueError:
            errors.append(
                f"tool call {index}: duration must be a number of seconds, got {arguments['duration'][:40]!r}"
            )
            return None
        if not math.isfinite(duration) or duration < 0:
            errors.append(f"tool call {index}: duration must be a finite number >= 0, got {duration}")
            return None
        if duration > max_duration_sec:
            warnings.append(f"tool call {index}: duration {duration:g} s capped at {max_duration_sec:g} s")
            duration = max_duration_sec
    return ShellCommand(arguments["command"], duration)
