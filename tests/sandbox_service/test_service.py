"""The HTTP service end to end: a real uvicorn server on localhost, the real client, real sandboxes.

Covers the Sandbox contract over HTTP, error mapping (status codes and exception classes), task
upload by content digest, run teardown, client disconnects, shutdown reclamation, a non-blocking
event loop, and 32 concurrent sandboxes with zero leaks.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import time

import httpx
import pytest
from service_helpers import SlowCreate, new_run_id
from task_factory import with_limits, write_hello_task

from sandbox_service import wire
from sandbox_service.access import RUN_HEADER
from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.client import SandboxServiceClient
from sandbox_service.contracts import FailureCause, Sandbox, SandboxProvider, UnsupportedEnvironment
from sandbox_service.errors import (
    BadRequest,
    DeadlineExceeded,
    SandboxClosed,
    ServiceUnavailable,
    TrialCancelled,
    UnknownSandbox,
    UnsupportedTaskEnvironment,
)
from sandbox_service.server import ServiceThread, TaskStore, create_app

pytestmark = pytest.mark.sandbox


class Service:
    """A running service around `provider`, plus a client for it."""

    def __init__(self, provider, store_dir, **config):
        settings = dict(create_rate_per_sec=None, max_live_sandboxes=40, reaper_interval_sec=0.1)
        settings.update(config)
        self.controller = AdmissionController(provider, AdmissionConfig(**settings))
        self.store = TaskStore(store_dir)
        self.thread = ServiceThread(create_app(self.controller, self.store, backend_name="test")).start()
        self.client = SandboxServiceClient(self.thread.url, timeout_margin_sec=30)

    def stop(self) -> None:
        self.client.close()
        self.thread.stop()


@pytest.fixture
def service(backend, tmp_path):
    running = Service(backend, tmp_path / "store")
    yield running
    running.stop()


def test_remote_sandbox_lifecycle_uploads_the_task_once(service, hello_task):
    run_id = new_run_id()
    assert isinstance(service.client, SandboxProvider)
    sandbox = service.client.create(hello_task, run_id=run_id)
    assert isinstance(sandbox, Sandbox) and sandbox.task is hello_task
    result = sandbox.exec("printf 'Hello, world!' > hello.txt && echo done; echo warn >&2", 30)
    assert (result.stdout, result.stderr, result.exit_code) == (
        "done\n",
        "warn\n",
        0,
    ) and not result.timed_out
    screen = sandbox.send_keys("cat /app/hello.txt; echo\n", 1.0)
    assert "Hello, world!" in screen.text
    report = sandbox.verify()
    assert report.parsed and report.failure_cause is FailureCause.NONE
    assert [(a.name, a.passed) for a in report.assertions] == [
        ("test_file_exists", True),
        ("test_file_content", True),
    ]
    assert report.binary_outcome is True and report.reward_value == 1.0
    carried = dataclasses.replace(
        report, output_tail="=== 2 passed ==="
    )  # the verifier's console travels too
    assert wire.verifier_report_from_json(wire.verifier_report_to_json(carried)) == carried
    sandbox.close()
    sandbox.close()

    # How the service's backend runs the task, asked over HTTP: the same answer as in-process.
    audit = service.client.environment_audit(hello_task)
    assert audit == service.controller.environment_audit(hello_task)
    assert audit.backend == "local" and audit.runnable and not audit.faithful
    assert audit.substitutions[0].requested == "ubuntu:24.04" and "Ubuntu" in " ".join(
        audit.substitutions[0].differences
    )

    again = service.client.create(hello_task, run_id=run_id)
    again.close()
    stored = [path.name for path in service.store.root.iterdir()]
    assert stored == [wire.task_digest(hello_task.source_dir)]  # one upload, reused


def test_errors_come_back_as_the_same_exceptions_with_the_server_message(service, hello_task):
    client = service.client
    run_id = new_run_id()
    with pytest.raises(UnknownSandbox, match="no sandbox or trial with id 'nope'"):
        client._request(
            "POST", "/sandboxes/nope/exec", json={"command": "true", "timeout_sec": 1}, run_id=run_id
        )
    task = with_limits(hello_task, agent=1.0, verifier=60.0, total=120.0)
    sandbox = client.create(task, run_id=run_id)
    with pytest.raises(BadRequest, match="exec timeout_sec must be positive"):
        sandbox.exec("true", -1)
    with pytest.raises(BadRequest, match="field 'command' must be a string"):
        client._request(
            "POST", f"/sandboxes/{sandbox.sandbox_id}/exec", json={"timeout_sec": 1}, run_id=run_id
        )
    time.sleep(1.2)
    with pytest.raises(DeadlineExceeded, match="agent deadline") as raised:
        sandbox.exec("true", 5)
    assert raised.value.deadline == "agent"
    sandbox.close()
    with pytest.raises(SandboxClosed, match="closed by its owner"):
        sandbox.exec("true", 5)

    exec_url = f"{service.thread.url}/v1/sandboxes/{sandbox.sandbox_id}/exec"
    raw = httpx.post(exec_url, json={"command": "true", "timeout_sec": 1}, headers={RUN_HEADER: run_id})
    assert raw.status_code == 410 and raw.json()["error"] == "sandbox_closed"
    raw = httpx.post(f"{service.thread.url}/v1/sandboxes", content=b"{not json")
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["message"]
    raw = httpx.get(f"{service.thread.url}/v1/no-such-route")
    assert raw.status_code == 404 and raw.json()["error"] == "not_found"


def test_unsupported_environment_comes_back_as_the_contract_error(service, tmp_path):
    alpine = write_hello_task(tmp_path / "alpine", docker_image="alpine:3.19")
    with pytest.raises(UnsupportedTaskEnvironment, match="alpine") as raised:
        service.client.create(alpine, run_id=new_run_id())
    assert isinstance(raised.value, UnsupportedEnvironment) and raised.value.task_id == alpine.task_id
    assert service.controller.live_count() == 0


def test_upload_with_a_wrong_digest_is_refused(service, hello_task):
    wrong = "0" * 64
    tarball = wire.pack_task_dir(hello_task.source_dir)
    raw = httpx.put(f"{service.thread.url}/v1/tasks/{wrong}", content=tarball)
    assert raw.status_code == 400 and "hashes to" in raw.json()["message"]
    assert not service.store.has(wrong)
    raw = httpx.put(f"{service.thread.url}/v1/tasks/../../etc", content=b"")
    assert raw.status_code in (400, 404)


def test_32_concurrent_sandboxes_leave_zero_leaks(service, backend, hello_task):
    run_id = new_run_id()

    def trial(index: int) -> tuple[str, bool]:
        with service.client.create(hello_task, run_id=run_id) as sandbox:
            out = sandbox.exec(f"echo trial-{index}; sleep 0.2", 60)
            if index % 2 == 0:
                sandbox.exec("printf 'Hello, world!' > /app/hello.txt", 60)
            return out.stdout, sandbox.verify().binary_outcome

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(trial, range(32)))
    assert [stdout for stdout, _ in results] == [f"trial-{i}\n" for i in range(32)]
    assert [solved for _, solved in results] == [i % 2 == 0 for i in range(32)]
    assert service.controller.stats()["created"] == 32
    report = service.client.leak_check(run_id)
    assert not report.leaked, report
    assert backend.live_sandboxes(run_id) == []
    assert service.controller.live_count() == 0


def test_delete_run_reclaims_every_sandbox_of_the_run(service, backend, hello_task):
    run_id, other_run = new_run_id(), new_run_id()
    doomed = [service.client.create(hello_task, run_id=run_id) for _ in range(3)]
    survivor = service.client.create(hello_task, run_id=other_run)
    cancelled, report = service.client.reclaim_run(run_id)
    assert sorted(cancelled) == sorted(s.trial_id for s in doomed) and not report.remaining
    assert backend.live_sandboxes(run_id) == []
    with pytest.raises(TrialCancelled):
        doomed[0].exec("true", 5)
    assert survivor.exec("echo alive", 10).stdout == "alive\n"
    survivor.close()


def test_cancel_by_trial_id_while_create_waits(backend, hello_task, tmp_path):
    service = Service(SlowCreate(backend, delay_sec=1.5), tmp_path / "store")
    run_id = new_run_id()
    try:
        outcome = {}

        def create() -> None:
            try:
                outcome["value"] = service.client.create(hello_task, run_id=run_id, trial_id="trial-x")
            except Exception as error:  # noqa: BLE001 - inspected below
                outcome["error"] = error

        creator = threading.Thread(target=create)
        creator.start()
        time.sleep(0.5)
        assert service.client.cancel("trial-x") is True
        creator.join(60)
        assert isinstance(outcome.get("error"), TrialCancelled)
        assert backend.live_sandboxes(run_id) == []
    finally:
        service.stop()


def test_a_client_that_disconnects_during_create_leaves_nothing_behind(backend, hello_task, tmp_path):
    service = Service(SlowCreate(backend, delay_sec=1.5), tmp_path / "store")
    run_id = new_run_id()
    try:
        digest = service.client.upload_task(hello_task)
        body = {"task_digest": digest, "task": wire.task_to_json(hello_task), "run_id": run_id}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{service.thread.url}/v1/sandboxes", json=body, timeout=0.5)
        deadline = time.monotonic() + 30
        while service.controller.stats()["created"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        while service.controller.live_count() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service.controller.stats()["created"] == 1 and service.controller.live_count() == 0
        assert backend.live_sandboxes(run_id) == []
        assert service.client.health()["status"] == "ok"  # and the server is still serving
    finally:
        service.stop()


def test_long_exec_does_not_block_other_requests(service, hello_task):
    sandbox = service.client.create(hello_task, run_id=new_run_id())
    order = []
    slow = threading.Thread(target=lambda: (sandbox.exec("sleep 3", 30), order.append("exec")))
    slow.start()
    time.sleep(0.5)
    assert service.client.health()["stats"]["live"] == 1
    order.append("health")
    slow.join(60)
    assert order == ["health", "exec"]
    sandbox.close()


def test_shutdown_reclaims_open_sandboxes(backend, hello_task, tmp_path):
    service = Service(backend, tmp_path / "store")
    run_id = new_run_id()
    for _ in range(3):
        service.client.create(hello_task, run_id=run_id)
    assert len(backend.live_sandboxes(run_id)) == 3
    service.stop()
    assert backend.live_sandboxes(run_id) == []
    with pytest.raises(ServiceUnavailable, match="cannot reach the sandbox service"):
        SandboxServiceClient(service.thread.url, connect_timeout_sec=2).health()


def test_list_sandboxes_shows_open_trials(service, hello_task):
    run_id = new_run_id()
    sandbox = service.client.create(hello_task, run_id=run_id)
    (listed,) = service.client.trials(run_id)
    assert listed["sandbox_id"] == sandbox.sandbox_id and listed["state"] == "ready"
    assert listed["limits"] == json.loads(json.dumps(wire.limits_to_json(sandbox.limits)))
    sandbox.close()
    assert service.client.trials(run_id) == []
