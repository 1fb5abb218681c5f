"""The trial scheduler: many concurrent trials, oversampling with a guaranteed cancel, and a
publication barrier at the trial level (paper §2.2, §4.4, §7.3-7.4, §9.3, App. 12.1).

This module owns running trials and accounting for them. One trial, in its own worker thread:
sandbox `create` (through the caller's admission control: in process, or the HTTP client) ->
the harness loop (`t1jax.agent.harness.run_trial`) -> `verify` -> reward (Eq. 20) -> TITO
assembly -> `close`. `TrialScheduler.start(specs)` runs up to `concurrency` trials at once and
hands back a `Rollout` that yields trials as they finish; `collect(specs, n_admit)` is the
oversampling step: launch N' = len(specs), admit the first `n_admit` to complete, cancel the rest.

Invariants:
- Every launched trial ends in exactly one `TrialFate`: COMPLETED (verified and rewarded),
  CANCELLED (by the caller: an oversampling tail, a shutdown; also trials cancelled before they
  started), or FAILED (infrastructure: a `FailureCause` names the component). A failure is
  reported, never silently dropped, and never retried beyond `create_attempts`.
- Every sandbox a trial created is closed before the trial is reported, whatever ended it
  (cancel, exception, deadline); `close()` (also run at interpreter exit) cancels what is left.
- A trial is generated under one policy version: `publish` stops starting trials, waits until
  none runs (or cancels them), publishes, and resumes, so no trial spans a publication (the
  harness ends, and the assembler refuses, any trial that a publication behind the scheduler's
  back would cross).
- Control-plane waits have deadlines: the harness bounds every sampler call, admission control
  bounds every sandbox call, `publish` bounds its barrier.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import itertools
import math
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sandbox_service.contracts import (
    Difficulty,
    Sandbox,
    SandboxDeadlineExpired,
    Task,
    UnsupportedEnvironment,
    VerifierReport,
)
from sandbox_service.contracts import (
    FailureCause as VerifierFailure,
)
from t1jax.agent.harness import HarnessConfig, ResumableTrial
from t1jax.agent.tokenizer import ChatTokenizer
from t1jax.rl.reward import RewardConfig, RewardOutcome, compute_reward
from t1jax.rollout.types import Sampler, SamplingParams
from t1jax.tito.assembler import Assembly, assemble_trajectory
from t1jax.tito.types import Trajectory, TrialCause, TrialStatus


class TrialFate(enum.StrEnum):
    COMPLETED = "completed"  # the harness ran and the verifier reported: it has a reward
    CANCELLED = "cancelled"  # the caller cancelled it (before or while it ran)
    FAILED = "failed"  # infrastructure failed; `cause` names the component
    PAUSED = "paused"  # stopped at a turn boundary, its sandbox kept, to continue (`carried`)


class FailureCause(enum.StrEnum):
    """Which component failed a trial. Agent-caused ends (timeouts, max turns, a full context,
    garbage output) are not failures: those trials complete and earn what the verifier says."""

    SANDBOX_UNSUPPORTED = "sandbox_unsupported"  # the backend cannot build this task (a skip)
    SANDBOX_CREATE = "sandbox_create"  # create raised (backend error, admission timeout)
    SANDBOX_ERROR = "sandbox_error"  # exec / send_keys failed, or the sandbox vanished
    VERIFY_ERROR = "verify_error"  # verify raised, or the verifier's sandbox failed
    TOTAL_DEADLINE = "total_deadline"  # the trial's total deadline passed (the sandbox was reclaimed)
    SAMPLER_ERROR = "sampler_error"
    SAMPLER_TIMEOUT = "sampler_timeout"  # a sampler call passed its deadline: the engine hung
    SAMPLER_ABORTED = "sampler_aborted"
    SAMPLER_RECORD = "sampler_record"  # an unusable sampler result (e.g. missing routing)
    POLICY_VERSION_CHANGED = "policy_version_changed"  # a publication crossed the trial
    ASSEMBLY = "assembly"  # TITO refused the trajectory (routing missing / misaligned, drift)
    HARNESS_ERROR = "harness_error"  # a bug in the harness


_FROM_TRIAL_CAUSE = {
    TrialCause.SAMPLER_ERROR: FailureCause.SAMPLER_ERROR,
    TrialCause.SAMPLER_TIMEOUT: FailureCause.SAMPLER_TIMEOUT,
    TrialCause.SAMPLER_ABORTED: FailureCause.SAMPLER_ABORTED,
    TrialCause.SAMPLER_RECORD: FailureCause.SAMPLER_RECORD,
    TrialCause.POLICY_VERSION_CHANGED: FailureCause.POLICY_VERSION_CHANGED,
    TrialCause.SANDBOX_ERROR: FailureCause.SANDBOX_ERROR,
    TrialCause.HARNESS_ERROR: FailureCause.HARNESS_ERROR,
}


@dataclass(frozen=True)
class TrialSpec:
    """One trial to run. `trial_id` is unique within the run (it names the sandbox trial and the
    sampler requests); `attempt` numbers repeated trials of one task (evaluation)."""

    trial_id: str
    task: Task
    sampling: SamplingParams
    attempt: int = 0


@dataclass(frozen=True)
class TrialTimings:
    """Wall seconds of one trial, by phase. `queue` is from launch until the trial started (a free
    worker and no publication in progress); `create` includes admission control's wait."""

    queue: float = 0.0
    create: float = 0.0
    agent: float = 0.0  # the harness loop: `generate` + `environment` + the harness's own work
    generate: float = 0.0  # waiting for the sampler
    environment: float = 0.0  # sandbox commands
    verify: float = 0.0
    close: float = 0.0

    @property
    def total(self) -> float:
        return self.queue + self.create + self.agent + self.verify + self.close


