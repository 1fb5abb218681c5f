"""Fault injection around real parts, shared by the rollout-layer and controller tests.

`FlakyBackend` wraps a real sandbox backend: `create`, and each `exec` / `send_keys` of the
sandboxes it returns, raise with probability `rate` (seeded). Everything else is the real
backend's, so what the scheduler and the controller must clean up is real. `FlakyLocalBackend`
is the same around a `LocalBackend`, constructible by name (`register_backend`), as the
controller builds backends from a run config.
"""

from __future__ import annotations

import random
import threading


class FlakyBackend:
    """Fault injection around a real backend: `create`, and each `exec` / `send_keys` of the
    sandboxes it returns, raise with probability `rate` (seeded). Everything else is the real
    backend's, so what the scheduler must clean up is real."""

    def __init__(self, backend, rate: float, seed: int = 0):
        self.backend, self.rate = backend, rate
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.create_failures = 0
        self.call_failures = 0

    def _fails(self) -> bool:
        with self._lock:
            return self._random.random() < self.rate

    def create(self, task, *, run_id="default"):
        if self._fails():
            with self._lock:
                self.create_failures += 1
            raise ConnectionError("injected: the sandbox provider refused the create")
        return _FlakySandbox(self, self.backend.create(task, run_id=run_id))

    def live_sandboxes(self, run_id=None):
        return self.backend.live_sandboxes(run_id)

    def reap(self, run_id=None):
        return self.backend.reap(run_id)


class _FlakySandbox:
    def __init__(self, owner: FlakyBackend, inner):
        self._owner, self._inner = owner, inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _maybe_fail(self):
        if self._owner._fails():
            with self._owner._lock:
                self._owner.call_failures += 1
            raise ConnectionError("injected: the sandbox stopped answering")

    def exec(self, command, timeout_sec):
        self._maybe_fail()
        return self._inner.exec(command, timeout_sec)

    def send_keys(self, keys, wait_sec):
        self._maybe_fail()
        return self._inner.send_keys(keys, wait_sec)


class FlakyLocalBackend(FlakyBackend):
    RATE = 0.2

    def __init__(self, cache_dir=None, toolchain_dir=None, **options):
        from sandbox_service.backends.local import LocalBackend

        super().__init__(LocalBackend(cache_dir=cache_dir, toolchain_dir=toolchain_dir), self.RATE, seed=3)

    def close(self):
        self.backend.close()
