"""Admission control around any sandbox backend: pacing, a concurrency cap, layered deadlines,
cancellation and leak checks (paper §7.3-7.4).

This module owns the lifecycle of a *trial* (one sandbox for one attempt at one task) as seen by the
node that hosts it. `AdmissionController` wraps a `SandboxProvider` and is itself one, so the
controller can use it in-process or behind the HTTP server without noticing a difference.

- Creation is paced by a `TokenBucket` (default 6/s, `rate=None` turns pacing off) and capped by a
  per-node limit on live sandboxes (`max_live_sandboxes`). A trial first takes a slot, then a token,
  so freed slots never turn into a burst above the rate.
- Layered deadlines, each the smaller of the task's limit and the node's cap
  (defaults: total 5400 s, agent 3600 s, verifier 900 s). The total deadline runs from the moment
  creation is admitted; the agent deadline from the moment the sandbox is ready. Every `exec` and
  `send_keys` is clamped to the agent deadline; after it they raise `DeadlineExceeded("agent")`, but
  `verify()` still runs (as Harbor does). At the total deadline the reaper thread closes the sandbox.
- Every backend call in flight has a watchdog (its own timeout plus `call_grace_sec`): a backend that
  never answers gets its sandbox closed instead of wedging the trial (a bounded deadline on every
  control-plane operation, paper §7.3).
- `cancel(id)` works at any point: while the trial waits for admission, while the backend creates
  the sandbox (it is closed the moment it exists), during `exec`/`verify` (the sandbox is closed
  under the call, which then raises `TrialCancelled`), and after close (a no-op).
- `leak_check(run_id)` closes every trial of the run the caller forgot, asks the backend for
  anything still alive under that run (e.g. left by a crashed process), kills it, and reports both.

Invariants:
- Each admitted trial releases its concurrency slot exactly once, whatever path ends it.
- Each backend sandbox that `create` returned is closed exactly once by this controller, unless the
  controller itself is killed; then the backend's run labels let `leak_check`/`reap` find it.
- `live_count() <= config.max_live_sandboxes` at all times.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from sandbox_service.contracts import (
    EnvironmentAudit,
    ExecResult,
    FailureCause,
    Sandbox,
    SandboxProvider,
    Task,
    TaskLimits,
    TerminalRead,
    VerifierReport,
)
from sandbox_service.errors import (
    AdmissionTimeout,
    BadRequest,
    DeadlineExceeded,
    SandboxClosed,
    SandboxServiceError,
    SandboxStateError,
    TrialCancelled,
    UnknownSandbox,
    translate,
)
from sandbox_service.fidelity import environment_audit
from sandbox_service.steps import step_count, step_view

log = logging.getLogger(__name__)

Clock = Callable[[], float]
# wait(event, seconds) -> True if event was set; the default is Event.wait. Tests inject a fake.
Waiter = Callable[[threading.Event, float], bool]


def _event_wait(event: threading.Event, seconds: float) -> bool:
    return event.wait(max(0.0, seconds))


@runtime_checkable
class ReclaimingProvider(SandboxProvider, Protocol):
    """A backend that can list and kill its sandboxes by run, independent of any handle (all three
    backends are). `leak_check` uses these to find sandboxes nobody holds a handle to."""

    def live_sandboxes(self, run_id: str | None = None) -> list[str]: ...

    def reap(self, run_id: str | None = None) -> list[str]: ...


# --------------------------------------------------------------------------------------------------
# Pacing and capacity


class TokenBucket:
    """Grants at most `burst` events at once and `rate` per second on average; thread-safe.

    Reservation model: a caller takes a token immediately (the count may go negative) and sleeps
    until its reservation matures, so waiters are served in arrival order and the pacing is exact.
    An aborted wait (timeout, cancellation) gives its token back. `rate=None` disables pacing.
    """

    def __init__(
        self,
        rate: float | None,
        burst: int = 1,
        *,
        clock: Clock = time.monotonic,
        wait: Waiter = _event_wait,
    ):
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"token bucket rate must be a positive number or None, got {rate}")
        if burst < 1:
            raise ValueError(f"token bucket burst must be >= 1, got {burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._wait = wait
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._updated = clock()

    def _refill(self, now: float) -> None:
        assert self.rate is not None
        self._tokens = min(float(self.burst), self._tokens + (now - self._updated) * self.rate)
        self._updated = now

    def acquire(self, *, timeout: float | None = None, cancelled: threading.Event | None = None) -> bool:
        """Take one token, waiting at most `timeout` seconds (None: no limit). False if the wait
        would exceed the timeout or `cancelled` was set; then no token was consumed."""
        if self.rate is None:
            return not (cancelled is not None and cancelled.is_set())
        with self._lock:
            now = self._clock()
            self._refill(now)
            delay = 0.0 if self._tokens >= 1.0 else (1.0 - self._tokens) / self.rate
            if timeout is not None and delay > timeout:
                return False
            self._tokens -= 1.0
        if delay <= 0.0:
            return True
        stop = cancelled if cancelled is not None else threading.Event()
        if self._wait(stop, delay):  # cancelled while waiting: return the reserved token
            with self._lock:
                self._tokens += 1.0
            return False
        return True


class ConcurrencyLimiter:
    """A counting semaphore whose waits can time out or be cancelled; `in_use <= capacity`."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"concurrency capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._in_use = 0
        self._condition = threading.Condition()

    @property
    def in_use(self) -> int:
        return self._in_use

    def acquire(self, *, timeout: float | None = None, cancelled: threading.Event | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while self._in_use >= self.capacity:
                if cancelled is not None and cancelled.is_set():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                # Wake periodically to notice cancellation; `wake_all` makes that prompt.
                self._condition.wait(0.25 if remaining is None else min(remaining, 0.25))
            if cancelled is not None and cancelled.is_set():
                return False
            self._in_use += 1
            return True

    def release(self) -> None:
        with self._condition:
            if self._in_use <= 0:
                raise RuntimeError("ConcurrencyLimiter released more often than acquired")
            self._in_use -= 1
            self._condition.notify()

    def wake_all(self) -> None:
        with self._condition:
            self._condition.notify_all()


# --------------------------------------------------------------------------------------------------
# Configuration and reports


@dataclass(frozen=True)
class AdmissionConfig:
    """Per-node admission policy. Deadline caps are upper bounds: a trial gets, for each layer, the
    smaller of its task's limit and the cap here."""

    create_rate_per_sec: float | None = 6.0  # None: creation is not paced
    create_burst: int = 6
    max_live_sandboxes: int = 35
    deadline_caps: TaskLimits = field(
        default_factory=lambda: TaskLimits(
            agent_timeout_sec=3600.0, verifier_timeout_sec=900.0, total_timeout_sec=5400.0
        )
    )
    admission_timeout_sec: float | None = None  # how long create may wait for a slot + token
    call_grace_sec: float = 60.0  # a backend call this far past its own timeout is abandoned
    reaper_interval_sec: float = 1.0

    def __post_init__(self) -> None:
        if self.max_live_sandboxes < 1:
            raise ValueError(f"max_live_sandboxes must be >= 1, got {self.max_live_sandboxes}")
        if self.call_grace_sec <= 0 or self.reaper_interval_sec <= 0:
            raise ValueError("call_grace_sec and reaper_interval_sec must be positive")

    def effective_limits(self, task_limits: TaskLimits) -> TaskLimits:
        caps = self.deadline_caps
        total = min(task_limits.total_timeout_sec, caps.total_timeout_sec)
        return TaskLimits(
            agent_timeout_sec=min(task_limits.agent_timeout_sec, caps.agent_timeout_sec, total),
            verifier_timeout_sec=min(task_limits.verifier_timeout_sec, caps.verifier_timeout_sec, total),
            total_timeout_sec=total,
        )


@dataclass(frozen=True)
class LeakReport:
    """What `leak_check` found and killed. `unclosed_trials`: trials still open that the caller
    never closed (now closed). `orphaned_sandboxes`: backend sandboxes alive under the run that no
    open trial owned (left by a crash or a failed close; now reaped). `remaining`: still alive
    after all that (should be empty; non-empty means the backend could not kill them)."""

    run_id: str | None
    unclosed_trials: tuple[str, ...]
    orphaned_sandboxes: tuple[str, ...]
    remaining: tuple[str, ...]

    @property
    def leaked(self) -> bool:
        return bool(self.unclosed_trials or self.orphaned_sandboxes or self.remaining)


class TrialState(enum.StrEnum):
    WAITING = "waiting"  # queued for a slot and a creation token
    CREATING = "creating"  # the backend is creating the sandbox
    READY = "ready"  # agent phase: exec / send_keys allowed
    VERIFYING = "verifying"
    VERIFIED = "verified"
    CLOSED = "closed"


class CloseReason(enum.StrEnum):
    CLOSED = "closed by its owner"
    CANCELLED = "cancelled"
    TOTAL_DEADLINE = "its total deadline passed"
    WATCHDOG = "a backend call overran its timeout plus grace"
    CREATE_FAILED = "the backend failed to create it"
    SHUTDOWN = "the service shut down"
    LEAK_CHECK = "the leak check reclaimed it"


@dataclass(frozen=True)
class TrialInfo:
    """A snapshot of one trial, for listings and logs. Times are seconds on the monotonic clock."""

    trial_id: str
    run_id: str
    task_id: str
    sandbox_id: str | None
    state: TrialState
    limits: TaskLimits
    admitted_at: float | None
    ready_at: float | None
    close_reason: CloseReason | None


# --------------------------------------------------------------------------------------------------
# Trials


class _Trial:
    """Mutable bookkeeping for one trial; every field is guarded by `lock`."""

    def __init__(self, trial_id: str, run_id: str, task: Task, limits: TaskLimits):
        self.trial_id = trial_id
        self.run_id = run_id
        self.task = task
        self.limits = limits
        self.lock = threading.Lock()
        self.cancelled = threading.Event()  # set as soon as the trial is closing, for any reason
        self.state = TrialState.WAITING
        self.close_reason: CloseReason | None = None
        self.backend: Sandbox | None = None
        self.admitted_at: float | None = None
        self.ready_at: float | None = None
        self.total_deadline = math.inf
        self.agent_deadline = math.inf
        self.holds_slot = False
        self.backend_closed = False
        self.calls: dict[int, float] = {}  # call id -> watchdog deadline
        self.step = 0  # the current step of a multi-step task

    @property
    def sandbox_id(self) -> str | None:
        return None if self.backend is None else self.backend.sandbox_id

    def info(self) -> TrialInfo:
        with self.lock:
            return TrialInfo(
                trial_id=self.trial_id,
                run_id=self.run_id,
                task_id=self.task.task_id,
                sandbox_id=self.sandbox_id,
                state=self.state,
                limits=self.limits,
                admitted_at=self.admitted_at,
                ready_at=self.ready_at,
                close_reason=self.close_reason,
            )


def _closed_error(trial: _Trial, action: str) -> SandboxServiceError:
    reason = trial.close_reason or CloseReason.CLOSED
    message = f"cannot {action}: sandbox of trial {trial.trial_id} ({trial.task.task_id}) was closed: "
    message += reason.value
    if reason is CloseReason.TOTAL_DEADLINE:
        return DeadlineExceeded(
            f"cannot {action}: trial {trial.trial_id} passed its total deadline of "
            f"{trial.limits.total_timeout_sec:g}s and its sandbox was reclaimed",
            "total",
        )
    if reason in (CloseReason.CANCELLED, CloseReason.SHUTDOWN, CloseReason.LEAK_CHECK):
        return TrialCancelled(message)
    return SandboxClosed(message)


class AdmittedSandbox:
    """The `Sandbox` handed to callers: forwards to the backend sandbox under the trial's deadlines.
    `sandbox_id` is the backend's id; `trial_id` is the admission id (usable before creation ends)."""

    def __init__(self, controller: AdmissionController, trial: _Trial, task: Task):
        self._controller = controller
        self._trial = trial
        self._task = task

    @property
    def sandbox_id(self) -> str:
        sandbox_id = self._trial.sandbox_id
        assert sandbox_id is not None, "an AdmittedSandbox exists only after its backend sandbox"
        return sandbox_id

    @property
    def trial_id(self) -> str:
        return self._trial.trial_id

    @property
    def run_id(self) -> str:
        return self._trial.run_id

    @property
    def task(self) -> Task:
        return self._task

    @property
    def limits(self) -> TaskLimits:
        """The effective layered deadlines of this trial (task limits capped by the node)."""
        return self._trial.limits

    @property
    def state(self) -> TrialState:
        return self._trial.state

    def remaining_agent_sec(self) -> float:
        return max(0.0, self._trial.agent_deadline - self._controller._clock())

    def exec(self, command: str, timeout_sec: float) -> ExecResult:
        if not isinstance(command, str):
            raise BadRequest(f"exec command must be a string, got {type(command).__name__}")
        _check_duration("exec timeout_sec", timeout_sec)
        with self._controller._agent_call(self._trial, "exec", timeout_sec) as (backend, budget):
            return backend.exec(command, budget)

    def send_keys(self, keys: str, wait_sec: float) -> TerminalRead:
        if not isinstance(keys, str):
            raise BadRequest(f"send_keys keys must be a string, got {type(keys).__name__}")
        _check_duration("send_keys wait_sec", wait_sec, allow_zero=True)
        with self._controller._agent_call(self._trial, "send_keys", wait_sec) as (backend, budget):
            return backend.send_keys(keys, budget)

    def verify(self) -> VerifierReport:
        return self._controller._verify(self._trial)

    def close(self) -> None:
        self._controller._close_trial(self._trial, CloseReason.CLOSED)

    def __enter__(self) -> AdmittedSandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self._trial.state.value
        return f"AdmittedSandbox(trial={self.trial_id}, task={self._task.task_id}, state={state})"


def _check_duration(name: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise BadRequest(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {value}")


# --------------------------------------------------------------------------------------------------
# The controller


class AdmissionController:
    """Wraps `backend` with pacing, a concurrency cap, deadlines, cancellation and leak checks.

    Thread-safe; meant to be shared by every trial of a node. Call `shutdown()` (or use it as a
    context manager) to stop the reaper and close every open trial."""

    _RECENT_CLOSED_LIMIT = 100_000

    def __init__(
        self,
        backend: SandboxProvider,
        config: AdmissionConfig | None = None,
        *,
        clock: Clock = time.monotonic,
    ):
        self.backend = backend
        self.config = config or AdmissionConfig()
        self._clock = clock
        self._bucket = TokenBucket(self.config.create_rate_per_sec, self.config.create_burst, clock=clock)
        self._limiter = ConcurrencyLimiter(self.config.max_live_sandboxes)
        self._lock = threading.Lock()
        self._open: dict[str, _Trial] = {}  # trial id -> trial, until closed
        self._by_sandbox: dict[str, _Trial] = {}  # backend sandbox id -> trial, until closed
        self._recent_closed: OrderedDict[str, _Trial] = OrderedDict()  # trial and sandbox ids
        self._call_ids = itertools.count()
        self._counters = {"created": 0, "closed": 0, "cancelled": 0, "expired": 0, "create_failed": 0}
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="sandbox-admission-reaper", daemon=True)
        self._reaper.start()

    # ---- creation --------------------------------------------------------------------------------

    def create(
        self,
        task: Task,
        *,
        run_id: str = "default",
        trial_id: str | None = None,
        admission_timeout_sec: float | None = None,
    ) -> AdmittedSandbox:
        """Admit and create a sandbox for `task`. Blocks for a concurrency slot, then for a creation
        token, then for the backend. `trial_id` (default: a fresh id) lets another thread `cancel`
        the trial before this call returns. `admission_timeout_sec` bounds the wait for the slot and
        the token (`AdmissionTimeout` after it); the node's own limit, if any, still applies."""
        if not isinstance(run_id, str) or not run_id:
            raise BadRequest(f"run_id must be a non-empty string, got {run_id!r}")
        if self._stopping.is_set():
            raise SandboxClosed("the admission controller is shut down; no new sandboxes")
        limits = self.config.effective_limits(task.limits)
        steps = tuple(
            dataclasses.replace(step, limits=self.config.effective_limits(step.limits)) for step in task.steps
        )
        effective_task = (
            task
            if limits == task.limits and steps == task.steps
            else dataclasses.replace(task, limits=limits, steps=steps)
        )
        trial = _Trial(trial_id or uuid.uuid4().hex, run_id, effective_task, limits)
        with self._lock:
            if trial.trial_id in self._open or trial.trial_id in self._recent_closed:
                raise BadRequest(f"trial id {trial.trial_id!r} is already in use")
            self._open[trial.trial_id] = trial

        try:
            self._admit(trial, admission_timeout_sec)
        except BaseException:
            self._forget(
                trial, CloseReason.CANCELLED if trial.cancelled.is_set() else CloseReason.CREATE_FAILED
            )
            raise

        try:
            backend_sandbox = self.backend.create(effective_task, run_id=run_id)
        except BaseException as error:
            with trial.lock:
                reason = trial.close_reason
            self._release_slot(trial)
            self._forget(trial, reason or CloseReason.CREATE_FAILED)
            if reason is not None:
                raise _closed_error(trial, "create") from error
            if isinstance(error, SandboxServiceError) or not isinstance(error, Exception):
                raise
            raise translate(error, f"creating a sandbox for {task.task_id}") from error

        with trial.lock:
            trial.backend = backend_sandbox
            closed_meanwhile = trial.state is TrialState.CLOSED
            if not closed_meanwhile:
                trial.state = TrialState.READY
                trial.ready_at = self._clock()
                trial.agent_deadline = min(trial.ready_at + limits.agent_timeout_sec, trial.total_deadline)
        with self._lock:
            self._by_sandbox[backend_sandbox.sandbox_id] = trial
            self._counters["created"] += 1
        if closed_meanwhile:
            # cancel() or the reaper ran while the backend was creating: reclaim now.
            self._finish_close(trial)
            raise _closed_error(trial, "create")
        return AdmittedSandbox(self, trial, task)

    def environment_audit(self, task: Task) -> EnvironmentAudit:
        """How the backend behind this controller will run `task` (`fidelity.environment_audit`)."""
        return environment_audit(task, self.backend)

    def _admit(self, trial: _Trial, timeout: float | None) -> None:
        if timeout is None:
            timeout = self.config.admission_timeout_sec
        elif self.config.admission_timeout_sec is not None:
            timeout = min(timeout, self.config.admission_timeout_sec)
        started = time.monotonic()
        if not self._limiter.acquire(timeout=timeout, cancelled=trial.cancelled):
            if trial.cancelled.is_set():
                raise _closed_error(trial, "create")
            raise AdmissionTimeout(
                f"no sandbox slot free within {timeout:g}s ({self._limiter.capacity} live sandboxes "
                f"is this node's cap); trial {trial.trial_id} of {trial.task.task_id} was not created"
            )
        with trial.lock:
            trial.holds_slot = True
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        if not self._bucket.acquire(timeout=remaining, cancelled=trial.cancelled):
            self._release_slot(trial)
            if trial.cancelled.is_set():
                raise _closed_error(trial, "create")
            raise AdmissionTimeout(
                f"no creation token within {timeout:g}s (rate {self.config.create_rate_per_sec}/s); "
                f"trial {trial.trial_id} of {trial.task.task_id} was not created"
            )
        with trial.lock:
            if trial.state is TrialState.CLOSED:
                release = True
            else:
                release = False
                trial.state = TrialState.CREATING
                trial.admitted_at = self._clock()
                trial.total_deadline = trial.admitted_at + trial.limits.total_timeout_sec
        if release:
            self._release_slot(trial)
            raise _closed_error(trial, "create")

    # ---- agent phase -------------------------------------------------------------------------------

    @contextmanager
    def _agent_call(
        self, trial: _Trial, action: str, requested_sec: float
    ) -> Iterator[tuple[Sandbox, float]]:
        now = self._clock()
        with trial.lock:
            if trial.state is TrialState.CLOSED:
                raise _closed_error(trial, action)
            if trial.state in (TrialState.VERIFYING, TrialState.VERIFIED):
                raise SandboxStateError(
                    f"cannot {action} in trial {trial.trial_id}: verify() already ran; "
                    "the agent phase is over"
                )
            if now >= trial.agent_deadline:
                raise DeadlineExceeded(
                    f"cannot {action} in trial {trial.trial_id}: its agent deadline of "
                    f"{trial.limits.agent_timeout_sec:g}s has passed; only verify() and close() remain",
                    "agent",
                )
            budget = min(requested_sec, trial.agent_deadline - now)
            backend = trial.backend
            assert backend is not None
        call_id = self._register_call(trial, now + budget + self.config.call_grace_sec)
        try:
            yield backend, budget
        except SandboxServiceError:
            if trial.cancelled.is_set():
                raise _closed_error(trial, action) from None
            raise
        except Exception as error:
            if trial.cancelled.is_set():
                raise _closed_error(trial, action) from error
            raise translate(error, f"{action} in sandbox {backend.sandbox_id}") from error
        finally:
            self._unregister_call(trial, call_id)
        if trial.cancelled.is_set():
            raise _closed_error(trial, action)

    # ---- verification ------------------------------------------------------------------------------

    def _verify(self, trial: _Trial) -> VerifierReport:
        now = self._clock()
        with trial.lock:
            if trial.state is TrialState.CLOSED:
                raise _closed_error(trial, "verify")
            if trial.state is not TrialState.READY:
                raise SandboxStateError(f"verify() was already called for trial {trial.trial_id}")
            trial.state = TrialState.VERIFYING
            backend = trial.backend
            assert backend is not None
            step_limits = step_view(trial.task, trial.step).limits
            budget = min(step_limits.verifier_timeout_sec, trial.total_deadline - now)
        call_id = self._register_call(trial, now + budget + self.config.call_grace_sec)
        try:
            report = backend.verify()
        except Exception as error:
            report = None
            failure: Exception | None = error
        else:
            failure = None
        finally:
            self._unregister_call(trial, call_id)
        with trial.lock:
            reason = trial.close_reason
            if reason is None:
                trial.state = TrialState.VERIFIED
                if failure is None and trial.step + 1 < step_count(trial.task):  # the next step begins
                    trial.step += 1
                    trial.state = TrialState.READY
                    agent_sec = step_view(trial.task, trial.step).limits.agent_timeout_sec
                    trial.agent_deadline = min(self._clock() + agent_sec, trial.total_deadline)
        if reason is CloseReason.TOTAL_DEADLINE or reason is CloseReason.WATCHDOG:
            # The verifier was running when time ran out: that is a verifier timeout, not a crash.
            return VerifierReport(
                assertions=(),
                parsed=False,
                failure_cause=FailureCause.VERIFIER_TIMEOUT,
                binary_outcome=None,
                detail=f"verification of trial {trial.trial_id} was stopped because {reason.value}",
            )
        if reason is not None:
            raise _closed_error(trial, "verify")
        if failure is not None:
            if isinstance(failure, SandboxServiceError):
                raise failure
            raise translate(failure, f"verify in sandbox {backend.sandbox_id}") from failure
        assert report is not None
        return report

    # ---- closing and cancellation ------------------------------------------------------------------

    def cancel(self, trial_or_sandbox_id: str) -> bool:
        """Close a trial at any point of its life. True if this call closed it, False if it was
        already closed. Raises `UnknownSandbox` for an id this controller never saw."""
        trial = self._find(trial_or_sandbox_id)
        return self._close_trial(trial, CloseReason.CANCELLED)

    def cancel_run(self, run_id: str) -> list[str]:
        """Cancel every open trial of `run_id`; returns the trial ids this call closed."""
        with self._lock:
            trials = [trial for trial in self._open.values() if trial.run_id == run_id]
        return [trial.trial_id for trial in trials if self._close_trial(trial, CloseReason.CANCELLED)]

    def leak_check(self, run_id: str | None = None) -> LeakReport:
        """Reclaim everything of `run_id` (None: every run) and report what had been left behind.
        Call it when the run (or step) has no trial that should still be alive."""
        with self._lock:
            trials = [t for t in self._open.values() if run_id is None or t.run_id == run_id]
        unclosed = tuple(t.trial_id for t in trials if self._close_trial(t, CloseReason.LEAK_CHECK))
        orphans: tuple[str, ...] = ()
        remaining: tuple[str, ...] = ()
        if isinstance(self.backend, ReclaimingProvider):
            orphans = tuple(self.backend.live_sandboxes(run_id))
            if orphans:
                log.warning(
                    "leak check of run %s: killing %d orphaned sandboxes: %s", run_id, len(orphans), orphans
                )
                self.backend.reap(run_id)
            remaining = tuple(self.backend.live_sandboxes(run_id))
        if unclosed:
            log.warning(
                "leak check of run %s: %d trials were never closed: %s", run_id, len(unclosed), unclosed
            )
        return LeakReport(run_id, unclosed, orphans, remaining)

    def shutdown(self, wait_sec: float = 60.0) -> None:
        """Refuse new trials, close every open one (also those waiting for admission), and wait up
        to `wait_sec` for creations still inside the backend to return and be reclaimed."""
        self._stopping.set()
        with self._lock:
            trials = list(self._open.values())
        for trial in trials:
            self._close_trial(trial, CloseReason.SHUTDOWN)
        self._limiter.wake_all()
        give_up = time.monotonic() + wait_sec
        while time.monotonic() < give_up:
            with self._lock:
                if not self._open:
                    break
            time.sleep(0.05)
        if self._reaper.is_alive() and threading.current_thread() is not self._reaper:
            self._reaper.join(timeout=10)

    def __enter__(self) -> AdmissionController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _close_trial(self, trial: _Trial, reason: CloseReason) -> bool:
        """Mark the trial closed (first reason wins) and reclaim its sandbox if it exists yet.
        A trial still in the backend's create is reclaimed by `create` when the backend returns."""
        with trial.lock:
            if trial.state is TrialState.CLOSED:
                return False
            trial.state = TrialState.CLOSED
            trial.close_reason = reason
            trial.cancelled.set()
            has_backend = trial.backend is not None
        self._limiter.wake_all()  # a waiter on the limiter notices cancellation at once
        counter = {
            CloseReason.CLOSED: "closed",
            CloseReason.TOTAL_DEADLINE: "expired",
            CloseReason.WATCHDOG: "expired",
        }.get(reason, "cancelled")
        with self._lock:
            self._counters[counter] += 1
        if has_backend:
            self._finish_close(trial)
        # Otherwise `create` is still running: it sees the cancelled event, releases what it holds,
        # closes the backend sandbox the moment it exists, and forgets the trial.
        return True

    def _finish_close(self, trial: _Trial) -> None:
        with trial.lock:
            if trial.backend_closed or trial.backend is None:
                return
            trial.backend_closed = True
            backend = trial.backend
        try:
            backend.close()
        except Exception:
            # The slot is still released (capacity must not leak); the sandbox stays visible to the
            # backend's `live_sandboxes`, so the next leak check kills it.
            log.exception(
                "closing sandbox %s of trial %s failed; leak_check will reap it",
                backend.sandbox_id,
                trial.trial_id,
            )
        self._release_slot(trial)
        self._forget(trial, trial.close_reason or CloseReason.CLOSED)

    def _release_slot(self, trial: _Trial) -> None:
        with trial.lock:
            if not trial.holds_slot:
                return
            trial.holds_slot = False
        self._limiter.release()

    def _forget(self, trial: _Trial, reason: CloseReason) -> None:
        with trial.lock:
            if trial.state is not TrialState.CLOSED:
                trial.state = TrialState.CLOSED
                trial.close_reason = reason
                trial.cancelled.set()
        with self._lock:
            self._open.pop(trial.trial_id, None)
            keys = [trial.trial_id]
            if trial.sandbox_id is not None:
                self._by_sandbox.pop(trial.sandbox_id, None)
                keys.append(trial.sandbox_id)
            if reason is CloseReason.CREATE_FAILED:
                self._counters["create_failed"] += 1
            for key in keys:
                self._recent_closed[key] = trial
                self._recent_closed.move_to_end(key)
            while len(self._recent_closed) > self._RECENT_CLOSED_LIMIT:
                self._recent_closed.popitem(last=False)

    # ---- lookup and status -------------------------------------------------------------------------

    def _find(self, trial_or_sandbox_id: str) -> _Trial:
        with self._lock:
            trial = (
                self._open.get(trial_or_sandbox_id)
                or self._by_sandbox.get(trial_or_sandbox_id)
                or self._recent_closed.get(trial_or_sandbox_id)
            )
        if trial is None:
            raise UnknownSandbox(
                f"no sandbox or trial with id {trial_or_sandbox_id!r} exists on this service"
            )
        return trial

    def run_of(self, trial_or_sandbox_id: str) -> str:
        """The run a trial (by trial id or sandbox id) belongs to; `UnknownSandbox` if none."""
        return self._find(trial_or_sandbox_id).run_id

    def get(self, trial_or_sandbox_id: str) -> AdmittedSandbox:
        """A handle to an existing trial by trial id or sandbox id (the server uses this). For a
        closed trial the handle exists but every call on it raises the reason it was closed."""
        trial = self._find(trial_or_sandbox_id)
        with trial.lock:
            state, has_backend = trial.state, trial.backend is not None
        if not has_backend:
            if state is TrialState.CLOSED:
                raise _closed_error(trial, "use it")
            raise SandboxStateError(f"trial {trial.trial_id} has no sandbox yet (state {state.value})")
        return AdmittedSandbox(self, trial, trial.task)

    def trials(self, run_id: str | None = None) -> list[TrialInfo]:
        """Snapshots of the open trials (of one run, or all)."""
        with self._lock:
            trials = [t for t in self._open.values() if run_id is None or t.run_id == run_id]
        return [trial.info() for trial in trials]

    def live_count(self) -> int:
        """Trials holding a concurrency slot right now (creating, live or closing)."""
        return self._limiter.in_use

    def stats(self) -> dict[str, int | float | None]:
        with self._lock:
            counters = dict(self._counters)
            open_trials = len(self._open)
        return {
            **counters,
            "open": open_trials,
            "live": self._limiter.in_use,
            "capacity": self._limiter.capacity,
            "create_rate_per_sec": self.config.create_rate_per_sec,
        }

    # ---- watchdogs ---------------------------------------------------------------------------------

    def _register_call(self, trial: _Trial, watchdog_deadline: float) -> int:
        call_id = next(self._call_ids)
        with trial.lock:
            trial.calls[call_id] = watchdog_deadline
        return call_id

    def _unregister_call(self, trial: _Trial, call_id: int) -> None:
        with trial.lock:
            trial.calls.pop(call_id, None)

    def _reap_once(self) -> None:
        now = self._clock()
        with self._lock:
            trials = list(self._open.values())
        for trial in trials:
            with trial.lock:
                expired = now >= trial.total_deadline
                overran = any(now >= deadline for deadline in trial.calls.values())
            if expired:
                log.warning(
                    "trial %s (%s) passed its total deadline of %gs; closing its sandbox",
                    trial.trial_id,
                    trial.task.task_id,
                    trial.limits.total_timeout_sec,
                )
                self._close_trial(trial, CloseReason.TOTAL_DEADLINE)
            elif overran:
                log.warning(
                    "trial %s: a backend call overran its timeout by more than %gs; closing its sandbox",
                    trial.trial_id,
                    self.config.call_grace_sec,
                )
                self._close_trial(trial, CloseReason.WATCHDOG)

    def _reap_loop(self) -> None:
        while not self._stopping.wait(self.config.reaper_interval_sec):
            try:
                self._reap_once()
            except Exception:  # the reaper must outlive any single failure
                log.exception("admission reaper pass failed")
