"""Liveness of the run's components (paper §7.3): probes with an initial grace, a period and a
deadline, so a hung component is reported *by name*, not as the barrier that timed out.

A `Probe` is a component name and a check that returns when the component answers; `Liveness`
runs every probe after `grace_sec`, then every `period_sec`, each under `deadline_sec` (in its own
thread, so a hung check cannot stall the others). The first failure is kept (`failure`) and
handed to `on_failure` once; the controller turns it into a `ComponentUnresponsive` at its next
wait point. If the controller itself is stuck inside the hung component (a device call that never
returns), `on_stuck` runs after a further deadline: the controller's cleanup (cancel trials,
close sandboxes, write the status), then the process exits with status 3.

Control-plane calls carry their own deadlines elsewhere (sampler calls, sandbox calls, the
publication barrier); bulk work does not (a training step, a weight transfer, a checkpoint).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)
EXIT_STUCK = 3


class ComponentUnresponsive(RuntimeError):
    def __init__(self, component: str, message: str):
        super().__init__(f"{component} is unresponsive: {message}")
        self.component = component


@dataclass(frozen=True)
class Probe:
    """`check(deadline_sec)` returns when `component` answers and raises (or overruns the
    deadline) when it does not. `enabled()` may skip a check (e.g. the trainer mid-step)."""

    component: str
    check: Callable[[float], object]
    enabled: Callable[[], bool] = lambda: True


class Liveness:
    def __init__(
        self,
        probes: Sequence[Probe],
        *,
        grace_sec: float,
        period_sec: float,
        deadline_sec: float,
        on_failure: Callable[[ComponentUnresponsive], None] | None = None,
        on_stuck: Callable[[ComponentUnresponsive], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.probes = tuple(probes)
        self.grace_sec, self.period_sec, self.deadline_sec = grace_sec, period_sec, deadline_sec
        self._on_failure, self._on_stuck = on_failure, on_stuck
        self._clock = clock
        self._stop = threading.Event()
        self._acknowledged = threading.Event()
        self.failure: ComponentUnresponsive | None = None
        self.checks = 0
        self._thread = threading.Thread(target=self._run, name="t1jax-liveness", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._acknowledged.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.deadline_sec + 5)

    def raise_if_failed(self) -> None:
        """The controller's wait points call this: it turns a probe failure into an exception."""
        if self.failure is not None:
            self._acknowledged.set()
            raise self.failure

    def check_once(self) -> ComponentUnresponsive | None:
        """Run every enabled probe once, each under the deadline; the first failure or None."""
        self.checks += 1
        for probe in self.probes:
            if not probe.enabled():
                continue
            outcome: dict[str, BaseException] = {}

            def run(probe=probe, outcome=outcome):
                try:
                    probe.check(self.deadline_sec)
                except BaseException as failed:  # reported below, by component
                    outcome["error"] = failed

            worker = threading.Thread(target=run, name=f"t1jax-probe-{probe.component}", daemon=True)
            worker.start()
            worker.join(self.deadline_sec + 1.0)  # a check that honours the deadline reports its own error
            if worker.is_alive():
                return ComponentUnresponsive(probe.component, f"no answer within {self.deadline_sec:g} s")
            if "error" in outcome:
                error = outcome["error"]
                return ComponentUnresponsive(probe.component, f"{type(error).__name__}: {error}")
        return None

    def _run(self) -> None:
        if self._stop.wait(self.grace_sec):
            return
        while not self._stop.is_set():
            failure = self.check_once()
            if failure is not None:
                log.error("liveness: %s", failure)
                if self._on_failure is not None:
                    self._on_failure(failure)
                # Published after the report: the controller's wait points raise on it, and its
                # own final status must land after the one `on_failure` wrote.
                self.failure = failure
                # The controller has one more deadline to notice at a wait point.
                if not self._acknowledged.wait(self.deadline_sec) and not self._stop.is_set():
                    log.error("liveness: the controller is stuck behind the %s; exiting", failure.component)
                    if self._on_stuck is not None:
                        try:
                            self._on_stuck(failure)
                        finally:
                            os._exit(EXIT_STUCK)
                return
            self._stop.wait(self.period_sec)
