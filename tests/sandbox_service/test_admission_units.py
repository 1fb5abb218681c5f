"""Admission building blocks with no sandbox: token bucket pacing (on a fake clock), the
concurrency limiter, deadline capping, the wire codecs and the error vocabulary."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from task_factory import write_hello_task

from sandbox_service import wire
from sandbox_service.admission import AdmissionConfig, ConcurrencyLimiter, TokenBucket
from sandbox_service.contracts import (
    AssertionResult,
    ExecResult,
    FailureCause,
    SandboxDeadlineExpired,
    SandboxLifecycleError,
    TaskLimits,
    TerminalRead,
    UnsupportedEnvironment,
    VerifierReport,
)
from sandbox_service.errors import (
    BackendError,
    BadRequest,
    DeadlineExceeded,
    SandboxServiceError,
    SandboxStateError,
    TrialCancelled,
    UnknownSandbox,
    UnsupportedTaskEnvironment,
    error_from_json,
    error_to_json,
    translate,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Sleeping advances the fake clock; returns whether the (cancel) event is set."""
        self.now += max(0.0, seconds)
        return event.is_set()


def test_token_bucket_allows_a_burst_then_paces_at_the_rate():
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock, wait=clock.wait)
    granted_at = []
    for _ in range(7):
        assert bucket.acquire()
        granted_at.append(clock.now)
    assert granted_at == [0.0, 0.0, 0.0, 0.5, 1.0, 1.5, 2.0]
    clock.now += 10.0  # idle time refills up to the burst, never beyond
    for _ in range(3):
        assert bucket.acquire()
    assert clock.now == 12.0
    assert bucket.acquire() and clock.now == 12.5


def test_token_bucket_timeout_and_cancellation_consume_no_token():
    clock = FakeClock()
    bucket = TokenBucket(rate=1.0, burst=1, clock=clock, wait=clock.wait)
    assert bucket.acquire()
    assert not bucket.acquire(timeout=0.5)  # would need 1 s
    assert clock.now == 0.0
    cancelled = threading.Event()
    cancelled.set()
    assert not bucket.acquire(cancelled=cancelled)  # waited, was cancelled, gave the token back
    clock.now = 1.0  # the original token has matured again
    assert bucket.acquire(timeout=0.0)


def test_token_bucket_disabled_and_invalid():
    bucket = TokenBucket(rate=None)
    assert all(bucket.acquire() for _ in range(1000))
    with pytest.raises(ValueError, match="positive number or None"):
        TokenBucket(rate=0.0)
    with pytest.raises(ValueError, match="burst must be >= 1"):
        TokenBucket(rate=1.0, burst=0)


def test_token_bucket_paces_real_threads():
    """Eight threads on the real clock at 40/s, burst 1: the grants are spread over at least
    7/40 s (a lower bound only: the machine may be slower, never faster)."""
    bucket = TokenBucket(rate=40.0, burst=1)
    stamps: list[float] = []
    lock = threading.Lock()

    def take() -> None:
        assert bucket.acquire()
        with lock:
            stamps.append(time.monotonic())

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(stamps) - min(stamps) >= 0.9 * 7 / 40


def test_concurrency_limiter_caps_times_out_and_cancels():
    limiter = ConcurrencyLimiter(2)
    assert limiter.acquire() and limiter.acquire()
    assert not limiter.acquire(timeout=0.05)
    cancelled = threading.Event()
    threading.Timer(0.05, lambda: (cancelled.set(), limiter.wake_all())).start()
    assert not limiter.acquire(cancelled=cancelled)
    limiter.release()
    assert limiter.acquire(timeout=0.05) and limiter.in_use == 2
    limiter.release()
    limiter.release()
    with pytest.raises(RuntimeError, match="released more often"):
        limiter.release()


def test_effective_limits_are_capped_per_layer_and_by_the_total():
    config = AdmissionConfig()
    assert config.effective_limits(TaskLimits(360, 60, 900)) == TaskLimits(360, 60, 900)
    assert config.effective_limits(TaskLimits(10_000, 2_000, 20_000)) == TaskLimits(3600, 900, 5400)
    assert config.effective_limits(TaskLimits(500, 400, 300)) == TaskLimits(300, 300, 300)
    with pytest.raises(ValueError, match="max_live_sandboxes"):
        AdmissionConfig(max_live_sandboxes=0)


