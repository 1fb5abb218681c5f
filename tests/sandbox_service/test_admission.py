"""AdmissionController on real sandboxes: pacing, the concurrency cap, layered deadlines,
cancellation at every stage, watchdogs and leak checks.

Deadlines here are a few seconds; assertions are about outcomes and order, never tight timings.
"""

from __future__ import annotations

import threading
import time

import pytest
from service_helpers import SlowCreate, new_run_id
from task_factory import with_limits, write_hello_task

from sandbox_service.admission import AdmissionConfig, AdmissionController, TrialState
from sandbox_service.contracts import FailureCause, Sandbox, SandboxProvider, UnsupportedEnvironment
from sandbox_service.errors import (
    AdmissionTimeout,
    DeadlineExceeded,
    SandboxClosed,
    SandboxStateError,
    TrialCancelled,
    UnknownSandbox,
    UnsupportedTaskEnvironment,
)

pytestmark = pytest.mark.sandbox


def controller_for(provider, **overrides) -> AdmissionController:
    settings = dict(create_rate_per_sec=None, max_live_sandboxes=8, reaper_interval_sec=0.1)
    settings.update(overrides)
    return AdmissionController(provider, AdmissionConfig(**settings))


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread; returns (thread, outcome) where outcome gets 'value' or 'error'."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def test_creation_is_paced_by_the_token_bucket(backend, hello_task):
    run_id = new_run_id()
    with controller_for(backend, create_rate_per_sec=4.0, create_burst=1) as controller:
        workers = [in_thread(controller.create, hello_task, run_id=run_id) for _ in range(4)]
        admitted = []
        for thread, outcome in workers:
            thread.join(60)
            sandbox = outcome["value"]
            infos = controller.trials(run_id)
            admitted.append(next(t.admitted_at for t in infos if t.sandbox_id == sandbox.sandbox_id))
            sandbox.close()
    gaps = [later - earlier for earlier, later in zip(sorted(admitted), sorted(admitted)[1:], strict=False)]
    assert all(gap >= 0.9 / 4.0 for gap in gaps), gaps  # never faster than the rate


def test_concurrency_cap_blocks_then_admits_when_a_slot_frees(backend, hello_task):
    run_id = new_run_id()
    with controller_for(backend, max_live_sandboxes=2) as controller:
        first = controller.create(hello_task, run_id=run_id)
        second = controller.create(hello_task, run_id=run_id)
        with pytest.raises(AdmissionTimeout, match="2 live sandboxes is this node's cap"):
            controller.create(hello_task, run_id=run_id, admission_timeout_sec=0.3)
        waiter, outcome = in_thread(controller.create, hello_task, run_id=run_id)
        time.sleep(0.3)
        assert waiter.is_alive() and controller.live_count() == 2
        first.close()
        waiter.join(60)
        third = outcome["value"]
        assert third.exec("echo admitted", 30).stdout == "admitted\n"
        assert controller.live_count() == 2
        second.close()
        third.close()
        assert controller.live_count() == 0


def test_agent_deadline_clamps_exec_then_refuses_it_but_verify_still_runs(backend, hello_task):
    task = with_limits(hello_task, agent=2.0, verifier=60.0, total=120.0)
    with controller_for(backend) as controller:
        sandbox = controller.create(task, run_id=new_run_id())
        assert sandbox.limits.agent_timeout_sec == 2.0
        clamped = sandbox.exec("sleep 60; echo never", 600)
        assert clamped.timed_out and clamped.exit_code is None  # killed at the agent deadline, not at 600 s
        with pytest.raises(DeadlineExceeded, match="agent deadline of 2s has passed") as raised:
            sandbox.exec("true", 10)
        assert raised.value.deadline == "agent"
        with pytest.raises(DeadlineExceeded):
            sandbox.send_keys("ls\n", 0.1)
        report = sandbox.verify()  # Harbor semantics: the verifier runs after an agent timeout
        assert report.parsed and report.total == 2 and report.passed == 0
        sandbox.close()