@dataclass(frozen=True)
class FinishedTrial:
    """A trial that ended, with everything the controller and the evaluator account for.

    `trajectory` is None only when no sandbox was ever created for it; `reward` (and, when the
    scheduler assembles, `assembly`) are set exactly when `fate` is COMPLETED; `cause` exactly
    when it is FAILED. By the time a caller sees it, its sandbox is closed (`close_error` holds
    what closing raised, if anything; admission control's leak check still reclaims it).
    """

    spec: TrialSpec
    fate: TrialFate
    launch_index: int
    trajectory: Trajectory | None = None
    reward: RewardOutcome | None = None
    assembly: Assembly | None = None
    cause: FailureCause | None = None
    detail: str = ""
    timings: TrialTimings = TrialTimings()
    started: bool = True  # False: cancelled before it began (no sandbox, no request)
    close_error: str = ""
    carried: CarriedTrial | None = None  # set exactly when `fate` is PAUSED
    continued: int = 0  # how many earlier runs (steps) this trial's turns span before this one
    reused_turns: int = 0  # turns generated by those earlier runs and kept (partial rollouts)

    @property
    def trial_id(self) -> str:
        return self.spec.trial_id

    @property
    def task(self) -> Task:
        return self.spec.task

    @property
    def category(self) -> str:
        return self.spec.task.category

    @property
    def difficulty(self) -> Difficulty:
        return self.spec.task.difficulty

    @property
    def action_turns(self) -> int:
        return 0 if self.trajectory is None else self.trajectory.stats.action_turns

    @property
    def policy_version(self) -> int | None:
        turns = () if self.trajectory is None else self.trajectory.turns
        return turns[0].policy_version if turns else None


class CarriedTrial:
    """A paused trial carried to a later rollout (partial rollouts, paper §10): its harness state
    and its live sandbox. `collect(..., carried=[...])` continues it; `discard()` closes its
    sandbox when it will not be continued (too old, or the run ends)."""

    def __init__(self, spec: TrialSpec, trial, sandbox: Sandbox, runs: int):
        self.spec, self.trial, self.sandbox, self.runs = spec, trial, sandbox, runs

    @property
    def trial_id(self) -> str:
        return self.spec.trial_id

    def discard(self) -> str:
        try:
            self.sandbox.close()
            return ""
        except Exception as error:  # admission control's leak check still reaps it
            return f"{type(error).__name__}: {error}"