def test_task_json_round_trip_and_relocation(tmp_path):
    task = write_hello_task(tmp_path, docker_image=None, env={"A": "1"})
    encoded = wire.task_to_json(task)
    assert wire.task_from_json(encoded, task.source_dir) == task
    copy_root = tmp_path / "elsewhere"
    wire.unpack_task_dir(wire.pack_task_dir(task.source_dir), copy_root)
    moved = wire.task_from_json(encoded, copy_root)
    assert moved.tests_dir == copy_root / "tests"
    assert moved.environment.dockerfile == copy_root / "environment" / "Dockerfile"
    assert moved.test_script == Path("test.sh")
    assert wire.task_digest(copy_root) == wire.task_digest(task.source_dir)


def test_task_digest_follows_content_not_metadata(tmp_path):
    task = write_hello_task(tmp_path)
    before = wire.task_digest(task.source_dir)
    (task.tests_dir / "test.sh").touch()
    assert wire.task_digest(task.source_dir) == before
    (task.tests_dir / "test.sh").chmod(0o644)
    assert wire.task_digest(task.source_dir) != before
    assert wire.pack_task_dir(task.source_dir) == wire.pack_task_dir(task.source_dir)


def test_task_json_rejects_bad_input_naming_the_field(tmp_path):
    task = write_hello_task(tmp_path)
    good = wire.task_to_json(task)
    for mutate, message in [
        (lambda d: d.pop("limits"), "task.limits is missing"),
        (lambda d: d["limits"].update(agent_timeout_sec=-1), "agent_timeout_sec must be positive"),
        (lambda d: d.update(instruction="  "), "instruction is empty"),
        (lambda d: d.update(layout="docker"), "task.layout = 'docker' is not one of"),
        (lambda d: d.update(tests_dir={"task_relative": "../../etc"}), "escapes the task directory"),
        (lambda d: d.update(tests_dir={"task_relative": "nope"}), "tests directory .* is missing"),
        (lambda d: d["environment"].update(cpus="two"), "task.environment.cpus has type str"),
    ]:
        data = wire.task_to_json(task)
        mutate(data)
        with pytest.raises(BadRequest, match=message):
            wire.task_from_json(data, task.source_dir)
    assert wire.task_from_json(good, task.source_dir) == task


def test_result_codecs_round_trip():
    result = ExecResult("out", "err", None, True, 1.5, stdout_omitted_bytes=7)
    assert wire.exec_result_from_json(wire.exec_result_to_json(result)) == result
    read = TerminalRead("screen", omitted_bytes=3)
    assert wire.terminal_read_from_json(wire.terminal_read_to_json(read)) == read
    report = VerifierReport(
        (AssertionResult("a", True), AssertionResult("b", False)), True, FailureCause.NONE, False, 0.5, "note"
    )
    assert wire.verifier_report_from_json(wire.verifier_report_to_json(report)) == report


def test_errors_round_trip_through_json_and_stay_contract_errors():
    for error in [
        DeadlineExceeded("too late", "agent"),
        TrialCancelled("gone"),
        UnknownSandbox("no such id"),
        UnsupportedTaskEnvironment("t1jax/x", "FROM alpine is not supported"),
    ]:
        back = error_from_json(json.loads(json.dumps(error_to_json(error))))
        assert type(back) is type(error) and str(back) == str(error)
    back = error_from_json(error_to_json(DeadlineExceeded("too late", "agent")))
    assert isinstance(back, SandboxDeadlineExpired) and back.deadline == "agent"
    back = error_from_json(error_to_json(UnsupportedTaskEnvironment("t1jax/x", "why")))
    assert isinstance(back, UnsupportedEnvironment) and (back.task_id, back.reason) == ("t1jax/x", "why")
    assert isinstance(TrialCancelled("x"), SandboxLifecycleError)
    unknown = error_from_json({"error": "something_new", "message": "from a newer server"})
    assert type(unknown) is SandboxServiceError and str(unknown) == "from a newer server"


def test_backend_errors_keep_their_meaning_when_translated():
    deadline = translate(SandboxDeadlineExpired("agent time is up", "agent"), "exec")
    assert isinstance(deadline, DeadlineExceeded) and deadline.deadline == "agent"
    assert isinstance(translate(SandboxLifecycleError("closed"), "exec"), SandboxStateError)
    unsupported = translate(UnsupportedEnvironment("t", "FROM alpine"), "create")
    assert isinstance(unsupported, UnsupportedTaskEnvironment) and unsupported.reason == "FROM alpine"
    other = translate(OSError("disk full"), "create a sandbox")
    assert isinstance(other, BackendError) and str(other) == "create a sandbox failed: disk full"