def test_total_deadline_reclaims_the_sandbox(backend, hello_task):
    run_id = new_run_id()
    task = with_limits(hello_task, agent=60.0, verifier=60.0, total=2.0)
    with controller_for(backend) as controller:
        sandbox = controller.create(task, run_id=run_id)
        assert sandbox.limits.agent_timeout_sec == 2.0  # the agent layer never outlives the total
        deadline = time.monotonic() + 30
        while backend.live_sandboxes(run_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert backend.live_sandboxes(run_id) == []
        assert sandbox.state is TrialState.CLOSED
        with pytest.raises(DeadlineExceeded) as raised:
            sandbox.exec("true", 10)
        assert raised.value.deadline == "total"
        with pytest.raises(DeadlineExceeded, match="total deadline"):
            sandbox.verify()
        sandbox.close()  # still idempotent
        assert controller.stats()["expired"] == 1


def test_total_deadline_during_verification_is_a_verifier_timeout(backend, tmp_path):
    task = write_hello_task(tmp_path, test_script="#!/bin/bash\nsleep 600\n")
    task = with_limits(task, agent=60.0, verifier=600.0, total=3.0)
    with controller_for(backend) as controller:
        sandbox = controller.create(task, run_id=new_run_id())
        report = sandbox.verify()
        assert not report.parsed and report.failure_cause is FailureCause.VERIFIER_TIMEOUT
        assert "total deadline" in report.detail
        sandbox.close()


def test_cancel_while_waiting_for_admission(backend, hello_task):
    run_id = new_run_id()
    with controller_for(backend, max_live_sandboxes=1) as controller:
        holder = controller.create(hello_task, run_id=run_id)
        waiter, outcome = in_thread(controller.create, hello_task, run_id=run_id, trial_id="queued")
        time.sleep(0.2)
        assert controller.cancel("queued") is True
        waiter.join(30)
        assert isinstance(outcome["error"], TrialCancelled)
        assert controller.cancel("queued") is False  # already closed: a no-op
        holder.close()
        assert controller.live_count() == 0
    assert backend.live_sandboxes(run_id) == []


def test_cancel_while_the_backend_is_creating(backend, hello_task):
    run_id = new_run_id()
    slow = SlowCreate(backend, delay_sec=1.0)
    with controller_for(slow) as controller:
        creator, outcome = in_thread(controller.create, hello_task, run_id=run_id, trial_id="in-flight")
        assert slow.entered.wait(30)
        assert controller.cancel("in-flight") is True
        creator.join(60)
        assert isinstance(outcome["error"], TrialCancelled)
        assert controller.live_count() == 0
    assert backend.live_sandboxes(run_id) == []  # the sandbox that arrived late was closed at once


def test_cancel_during_exec_interrupts_it_and_reclaims(backend, hello_task):
    run_id = new_run_id()
    with controller_for(backend) as controller:
        sandbox = controller.create(hello_task, run_id=run_id)
        worker, outcome = in_thread(sandbox.exec, "sleep 600", 600)
        time.sleep(0.5)
        assert controller.cancel(sandbox.sandbox_id) is True
        worker.join(60)
        assert not worker.is_alive() and isinstance(outcome["error"], TrialCancelled)
        assert backend.live_sandboxes(run_id) == []
        with pytest.raises(TrialCancelled):
            sandbox.exec("true", 5)
        with pytest.raises(UnknownSandbox):
            controller.cancel("never-existed")


def test_lifecycle_misuse_raises_state_errors(backend, hello_task):
    with controller_for(backend) as controller:
        assert isinstance(controller, SandboxProvider)
        sandbox = controller.create(hello_task, run_id=new_run_id())
        assert isinstance(sandbox, Sandbox)
        assert sandbox.exec("printf 'Hello, world!' > /app/hello.txt", 30).exit_code == 0
        report = sandbox.verify()
        assert (report.parsed, report.passed, report.total, report.binary_outcome) == (True, 2, 2, True)
        with pytest.raises(SandboxStateError, match="verify\\(\\) already ran"):
            sandbox.exec("true", 5)
        with pytest.raises(SandboxStateError, match="already called"):
            sandbox.verify()
        sandbox.close()
        with pytest.raises(SandboxClosed, match="closed by its owner"):
            sandbox.exec("true", 5)


def test_watchdog_closes_a_sandbox_whose_backend_call_overruns(backend, hello_task):
    """A backend that ignores the timeout it was given must not wedge the trial."""

    class IgnoresTimeouts:
        def __init__(self, inner):
            self.inner = inner

        def create(self, task, *, run_id="default"):
            real = self.inner.create(task, run_id=run_id)
            real_exec = real.exec
            real.exec = lambda command, timeout_sec: real_exec(command, 600)  # the bug
            return real

        def live_sandboxes(self, run_id=None):
            return self.inner.live_sandboxes(run_id)

        def reap(self, run_id=None):
            return self.inner.reap(run_id)

    run_id = new_run_id()
    with controller_for(IgnoresTimeouts(backend), call_grace_sec=1.0) as controller:
        sandbox = controller.create(hello_task, run_id=run_id)
        with pytest.raises(SandboxClosed, match="overran its timeout plus grace"):
            sandbox.exec("sleep 600", 1.0)
    assert backend.live_sandboxes(run_id) == []


def test_leak_check_closes_forgotten_trials_and_kills_orphans(backend, hello_task):
    run_id = new_run_id()
    with controller_for(backend) as controller:
        closed = controller.create(hello_task, run_id=run_id)
        forgotten = controller.create(hello_task, run_id=run_id)
        closed.close()
        orphan = backend.create(hello_task, run_id=run_id)  # e.g. left by a crashed controller
        report = controller.leak_check(run_id)
        assert report.unclosed_trials == (forgotten.trial_id,)
        assert report.orphaned_sandboxes == (orphan.sandbox_id,)
        assert report.remaining == () and report.leaked
        assert backend.live_sandboxes(run_id) == []
        clean = controller.leak_check(run_id)
        assert not clean.leaked


def test_shutdown_closes_open_and_waiting_trials(backend, hello_task):
    run_id = new_run_id()
    controller = controller_for(backend, max_live_sandboxes=1)
    controller.create(hello_task, run_id=run_id)
    waiter, outcome = in_thread(controller.create, hello_task, run_id=run_id)
    time.sleep(0.2)
    controller.shutdown()
    waiter.join(30)
    assert isinstance(outcome["error"], TrialCancelled)
    assert backend.live_sandboxes(run_id) == []
    with pytest.raises(SandboxClosed, match="shut down"):
        controller.create(hello_task, run_id=run_id)


def test_backend_failure_releases_the_slot(backend, tmp_path):
    unsupported = write_hello_task(tmp_path, docker_image="alpine:3.19")  # outside the local subset
    with controller_for(backend, max_live_sandboxes=1) as controller:
        for _ in range(3):  # would block on the second try if the slot leaked
            with pytest.raises(UnsupportedTaskEnvironment, match="alpine") as raised:
                controller.create(unsupported, run_id=new_run_id())
            assert isinstance(raised.value, UnsupportedEnvironment)  # still the contract's error
        assert controller.live_count() == 0 and controller.stats()["create_failed"] == 3
