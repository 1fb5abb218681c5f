"""Helpers of the admission and service tests (fixtures live in conftest.py)."""

from __future__ import annotations

import threading
import time
import uuid

from sandbox_service.contracts import Sandbox, SandboxProvider, Task


def new_run_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


class SlowCreate:
    """Delegates to a real backend after a delay, so a test can act while `create` is in flight.
    Only the timing is staged; the sandboxes are the real backend's."""

    def __init__(self, inner: SandboxProvider, delay_sec: float):
        self.inner = inner
        self.delay_sec = delay_sec
        self.entered = threading.Event()

    def create(self, task: Task, *, run_id: str = "default") -> Sandbox:
        self.entered.set()
        time.sleep(self.delay_sec)
        return self.inner.create(task, run_id=run_id)

    def live_sandboxes(self, run_id: str | None = None) -> list[str]:
        return self.inner.live_sandboxes(run_id)  # type: ignore[attr-defined]

    def reap(self, run_id: str | None = None) -> list[str]:
        return self.inner.reap(run_id)  # type: ignore[attr-defined]