class TrialSandboxes(Protocol):
    """What the scheduler needs of a sandbox provider: admission control in process
    (`sandbox_service.admission.AdmissionController`) or over HTTP
    (`sandbox_service.client.SandboxServiceClient`). `cancel` must work at any point of a
    trial's life, including while its `create` is still waiting or running."""

    def create(self, task: Task, *, run_id: str, trial_id: str) -> Sandbox: ...

    def cancel(self, trial_or_sandbox_id: str) -> bool: ...


@dataclass(frozen=True)
class PublicationRecord:
    """One publication through the scheduler's barrier: how long the barrier waited for running
    trials (`barrier_sec`), how long the sampler took to install the weights (`publish_sec`:
    transfer to the sampler's devices and the swap), and what it cancelled to get there."""

    version: int
    barrier_sec: float
    publish_sec: float
    cancelled_trials: int = 0


class Rollout:
    """The trials of one `TrialScheduler.start` call: iterate to get each as it finishes
    (blocking); `cancel()` cancels every trial that has not finished (queued ones end at once,
    running ones as soon as their sampler request and sandbox are torn down)."""

    def __init__(
        self, scheduler: TrialScheduler, specs: Sequence[TrialSpec], carried: Sequence[CarriedTrial] = ()
    ):
        self._scheduler = scheduler
        # Carried (paused) trials first: they are the oldest work and hold live sandboxes.
        self.items: tuple[TrialSpec | CarriedTrial, ...] = tuple(carried) + tuple(specs)
        self.specs = tuple(item.spec if isinstance(item, CarriedTrial) else item for item in self.items)
        self._pending: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(len(self.specs)):
            self._pending.put(index)
        self._finished: queue.SimpleQueue[FinishedTrial] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._running: dict[int, _Live] = {}  # launch index -> the running trial's handle
        self._lock = threading.Lock()
        self._delivered = 0
        self.launched_at = time.monotonic()
        workers = min(scheduler.concurrency, len(self.specs))
        self._workers = [
            threading.Thread(target=self._work, name=f"t1jax-trial-{i}", daemon=True) for i in range(workers)
        ]
        for worker in self._workers:
            worker.start()

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[FinishedTrial]:
        while self._delivered < len(self.specs):
            trial = self._finished.get()
            self._delivered += 1
            yield trial

    def next(self, timeout_sec: float | None = None) -> FinishedTrial | None:
        """The next trial to finish, or None once all were delivered or `timeout_sec` passed."""
        if self._delivered >= len(self.specs):
            return None
        try:
            trial = self._finished.get(timeout=timeout_sec)
        except queue.Empty:
            return None
        self._delivered += 1
        return trial

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def cancel(self) -> int:
        """Cancel every trial not yet finished; returns how many were running."""
        self._cancelled.set()
        with self._lock:
            running = list(self._running.values())
        for live in running:
            live.cancel(self._scheduler)
        return len(running)

    def pause(self) -> int:
        """Pause every running trial at its next turn boundary (it comes back PAUSED, its sandbox
        kept) and cancel the queued ones; returns how many were asked to pause."""
        self._cancelled.set()  # nothing more starts
        with self._lock:
            running = list(self._running.values())
        for live in running:
            live.pause_event.set()
        return len(running)

    def join(self, timeout_sec: float | None = None) -> bool:
        """Wait for every worker thread to end; True when all did."""
        deadline = None if timeout_sec is None else time.monotonic() + timeout_sec
        for worker in self._workers:
            worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(worker.is_alive() for worker in self._workers)

    def _work(self) -> None:
        scheduler = self._scheduler
        while True:
            try:
                index = self._pending.get_nowait()
            except queue.Empty:
                return
            spec, item = self.specs[index], self.items[index]
            live = _Live()
            if not scheduler._enter(self._cancelled):
                never = _never_started(spec, index, time.monotonic() - self.launched_at)
                if isinstance(item, CarriedTrial):  # a carried trial not continued: its sandbox goes
                    never = dataclasses.replace(never, close_error=item.discard(), continued=item.runs)
                self._finished.put(never)
                continue
            with self._lock:
                self._running[index] = live
            if self._cancelled.is_set():  # cancelled between the two checks: tear down at once
                live.cancel(scheduler)
            try:
                trial = scheduler._run_one(item, index, live, time.monotonic() - self.launched_at)
            finally:
                with self._lock:
                    self._running.pop(index, None)
                scheduler._leave()
            self._finished.put(trial)


