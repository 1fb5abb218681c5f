"""Host-side process helpers for the local backend: bounded output capture, session kill, pid identity.

Invariants:
- `run_captured` never holds more than `head_bytes + tail_bytes` of each stream in memory; what it
  drops is counted, and it returns once the command's main process has exited (output that
  background children write afterwards is not waited for) or its deadline has passed.
- `kill_session` kills every process whose session id is the given leader, wherever it runs (the
  host's /proc shows processes of child pid namespaces with host pids and host session ids).
- `pid_start_time` identifies a process across pid reuse: a recorded (pid, start time) pair that no
  longer matches is a different process and must not be signalled.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CapturedRun:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_sec: float
    stdout_omitted_bytes: int
    stderr_omitted_bytes: int


class BoundedBuffer:
    """Keeps the first `head_bytes` and the last `tail_bytes` of a byte stream; counts the rest."""

    def __init__(self, head_bytes: int, tail_bytes: int):
        self.head_bytes = head_bytes
        self.tail_bytes = tail_bytes
        self.head = bytearray()
        self.tail = bytearray()
        self.omitted = 0

    def feed(self, data: bytes) -> None:
        room = self.head_bytes - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        overflow = len(self.tail) - self.tail_bytes
        if overflow > 0:
            del self.tail[:overflow]
            self.omitted += overflow

    def text(self) -> str:
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        if self.omitted:
            return f"{head}\n[... {self.omitted} bytes omitted ...]\n{tail}"
        return head + tail


def run_captured(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout_sec: float,
    head_bytes: int,
    tail_bytes: int,
    on_timeout: Callable[[subprocess.Popen], None],
    cwd: str | None = None,
    drain_after_exit_sec: float = 0.05,
) -> CapturedRun:
    """Run `argv` in a new session, capturing bounded stdout/stderr, killing it at the deadline.

    `on_timeout(proc)` must kill the command's process tree; it is called once, at the deadline.
    """
    started = time.monotonic()
    deadline = started + max(0.0, timeout_sec)
    proc = subprocess.Popen(
        list(argv),
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    buffers = {
        proc.stdout: BoundedBuffer(head_bytes, tail_bytes),
        proc.stderr: BoundedBuffer(head_bytes, tail_bytes),
    }
    selector = selectors.DefaultSelector()
    for stream in buffers:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    timed_out = False
    exited_at: float | None = None
    try:
        while selector.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at >= drain_after_exit_sec:
                break  # background children may hold the pipes open; the command itself is done
            if exited_at is None and now >= deadline:
                timed_out = True
                on_timeout(proc)
                proc.wait()
                exited_at = time.monotonic()
                continue
            wait = min(0.05, max(0.0, deadline - now)) if exited_at is None else drain_after_exit_sec
            for key, _ in selector.select(timeout=wait):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if chunk:
                    buffers[key.fileobj].feed(chunk)
                else:
                    selector.unregister(key.fileobj)
        if proc.poll() is None:
            remaining = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.0, remaining))
            except subprocess.TimeoutExpired:
                timed_out = True
                on_timeout(proc)
                proc.wait()
    finally:
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    out, err = buffers[proc.stdout], buffers[proc.stderr]
    return CapturedRun(
        stdout=out.text(),
        stderr=err.text(),
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        duration_sec=time.monotonic() - started,
        stdout_omitted_bytes=out.omitted,
        stderr_omitted_bytes=err.omitted,
    )


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode(errors="replace")
    except OSError:
        return None
    # The command name may contain spaces and parentheses; fields resume after the last ')'.
    return raw[raw.rfind(")") + 2 :].split()


def pid_start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of stat(5), counted after the name


def session_members(session_id: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields and int(fields[3]) == session_id:
                members.append(int(entry))
    return members


def kill_session(session_id: int, *, rounds: int = 20) -> None:
    """SIGKILL every process in the session led by `session_id` (repeats to catch late forks)."""
    for _ in range(rounds):
        members = session_members(session_id)
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def kill_if_same(pid: int | None, start_time: int | None) -> bool:
    """SIGKILL `pid` only if it is still the process that started at `start_time`."""
    if pid is None or start_time is None or pid_start_time(pid) != start_time:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True
