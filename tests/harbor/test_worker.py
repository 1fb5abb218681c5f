"""The t1jax agent's worker (`python -m t1jax.eval.harbor_worker`, in t1jax's venv) over its pipe, with
the other end played the way `T1jaxAgent` plays it, but with a real local sandbox instead of a
Harbor environment. Needs no `harbor`: it runs in the default suite and in `make test-harbor`.

The oracle policy types the reference solution into the terminal (a tmux session the worker
drives through `exec`), and the sandbox's own verifier then finds the task done: the terminal,
the key handling and the completion protocol work over the pipe as they do in `t1jax eval`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARBOR_TASKS = REPO / "tests" / "data" / "tasks" / "harbor"

pytestmark = pytest.mark.sandbox


def _python() -> str:
    if os.environ.get("T1JAX_PYTHON"):
        return os.environ["T1JAX_PYTHON"]
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


class _Pipe:
    def __init__(self, start: dict) -> None:
        self.process = subprocess.Popen(
            [_python(), "-m", "t1jax.eval.harbor_worker"], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.send(start)

    def send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        assert line, f"the worker exited {self.process.wait()}: {self.process.stderr.read()[-2000:]}"
        return json.loads(line)

    def close(self) -> int:
        self.process.stdin.close()
        code = self.process.wait(timeout=60)
        self.process.stdout.close()
        self.process.stderr.close()
        return code


def _serve(pipe: _Pipe, sandbox) -> dict:
    """Answer the worker's commands in `sandbox` until its trial is done; return the done message."""
    while True:
        message = pipe.receive()
        if message["op"] == "done":
            return message
        assert message["op"] == "exec"
        result = sandbox.exec(message["command"], message["timeout_sec"])
        pipe.send({"op": "result", "call": message["call"], "stdout": result.stdout, "stderr": result.stderr,
                   "exit_code": result.exit_code, "timed_out": result.timed_out,
                   "duration_sec": result.duration_sec})  # fmt: skip


def test_the_oracle_resolves_a_task_over_the_workers_pipe():
    from sandbox_service.providers import ProviderSettings, open_provider
    from sandbox_service.tasks import load_task

    task_dir = HARBOR_TASKS / "hello-world"
    task = load_task(task_dir)
    pipe = _Pipe({"op": "start", "settings": {"agent": "oracle", "terminal": "tmux", "max_turns": "20"}})
    sandbox = open_provider(ProviderSettings(backend="local")).create(task, run_id="t1jax-worker-test")
    try:
        ready = pipe.receive()
        assert ready["op"] == "ready" and ready["agent_info"]["mode"] == "oracle"
        assert ready["harness"]["terminal"] == "tmux" and ready["harness"]["max_turns"] == 20
        pipe.send({"op": "trial", "trial": "hello-world__x", "task_dir": str(task_dir), "instruction": task.instruction})
        done = _serve(pipe, sandbox)
        report = sandbox.verify()
    finally:
        sandbox.close()
        code = pipe.close()
    assert "error" not in done, done.get("error")
    assert done["summary"]["status"] == "completed" and done["summary"]["completion_tokens"] > 0
    assert done["atif"]["extra"]["t1jax"]["status"] == "completed"
    assert report.parsed and report.total > 0 and report.passed == report.total
    assert code == 0


def test_a_setting_that_is_not_one_is_a_fatal_line():
    pipe = _Pipe({"op": "start", "settings": {"agent": "oracle", "max_turn": "3"}})
    message = pipe.receive()
    assert message == {"op": "fatal", "error": "ValueError: max_turn is not a t1jax agent setting"}
    assert pipe.close() == 2
    pipe = _Pipe({"op": "start", "settings": {"agent": "oracle", "budget_note": "maybe"}})
    assert pipe.receive()["error"] == "ValueError: budget_note must be true or false, got 'maybe'"
    assert pipe.close() == 2