class _Live:
    """A running trial as its rollout sees it: the harness's cancel event, and every sandbox trial
    id it has asked admission control for (a retried create uses a fresh one)."""

    def __init__(self) -> None:
        self.cancel_event = threading.Event()
        self.pause_event = threading.Event()
        self._lock = threading.Lock()
        self._sandbox_ids: list[str] = []

    def add_sandbox(self, trial_id: str) -> None:
        with self._lock:
            self._sandbox_ids.append(trial_id)

    def cancel(self, scheduler: TrialScheduler) -> None:
        self.cancel_event.set()
        with self._lock:
            ids = list(self._sandbox_ids)
        for trial_id in ids:
            scheduler._cancel_sandbox(trial_id)


def _never_started(spec: TrialSpec, index: int, queued_sec: float) -> FinishedTrial:
    return FinishedTrial(
        spec=spec,
        fate=TrialFate.CANCELLED,
        launch_index=index,
        detail="cancelled before it started",
        timings=TrialTimings(queue=queued_sec),
        started=False,
    )


@dataclass(frozen=True)
class CollectedBatch:
    """One oversampling step (paper §4.4): `n_launch` trials launched, the first `n_admit` to
    complete admitted, the rest cancelled. Every launched trial is in exactly one of `admitted`,
    `dropped` (completed after the quota was met, before its cancel took effect), `cancelled`,
    `failed`; `t1jax.runtime.metrics.selection_metrics` puts the composition of each on the axes
    the tail is biased along (category, difficulty, turns; §9.3)."""

    admitted: tuple[FinishedTrial, ...]
    dropped: tuple[FinishedTrial, ...]
    cancelled: tuple[FinishedTrial, ...]
    failed: tuple[FinishedTrial, ...]
    n_admit: int
    wall_sec: float
    paused: tuple[FinishedTrial, ...] = ()  # the tail, kept to continue (partial rollouts)

    @property
    def n_launch(self) -> int:
        return sum(map(len, (self.admitted, self.dropped, self.cancelled, self.failed, self.paused)))

    @property
    def all(self) -> tuple[FinishedTrial, ...]:
        return tuple(
            sorted(
                self.admitted + self.dropped + self.cancelled + self.failed + self.paused,
                key=lambda t: t.launch_index,
            )
        )


