"""Host-side process helpers for the local backend and the environment builder.

Bounded output capture, session kill, pid identity, the client side of a `_holder.py` process
(`HolderProcess`) and the check for required host tools.

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

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox_service.contracts import SandboxError

HOLDER_SCRIPT = Path(__file__).resolve().parent / "_holder.py"
# How the holder is run: isolated (-I) and without `site` (-S): it needs the standard library only,
# and `site` (the environment's .pth files) was ~14 ms of CPU of its ~76 ms start (AMD EPYC), paid
# twice per trial (the sandbox's holder and the verifier's).
HOLDER_COMMAND = (sys.executable, "-I", "-S", str(HOLDER_SCRIPT))
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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
    pass_fds: Sequence[int] = (),
    on_start: Callable[[subprocess.Popen], None] | None = None,
) -> CapturedRun:
    """Run `argv` in a new session, capturing bounded stdout/stderr, killing it at the deadline.

    `on_timeout(proc)` must kill the command's process tree; it is called once, at the deadline.
    `on_start(proc)` is called once the process exists (e.g. to record its session for a later kill).
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
        pass_fds=tuple(pass_fds),
    )
    if on_start is not None:
        on_start(proc)
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


def pid_start_time(pid: int | None) -> int | None:
    """Start time of a live (non-zombie) process, None if it is gone or a zombie."""
    fields = _stat_fields(pid) if pid is not None else None
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of stat(5), counted after the name


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
    _kill_until_gone(lambda: session_members(session_id), rounds)


def _kill_until_gone(members, rounds: int) -> None:
    """SIGKILL what `members()` lists, again and again (a member may fork between the listing and
    its kill), until it lists none or `rounds` listings have passed."""
    for _ in range(rounds):
        pids = members()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def kill_namespace_members(namespace: str, *, rounds: int = 20) -> None:
    """SIGKILL every process whose own pid namespace is `namespace` (a `pid:[inode]` link text) but
    its init: the processes of that namespace that are in none of its child namespaces."""

    def members() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                    continue
                with open(f"/proc/{entry}/status") as handle:
                    nspid = next((line.split()[1:] for line in handle if line.startswith("NSpid:")), [])
            except (OSError, StopIteration):
                continue
            if nspid and nspid[-1] != "1":
                found.append(int(entry))
        return found

    _kill_until_gone(members, rounds)


def kill_if_same(pid: int | None, start_time: int | None) -> bool:
    """SIGKILL `pid` only if it is still the process that started at `start_time`."""
    if pid is None or start_time is None or pid_start_time(pid) != start_time:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


class HolderProcess:
    """A running `_holder.py` in its own mount namespace; `stop()` ends it (and its mounts)."""

    def __init__(self, proc: subprocess.Popen, reply: dict):
        self.proc = proc
        self.pid: int = reply["pid"]
        self.child: dict = reply.get("child") or {}
        self.userns: dict[str, int] = reply.get("userns") or {}  # name -> pid of its keeper

    @classmethod
    def start(cls, unshare: str, ops: Sequence[dict], spawn: dict | None = None) -> HolderProcess:
        config = json.dumps({"ops": list(ops), "spawn": spawn})
        proc = subprocess.Popen(
            [
                unshare,
                "--mount",
                "--propagation",
                "private",
                "--",
                *HOLDER_COMMAND,
                config,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": DEFAULT_PATH},
        )
        line = proc.stdout.readline()
        try:
            reply = json.loads(line.decode() or "{}")
        except json.JSONDecodeError:
            reply = {}
        if not reply.get("ok"):
            proc.stdin.close()
            proc.wait()
            stderr = proc.stderr.read().decode(errors="replace")[-2000:]
            raise SandboxError(
                f"sandbox holder failed: {reply.get('error') or line.decode(errors='replace')} {stderr}"
            )
        return cls(proc, reply)

    def stop(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


def require_tool(name: str) -> str:
    path = shutil.which(name, path=DEFAULT_PATH)
    if path is None:
        raise SandboxError(
            f"the local sandbox backend needs `{name}` on the host (apt-get install bubblewrap util-linux; "
            "`make setup` does it)"
        )
    return path
