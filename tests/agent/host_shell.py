"""An in-process `Sandbox` for harness unit tests: a real bash process in a temporary directory.

No isolation at all (commands run on the host as the test user), so only tests' own scripted
commands may run in it. `send_keys` feeds a persistent bash through a pipe (no tty) and returns
what it printed during the wait; `exec` runs a fresh bash with a deadline. `verify` calls the
check the test supplies. Output is decoded with `surrogateescape`, as a backend would pass
binary bytes through.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sandbox_service.contracts import (
    AssertionResult,
    EnvironmentSpec,
    ExecResult,
    FailureCause,
    Task,
    TaskLayout,
    TaskLimits,
    TerminalRead,
    VerifierReport,
)


def make_task(task_id: str, instruction: str, root: Path, agent_timeout_sec: float = 60.0) -> Task:
    tests_dir = root / "tests"
    tests_dir.mkdir(parents=True, exist_ok=True)
    (tests_dir / "test.sh").write_text("#!/bin/sh\nexit 0\n")
    return Task(
        task_id=task_id,
        instruction=instruction,
        source_dir=root,
        layout=TaskLayout.HARBOR,
        environment=EnvironmentSpec(docker_image="none", workdir=str(root / "work")),
        tests_dir=tests_dir,
        test_script=Path("test.sh"),
        limits=TaskLimits(agent_timeout_sec=agent_timeout_sec),
    )


class HostShellSandbox:
    def __init__(self, task: Task, check: Callable[[Path], dict[str, bool]] | None = None) -> None:
        self._task = task
        self.workdir = Path(task.environment.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.check = check
        self.commands: list[str] = []
        self.closed = False
        self._buffer = bytearray()
        self._read_upto = 0
        self._lock = threading.Lock()
        self._shell = subprocess.Popen(
            ["bash", "--norc", "--noprofile"],
            cwd=self.workdir,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    @property
    def sandbox_id(self) -> str:
        return f"host-{os.getpid()}-{id(self)}"

    @property
    def task(self) -> Task:
        return self._task

    def _pump(self) -> None:
        stream = self._shell.stdout
        while True:
            chunk = stream.read1(4096)
            if not chunk:
                return
            with self._lock:
                self._buffer += chunk

    def send_keys(self, keys: str, wait_sec: float) -> TerminalRead:
        """Type `keys`, wait `wait_sec`, and (unlike a real terminal, so that tests do not depend on
        machine load) also wait up to 10 s until the shell has run them: a marker printed after
        the keys must appear; it is removed from the output."""
        self.commands.append(keys)
        marker = f"\x1e{len(self.commands)}\x1e".encode()
        if keys:
            self._shell.stdin.write(keys.encode("utf-8", errors="surrogateescape"))
            self._shell.stdin.write(f"printf '\\036{len(self.commands)}\\036'\n".encode())
            self._shell.stdin.flush()
        time.sleep(wait_sec)
        deadline = time.monotonic() + 10.0
        while keys and time.monotonic() < deadline:
            with self._lock:
                if marker in self._buffer[self._read_upto :]:
                    break
            time.sleep(0.01)
        with self._lock:
            new = bytes(self._buffer[self._read_upto :]).replace(marker, b"")
            self._read_upto = len(self._buffer)
        return TerminalRead(text=new.decode("utf-8", errors="surrogateescape"))

    def exec(self, command: str, timeout_sec: float) -> ExecResult:
        self.commands.append(command)
        started = time.monotonic()
        process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = process.communicate(timeout=timeout_sec)
            timed_out, code = False, process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            timed_out, code = True, None
        return ExecResult(
            stdout=out.decode("utf-8", errors="surrogateescape"),
            stderr=err.decode("utf-8", errors="surrogateescape"),
            exit_code=code,
            timed_out=timed_out,
            duration_sec=time.monotonic() - started,
        )

    def verify(self) -> VerifierReport:
        results = self.check(self.workdir) if self.check else {}
        return VerifierReport(
            assertions=tuple(AssertionResult(name, ok) for name, ok in results.items()),
            parsed=bool(results),
            failure_cause=FailureCause.NONE if results else FailureCause.EMPTY_REPORT,
            binary_outcome=all(results.values()) if results else None,
        )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            os.killpg(self._shell.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._shell.wait()


def temporary_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="t1jax-harness-"))