class TrialScheduler:
    """Runs trials of `harness` for `sampler` in sandboxes from `sandboxes` (module docstring).

    `assemble=True` stitches every completed trial into training samples (a trajectory TITO
    refuses is a FAILED trial with cause ASSEMBLY). `create_attempts` > 1 retries a failed
    sandbox create that many times in all (never an `UnsupportedEnvironment`).
    """

    def __init__(
        self,
        *,
        sampler: Sampler,
        sandboxes: TrialSandboxes,
        tokenizer: ChatTokenizer,
        harness: HarnessConfig,
        reward: RewardConfig,
        run_id: str,
        concurrency: int = 16,
        assemble: bool = True,
        create_attempts: int = 1,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if create_attempts < 1:
            raise ValueError(f"create_attempts must be >= 1, got {create_attempts}")
        self.sampler = sampler
        self.sandboxes = sandboxes
        self.tokenizer = tokenizer
        self.harness = harness
        self.reward = reward
        self.run_id = run_id
        self.concurrency = concurrency
        self.assemble = assemble
        self.create_attempts = create_attempts
        self._gate = threading.Condition()
        self._active = 0  # trials started and not yet finished, over every rollout
        self.peak_active = 0  # the most trials that ran at once (observability)
        self._publishing = False
        self._closed = False
        self._rollouts: weakref.WeakSet[Rollout] = weakref.WeakSet()
        self.publications: list[PublicationRecord] = []
        _LIVE_SCHEDULERS.add(self)

    # ---- launching -----------------------------------------------------------------------------

    def start(self, specs: Sequence[TrialSpec], carried: Sequence[CarriedTrial] = ()) -> Rollout:
        """Launch `carried` trials (continued) and `specs` (at most `concurrency` run at once, in
        that order); trial ids must be unique."""
        ids = [item.trial_id for item in (*carried, *specs)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"trial ids repeat: {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
        with self._gate:
            if self._closed:
                raise RuntimeError("the trial scheduler is closed")
        rollout = Rollout(self, specs, carried)
        self._rollouts.add(rollout)
        return rollout

    def run(self, specs: Sequence[TrialSpec]) -> list[FinishedTrial]:
        """Run every trial to its end; returns them in the order they finished."""
        return list(self.start(specs))

    def collect(
        self,
        specs: Sequence[TrialSpec],
        n_admit: int,
        *,
        carried: Sequence[CarriedTrial] = (),
        pause_tail: bool = False,
    ) -> CollectedBatch:
        """Oversampling (§4.4): launch every spec (after continuing the `carried` trials), admit
        the first `n_admit` to complete, then cancel the rest and wait until each of them has
        ended (its sandbox closed, its sampler request aborted). With `pause_tail` the running
        tail is paused instead and kept to continue (`CollectedBatch.paused`; queued ones are
        still cancelled). Fewer than `n_admit` are admitted only when too many failed."""
        launched = len(specs) + len(carried)
        if not 0 < n_admit <= launched:
            raise ValueError(f"n_admit must lie in [1, {launched}] (the trials launched), got {n_admit}")
        started = time.monotonic()
        rollout = self.start(specs, carried)
        classes: dict[TrialFate, list[FinishedTrial]] = {fate: [] for fate in TrialFate}
        admitted, dropped = [], []
        stop = rollout.pause if pause_tail else rollout.cancel
        try:
            for trial in rollout:
                if trial.fate is not TrialFate.COMPLETED:
                    classes[trial.fate].append(trial)
                elif len(admitted) < n_admit:
                    admitted.append(trial)
                    if len(admitted) == n_admit:
                        stop()
                else:
                    dropped.append(trial)
        except BaseException:
            rollout.cancel()  # an exception in the loop (e.g. KeyboardInterrupt) leaves nothing behind
            rollout.join()
            for trial in classes[TrialFate.PAUSED]:
                trial.carried.discard()
            raise
        rollout.join()
        return CollectedBatch(
            tuple(admitted),
            tuple(dropped),
            tuple(classes[TrialFate.CANCELLED]),
            tuple(classes[TrialFate.FAILED]),
            n_admit,
            time.monotonic() - started,
            tuple(classes[TrialFate.PAUSED]),
        )

    # ---- the publication barrier ---------------------------------------------------------------

    def publish(
        self,
        params: Any,
        version: int,
        *,
        cancel_running: bool = False,
        barrier_timeout_sec: float | None = None,
        publish_timeout_sec: float | None = None,
    ) -> PublicationRecord:
        """Publish `params` as `version` with no trial running: new trials wait, running ones
        finish (or, with `cancel_running`, are cancelled), then `sampler.publish`. Raises
        TimeoutError when running trials do not end within `barrier_timeout_sec` (nothing was
        published; trials resume)."""
        started = time.monotonic()
        cancelled = 0
        with self._gate:
            while self._publishing:
                self._gate.wait()
            self._publishing = True
        try:
            if cancel_running:
                cancelled = sum(rollout.cancel() for rollout in list(self._rollouts))
            with self._gate:
                deadline = None if barrier_timeout_sec is None else started + barrier_timeout_sec
                while self._active:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"publication of version {version}: {self._active} trials still running after "
                            f"{barrier_timeout_sec:g} s at the barrier"
                        )
                    self._gate.wait(remaining)
            barrier_sec = time.monotonic() - started
            self.sampler.publish(params, version, timeout_sec=publish_timeout_sec)
            record = PublicationRecord(
                int(version), barrier_sec, time.monotonic() - started - barrier_sec, cancelled
            )
            self.publications.append(record)
            return record
        finally:
            with self._gate:
                self._publishing = False
                self._gate.notify_all()

    def _enter(self, cancelled: threading.Event) -> bool:
        """Wait until a trial may start (no publication in progress); False if its rollout was
        cancelled (or the scheduler closed) meanwhile."""
        with self._gate:
            while self._publishing and not cancelled.is_set() and not self._closed:
                self._gate.wait(0.1)
            if cancelled.is_set() or self._closed:
                return False
            self._active += 1
            self.peak_active = max(self.peak_active, self._active)
            return True

    def _leave(self) -> None:
        with self._gate:
            self._active -= 1
            self._gate.notify_all()

    @property
    def active_trials(self) -> int:
        with self._gate:
            return self._active

    # ---- shutdown ------------------------------------------------------------------------------

    def cancel_all(self) -> int:
        """Cancel every trial of every rollout; returns how many were running."""
        return sum(rollout.cancel() for rollout in list(self._rollouts))

    def close(self, wait_sec: float = 120.0) -> None:
        """Cancel everything and wait (up to `wait_sec`) until every trial thread has ended, so
        every sandbox is closed. Idempotent."""
        with self._gate:
            self._closed = True
            self._gate.notify_all()
        rollouts = list(self._rollouts)
        for rollout in rollouts:
            rollout.cancel()
        deadline = time.monotonic() + wait_sec
        for rollout in rollouts:
            rollout.join(max(0.0, deadline - time.monotonic()))
        _LIVE_SCHEDULERS.discard(self)

    def __enter__(self) -> TrialScheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cancel_sandbox(self, trial_id: str) -> None:
        try:
            self.sandboxes.cancel(trial_id)
        except Exception:  # unknown (not created yet, or never will be) or already closed
            pass

    # ---- one trial -----------------------------------------------------------------------------

    def _run_one(
        self, item: TrialSpec | CarriedTrial, index: int, live: _Live, queued_sec: float
    ) -> FinishedTrial:
        """One trial from create (or from where a pause left it) to close. Its fate is decided
        where its outcome is known: a phase that ends because the trial was cancelled makes it
        CANCELLED, a failure that came first stays FAILED, a trial whose verifier reported stays
        COMPLETED, and a paused one keeps its sandbox open for the rollout that continues it."""
        phases = {"queue": queued_sec}
        sandbox: Sandbox | None = None
        outcome: dict[str, Any] = {}
        carried = item if isinstance(item, CarriedTrial) else None
        spec = item.spec if carried is not None else item
        try:
            if carried is not None:
                sandbox = carried.sandbox
                live.add_sandbox(carried.sandbox.sandbox_id)
            else:
                sandbox = self._create(spec, live, phases, outcome)
            if sandbox is not None:
                self._play(spec, sandbox, live, phases, outcome, carried)
        except Exception as error:  # a bug here must not take the worker (and its accounting) down
            outcome.update(
                fate=TrialFate.CANCELLED if live.cancel_event.is_set() else TrialFate.FAILED,
                cause=FailureCause.HARNESS_ERROR,
                detail=f"scheduler error {type(error).__name__}: {error}",
            )
        finally:
            kept = outcome.get("fate") is TrialFate.PAUSED
            close_error = "" if kept else self._close(sandbox, phases)
        trajectory: Trajectory | None = outcome.get("trajectory")
        stats = trajectory.stats if trajectory is not None else None
        timings = TrialTimings(
            queue=phases.get("queue", 0.0),
            create=phases.get("create", 0.0),
            agent=phases.get("agent", 0.0),
            generate=stats.generate_sec if stats else 0.0,
            environment=stats.environment_sec if stats else 0.0,
            verify=phases.get("verify", 0.0),
            close=phases.get("close", 0.0),
        )
        fate = outcome["fate"]
        return FinishedTrial(
            spec=spec,
            fate=fate,
            launch_index=index,
            trajectory=trajectory,
            reward=outcome.get("reward") if fate is TrialFate.COMPLETED else None,
            assembly=outcome.get("assembly") if fate is TrialFate.COMPLETED else None,
            cause=outcome.get("cause") if fate is TrialFate.FAILED else None,
            detail=outcome.get("detail", ""),
            timings=timings,
            close_error=close_error,
            carried=outcome.get("carried") if fate is TrialFate.PAUSED else None,
            continued=carried.runs if carried is not None else 0,
            reused_turns=outcome.get("reused_turns", 0),
        )

    def _create(self, spec, live: _Live, phases, outcome) -> Sandbox | None:
        started = time.monotonic()
        cancel_event = live.cancel_event
        try:
            for attempt in itertools.count(1):
                if cancel_event.is_set():
                    outcome.update(fate=TrialFate.CANCELLED, detail="cancelled before its sandbox existed")
                    return None
                trial_id = spec.trial_id if attempt == 1 else f"{spec.trial_id}~{attempt}"
                live.add_sandbox(trial_id)
                try:
                    return self.sandboxes.create(spec.task, run_id=self.run_id, trial_id=trial_id)
                except UnsupportedEnvironment as error:
                    outcome.update(
                        fate=TrialFate.FAILED, cause=FailureCause.SANDBOX_UNSUPPORTED, detail=error.reason
                    )
                    return None
                except Exception as error:
                    if cancel_event.is_set():
                        outcome.update(
                            fate=TrialFate.CANCELLED, detail="cancelled while its sandbox was created"
                        )
                        return None
                    if attempt >= self.create_attempts:
                        outcome.update(
                            fate=TrialFate.FAILED,
                            cause=FailureCause.SANDBOX_CREATE,
                            detail=f"create failed ({attempt} attempts): {type(error).__name__}: {error}",
                        )
                        return None
            raise AssertionError("unreachable")
        finally:
            phases["create"] = time.monotonic() - started

    def _play(self, spec, sandbox, live: _Live, phases, outcome, carried: CarriedTrial | None) -> None:
        cancel_event = live.cancel_event
        started = time.monotonic()
        if carried is not None:
            trial = carried.trial
            trajectory = trial.resume(self.sampler, cancel_event=cancel_event, pause_event=live.pause_event)
            outcome["reused_turns"] = trial.turns_before_resume
        else:
            config = self.harness
            remaining = getattr(sandbox, "remaining_agent_sec", None)
            # The node may cap the task's own agent deadline (a multi-step task's harness asks
            # the sandbox at each step instead: a step's phase opens at the previous verify).
            if remaining is not None and not spec.task.steps:
                agent_sec = min(config.agent_timeout_sec or math.inf, remaining())
                if math.isfinite(agent_sec):
                    config = dataclasses.replace(config, agent_timeout_sec=max(agent_sec, 1e-3))
            trial = ResumableTrial(
                spec.task,
                sandbox,
                self.sampler,
                self.tokenizer,
                config,
                trial_id=spec.trial_id,
                sampling=spec.sampling,
                cancel_event=cancel_event,
                pause_event=live.pause_event,
            )
            trajectory = trial.run()
        phases["agent"] = time.monotonic() - started
        outcome["trajectory"] = trajectory
        if trajectory.status is TrialStatus.PAUSED:
            runs = (carried.runs if carried is not None else 0) + 1
            outcome.update(
                fate=TrialFate.PAUSED,
                detail=trajectory.detail,
                carried=CarriedTrial(spec, trial, sandbox, runs),
            )
            return
        if trajectory.status in (TrialStatus.ERROR, TrialStatus.ABORTED):
            if trajectory.cause is TrialCause.CANCELLED or cancel_event.is_set():
                outcome.update(fate=TrialFate.CANCELLED, detail=trajectory.detail)
            else:
                cause = _FROM_TRIAL_CAUSE.get(trajectory.cause, FailureCause.HARNESS_ERROR)
                outcome.update(fate=TrialFate.FAILED, cause=cause, detail=trajectory.detail)
            return
        if cancel_event.is_set():  # the agent finished, but nobody wants the result any more
            outcome.update(fate=TrialFate.CANCELLED, detail="cancelled before verification")
            return
        started = time.monotonic()
        if spec.task.steps:  # the harness verified each step at its boundary (its docstring)
            report, failure = trajectory.verifier_report, _step_failure(trajectory)
            phases["verify"] = trajectory.verify_sec
            phases["agent"] = max(phases["agent"] - trajectory.verify_sec, 0.0)
        else:
            report, failure = self._verify(sandbox)
            phases["verify"] = time.monotonic() - started
        trajectory = dataclasses.replace(trajectory, verifier_report=report, verify_sec=phases["verify"])
        outcome["trajectory"] = trajectory
        if failure is not None:
            if cancel_event.is_set():  # the cancel closed the sandbox under the verifier
                outcome.update(fate=TrialFate.CANCELLED, detail="cancelled during verification")
            else:
                outcome.update(fate=TrialFate.FAILED, cause=failure, detail=report.detail)
            return
        reward = compute_reward(report, self.reward)
        outcome["reward"] = reward
        if self.assemble:
            try:
                older = "mask" if carried is not None else "refuse"
                outcome["assembly"] = assemble_trajectory(
                    trajectory, reward.reward, self.tokenizer, older_versions=older
                )
            except Exception as error:  # RoutingMissingError, MixedPolicyVersions, TitoDriftError, ...
                outcome.update(
                    fate=TrialFate.FAILED,
                    cause=FailureCause.ASSEMBLY,
                    detail=f"{type(error).__name__}: {error}",
                )
                return
        outcome["fate"] = TrialFate.COMPLETED

    @staticmethod
    def _verify(sandbox: Sandbox) -> tuple[VerifierReport, FailureCause | None]:
        """The verifier's report, and the infrastructure failure that spoiled it (None: the report
        stands, whatever it says about the agent's work)."""
        try:
            report = sandbox.verify()
        except SandboxDeadlineExpired as error:
            cause = FailureCause.TOTAL_DEADLINE if error.deadline == "total" else FailureCause.VERIFY_ERROR
            return _unparsed(f"verify raised {type(error).__name__}: {error}"), cause
        except Exception as error:
            return _unparsed(f"verify raised {type(error).__name__}: {error}"), FailureCause.VERIFY_ERROR
        if report.failure_cause is VerifierFailure.SANDBOX_ERROR:
            return report, FailureCause.VERIFY_ERROR
        return report, None

    @staticmethod
    def _close(sandbox: Sandbox | None, phases: dict[str, float]) -> str:
        if sandbox is None:
            return ""
        started = time.monotonic()
        try:
            sandbox.close()
            return ""
        except Exception as error:  # admission control still released the slot; leak_check reaps it
            return f"{type(error).__name__}: {error}"
        finally:
            phases["close"] = time.monotonic() - started


def _step_failure(trajectory: Trajectory) -> FailureCause | None:
    """The infrastructure failure that spoiled a multi-step trial's verification, if any."""
    return next((FailureCause(step.failure) for step in trajectory.step_reports if step.failure), None)


def _unparsed(detail: str) -> VerifierReport:
    return VerifierReport(
        assertions=(),
        parsed=False,
        failure_cause=VerifierFailure.SANDBOX_ERROR,
        binary_outcome=None,
        detail=detail,
    )


# Interpreter exit (an uncaught exception in the controller, sys.exit) still closes every sandbox.
_LIVE_SCHEDULERS: weakref.WeakSet[TrialScheduler] = weakref.WeakSet()


@atexit.register
def _close_live_schedulers() -> None:
    for scheduler in list(_LIVE_SCHEDULERS):
        scheduler.close(wait_sec=30.0)
