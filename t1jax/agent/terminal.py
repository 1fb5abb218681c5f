"""The agent's terminal: run one command in the sandbox and turn what it printed into safe text.

Two drivers behind one `TerminalDriver` protocol:

- `TmuxTerminal` (default, Terminus-2 semantics): types the command plus Enter into the
  sandbox's persistent tmux session with `Sandbox.send_keys`, waits `duration` seconds, returns
  the new output. A command that is exactly one tmux key name (`C-c`, `C-d`, `Escape`, `Up`...)
  is sent as that key, without Enter (the local backend's `send_keys` convention). Shell state
  (cwd, variables, background jobs, an open REPL) persists between commands, and a long command
  keeps running: the model may wait more with an empty command.
- `ExecTerminal`: runs each command with `Sandbox.exec` under a deadline of `duration` seconds
  and reports stdout, stderr and the exit status. No state persists between commands; useful for
  backends without an interactive session.

Every output passes through `sanitize_terminal_text` (invalid bytes -> U+FFFD, ANSI escape
sequences removed, other control characters shown in caret notation as `cat -v` does) and then
`cap_text` (keep the first and last half of `max_bytes`, state how many bytes were omitted).
Nothing here raises because of what a command printed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from sandbox_service.contracts import Sandbox

_ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_KEY_NAME = re.compile(
    r"^(?:[CM]-[a-z]|Escape|Tab|Enter|Up|Down|Left|Right|Home|End|PageUp|PageDown|BSpace)$"
)


@dataclass(frozen=True)
class CommandOutput:
    text: str  # sanitised and capped
    omitted_bytes: int  # bytes cut here or upstream by the sandbox
    timed_out: bool = False
    exit_code: int | None = None
    elapsed_sec: float = 0.0


class TerminalDriver(Protocol):
    def run(self, command: str, duration_sec: float) -> CommandOutput: ...


def sanitize_terminal_text(text: str) -> str:
    """Valid, printable UTF-8 text from whatever a terminal produced."""
    if any("\ud800" <= ch <= "\udfff" for ch in text):
        try:  # output decoded with surrogateescape: recover the bytes, mark the invalid ones
            text = text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
        except UnicodeEncodeError:
            text = "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    text = text.replace("\r\n", "\n")
    text = _ANSI_ESCAPE.sub("", text)
    text = text.replace("\r", "\n")
    return _CONTROL.sub(lambda m: "^" + chr((ord(m.group()) + 64) % 128), text)


def head_and_tail(text: str, max_bytes: int) -> tuple[str, str, int]:
    """Split `text` into the longest head and tail of at most `max_bytes // 2` UTF-8 bytes each
    (whole characters); returns (head, tail, bytes omitted between them). A text that fits is
    returned whole as the head."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text, "", 0
    half = max(max_bytes // 2, 0)
    head = raw[:half].decode("utf-8", errors="ignore")
    tail = raw[len(raw) - half :].decode("utf-8", errors="ignore") if half else ""
    return head, tail, len(raw) - len(head.encode("utf-8")) - len(tail.encode("utf-8"))


def cap_text(text: str, max_bytes: int, upstream_omitted: int = 0) -> tuple[str, int]:
    """Keep the head and tail of `text` within `max_bytes` UTF-8 bytes (plus a note saying how much
    was omitted, counting `upstream_omitted`); returns (text, total omitted bytes)."""
    head, tail, omitted = head_and_tail(text, max_bytes)
    omitted += upstream_omitted
    if not omitted:
        return text, 0
    if len(head) == len(text):
        return f"{text}\n[... {omitted} bytes of output omitted ...]", omitted
    return f"{head}\n[... {omitted} bytes of output omitted ...]\n{tail}", omitted


class TmuxTerminal:
    def __init__(self, sandbox: Sandbox, max_bytes: int) -> None:
        self.sandbox = sandbox
        self.max_bytes = max_bytes

    def run(self, command: str, duration_sec: float) -> CommandOutput:
        # A lone key name (C-c to interrupt, C-d, Escape, ...) is sent as that key, without Enter.
        keys = command if _KEY_NAME.match(command) else (command + "\n" if command else "")
        read = self.sandbox.send_keys(keys, duration_sec)
        text, omitted = cap_text(sanitize_terminal_text(read.text), self.max_bytes, read.omitted_bytes)
        return CommandOutput(text=text, omitted_bytes=omitted, elapsed_sec=duration_sec)


class ExecTerminal:
    def __init__(self, sandbox: Sandbox, max_bytes: int) -> None:
        self.sandbox = sandbox
        self.max_bytes = max_bytes

    def run(self, command: str, duration_sec: float) -> CommandOutput:
        if not command.strip():
            return CommandOutput(text="(no command given; nothing ran)", omitted_bytes=0)
        result = self.sandbox.exec(command, duration_sec)
        stdout = sanitize_terminal_text(result.stdout)
        stderr = sanitize_terminal_text(result.stderr)
        body = stdout
        if stderr:
            body += ("\n" if body and not body.endswith("\n") else "") + "[stderr]\n" + stderr
        text, omitted = cap_text(
            body, self.max_bytes, result.stdout_omitted_bytes + result.stderr_omitted_bytes
        )
        if result.timed_out:
            status = f"[command killed after {duration_sec:g} s: it did not finish in time]"
        else:
            status = f"[exit code {result.exit_code}]"
        text = text + ("\n" if text and not text.endswith("\n") else "") + status
        return CommandOutput(
            text=text,
            omitted_bytes=omitted,
            timed_out=result.timed_out,
            exit_code=result.exit_code,
            elapsed_sec=result.duration_sec,
        )
