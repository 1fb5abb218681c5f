"""Modal backend: the calls it makes on the `modal` module, and its scripts running for real.

Modal needs credentials and network, so `FakeModal` (fake_clusters.py) stands in for the module at
its API boundary and runs each sandbox as a bubblewrap container. The one test that uses the real
`modal` package checks what happens without credentials: `AuthError`, reported clearly.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("modal")  # the `modal` extra (installed by `make setup`)

from fake_clusters import FakeModal, wait_until  # noqa: E402
from task_factory import with_limits, write_hello_task  # noqa: E402

from sandbox_service.backends.modal import ModalBackend, ModalConfig  # noqa: E402
from sandbox_service.contracts import FailureCause  # noqa: E402
from sandbox_service.errors import BackendError  # noqa: E402

pytestmark = pytest.mark.sandbox


@pytest.fixture
def fake_modal():
    modal = FakeModal()
    yield modal
    modal.shutdown()


@pytest.fixture
def config(toolchain_dir):
    return ModalConfig(app_name="t1jax-test", toolchain_dir=toolchain_dir)


def test_create_passes_image_resources_network_lifetime_and_tags(fake_modal, config, tmp_path):
    task = write_hello_task(tmp_path, env={"GREETING": "hi"})
    backend = ModalBackend(dataclasses.replace(config, deadline_margin_sec=60), modal_module=fake_modal)
    sandbox = backend.create(task, run_id="run-7")
    try:
        result = sandbox.exec("echo $GREETING from $(pwd); ls -d /logs/verifier", 30)
        assert (result.stdout, result.exit_code) == ("hi from /app\n/logs/verifier\n", 0)
    finally:
        sandbox.close()
    sandbox.close()

    assert fake_modal.names() == [
        "App.lookup",
        "Image.from_registry",
        "Sandbox.create",
        "Sandbox.exec",  # prepare: /logs directories
        "Sandbox.exec",  # the command
        "Sandbox.terminate",  # once, although close() ran twice
    ]
    lookup, image, create = fake_modal.calls[:3]
    assert lookup.args == ("t1jax-test",) and lookup.kwargs["create_if_missing"] is True
    assert image.args == ("ubuntu:24.04",)
    assert create.args == ("/bin/sh", "-c", "while :; do sleep 86400; done")
    assert create.kwargs["image"] == ("registry-image", "ubuntu:24.04")
    assert create.kwargs["timeout"] == int(task.limits.total_timeout_sec + 60)
    assert create.kwargs["block_network"] is True
    assert (create.kwargs["cpu"], create.kwargs["memory"], create.kwargs["workdir"]) == (1.0, 2048, "/app")
    assert create.kwargs["env"] == {"GREETING": "hi"}
    assert create.kwargs["tags"] == {
        "t1jax.run-id": "run-7",
        "t1jax.sandbox-id": sandbox.sandbox_id,
        "t1jax.task-id": "t1jax/hello",
    }
    exec_call = fake_modal.calls[4]
    assert exec_call.args[:2] == ("bash", "-c") and exec_call.kwargs["text"] is False
    assert fake_modal.live_containers() == 0


def test_dockerfile_task_is_built_by_modal(fake_modal, config, tmp_path):
    task = write_hello_task(tmp_path, docker_image=None)
    backend = ModalBackend(config, modal_module=fake_modal)
    backend.create(task).close()
    (image_call,) = [call for call in fake_modal.calls if call.name.startswith("Image.")]
    assert image_call.name == "Image.from_dockerfile"
    assert image_call.args == (str(task.environment.context_dir / "Dockerfile"),)
    assert image_call.kwargs == {"context_dir": str(task.environment.context_dir)}


def test_exec_timeout_and_reap_by_run_tag(fake_modal, config, tmp_path):
    task = write_hello_task(tmp_path)
    backend = ModalBackend(config, modal_module=fake_modal)
    mine = [backend.create(task, run_id="run-A") for _ in range(2)]
    other = backend.create(task, run_id="run-B")
    try:
        slow = mine[0].exec("sleep 1234; echo never", 1.0)
        assert slow.timed_out and slow.exit_code is None and slow.stdout == ""
        assert sorted(backend.live_sandboxes("run-A")) == sorted(s.sandbox_id for s in mine)
        assert sorted(backend.reap("run-A")) == sorted(s.sandbox_id for s in mine)
        assert backend.live_sandboxes("run-A") == [] and backend.live_sandboxes("run-B") == [other.sandbox_id]
    finally:
        other.close()
    assert fake_modal.live_containers() == 0


def test_modal_lifetime_ends_a_sandbox_nobody_closed(fake_modal, config, tmp_path):
    task = with_limits(write_hello_task(tmp_path), 1, 1, 1)
    backend = ModalBackend(dataclasses.replace(config, deadline_margin_sec=0.0), modal_module=fake_modal)
    backend.create(task, run_id="crashed")
    assert wait_until(lambda: backend.live_sandboxes("crashed") == [], timeout=30)


def test_verify_runs_the_task_verifier_in_the_modal_sandbox(fake_modal, config, tmp_path):
    task = write_hello_task(tmp_path)
    backend = ModalBackend(config, modal_module=fake_modal)
    sandbox = backend.create(task, run_id="run-1")
    try:
        sandbox.exec("printf 'Hello, world!' > /app/hello.txt", 30)
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert report.parsed and report.failure_cause is FailureCause.NONE, report.detail
    assert [(a.name, a.passed) for a in report.assertions] == [
        ("test_file_exists", True),
        ("test_file_content", True),
    ]
    assert report.binary_outcome is True


def test_without_credentials_create_reports_auth_error_clearly(fake_modal, config, tmp_path):
    fake_modal.authenticated = False
    with pytest.raises(BackendError, match="no Modal credentials: run `modal token new`"):
        ModalBackend(config, modal_module=fake_modal).create(write_hello_task(tmp_path))


def test_real_modal_package_without_credentials_raises_auth_error(tmp_path, monkeypatch, config):
    """The only call into the real `modal` package: offline, with no token, App.lookup fails
    before any network traffic, and the backend names the fix."""
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "no-modal.toml"))
    with pytest.raises(BackendError, match="no Modal credentials") as raised:
        ModalBackend(config).create(write_hello_task(tmp_path))
    assert type(raised.value.__cause__).__name__ == "AuthError"
