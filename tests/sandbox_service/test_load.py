"""A bounded load test of the service on the container backend: 64 concurrent trials (create, the
solution's command, verify, close) through a real uvicorn server on loopback with a bearer token,
real podman containers behind it. Every trial's result comes back (none lost), every verdict is the
right one (half solve the task, half do nothing), and no container of the run is left.

Behind the `containers` and `slow` markers (`make test-containers`): a few minutes on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from service_helpers import new_run_id
from task_factory import write_hello_task

from sandbox_service.access import AccessPolicy
from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.backends.podman import LABEL_RUN, PodmanBackend, PodmanConfig, PodmanEngine
from sandbox_service.base_images import DEFAULT_STAND_IN_DIR
from sandbox_service.client import SandboxServiceClient
from sandbox_service.server import ServiceThread, TaskStore, create_app

pytestmark = [pytest.mark.sandbox, pytest.mark.containers, pytest.mark.slow]

TRIALS = 64
LIVE = 16  # containers at once (admission control queues the rest)
TOKEN = "load-test-token-0123456789abcdef"


def test_64_concurrent_trials_through_the_service_lose_nothing_and_leak_nothing(tmp_path, toolchain_dir):
    task = write_hello_task(tmp_path, docker_image="python:3.11-slim")
    podman = PodmanBackend(PodmanConfig(cache_dir=tmp_path / "cache", toolchain_dir=toolchain_dir,
                                        stand_in_dir=DEFAULT_STAND_IN_DIR, pull="never"))  # fmt: skip
    config = AdmissionConfig(create_rate_per_sec=None, max_live_sandboxes=LIVE, reaper_interval_sec=0.5)
    controller = AdmissionController(podman, config)
    app = create_app(controller, TaskStore(tmp_path / "store"), backend_name="container",
                     access=AccessPolicy(TOKEN))  # fmt: skip
    thread = ServiceThread(app).start()
    client = SandboxServiceClient(thread.url, token=TOKEN, timeout_margin_sec=120)
    run_id = new_run_id()

    def trial(number: int) -> tuple[int, int, int]:
        sandbox = client.create(task, run_id=run_id)
        try:
            if number % 2 == 0:
                assert sandbox.exec("echo -n 'Hello, world!' > /app/hello.txt", 120).exit_code == 0
            report = sandbox.verify()
            return number, report.passed, report.total
        finally:
            sandbox.close()

    started = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(TRIALS) as pool:
            results = list(pool.map(trial, range(TRIALS), timeout=1500))
        seconds = time.monotonic() - started
        leaks = client.leak_check(run_id)
    finally:
        client.close()
        thread.stop()
        podman.close()
    assert sorted(number for number, _, _ in results) == list(range(TRIALS))  # no result lost
    assert all(
        (passed, total) == ((2, 2) if number % 2 == 0 else (0, 2)) for number, passed, total in results
    )
    assert not leaks.leaked
    left = PodmanEngine().text(
        "ps", "-a", "--filter", f"label={LABEL_RUN}={run_id}", "--format", "{{.Names}}"
    )
    assert left == "", f"containers of the run left behind: {left}"
    print(f"{TRIALS} trials, {LIVE} live at once, in {seconds:.0f} s")
