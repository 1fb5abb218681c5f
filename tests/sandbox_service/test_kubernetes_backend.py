"""Kubernetes backend: manifests are valid client models, the call sequence is right, and the bash
scripts it sends through pod exec really work.

No API server can run here, so the real `kubernetes` client talks to `FakeKubeApiServer` (its REST
transport and websocket connect are replaced; every model, URL and JSON body is the client's own),
and each Pod is a bubblewrap container entered with nsenter (see fake_clusters.py).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from pathlib import Path

import pytest

client = pytest.importorskip("kubernetes.client")  # the `k8s` extra (installed by `make setup`)

from fake_clusters import FakeKubeApiServer, wait_until  # noqa: E402
from task_factory import with_limits, write_hello_task  # noqa: E402

from sandbox_service.backends.kubernetes import (  # noqa: E402
    ISOLATION_POLICY_NAME,
    KubernetesBackend,
    KubernetesConfig,
    RegistryImages,
    label_value,
)
from sandbox_service.contracts import FailureCause  # noqa: E402
from sandbox_service.errors import BackendError, SandboxClosed, SandboxStateError  # noqa: E402
from sandbox_service.tasks import load_task  # noqa: E402

EXAMPLE_TASKS = Path(__file__).resolve().parents[1] / "data" / "tasks"

pytestmark = pytest.mark.sandbox

NAMESPACE = "t1jax-test"


@pytest.fixture
def kube(toolchain_dir):
    server = FakeKubeApiServer()
    core, networking, stream = server.kube_clients()
    backend = KubernetesBackend(
        KubernetesConfig(
            namespace=NAMESPACE,
            pod_ready_timeout_sec=20,
            poll_interval_sec=0.01,
            image_registry="registry.example/t1jax",
            toolchain_dir=toolchain_dir,
        ),
        core_api=core,
        networking_api=networking,
        stream_fn=stream,
    )
    yield server, backend
    server.shutdown()


def variant(backend: KubernetesBackend, **changes) -> KubernetesBackend:
    """The same backend (same fake cluster) with some config fields changed."""
    return KubernetesBackend(
        dataclasses.replace(backend.config, **changes),
        core_api=backend.core_api,
        networking_api=backend.networking_api,
        stream_fn=backend._stream,
    )


@pytest.fixture
def task(tmp_path):
    return write_hello_task(tmp_path, env={"GREETING": "hi there"})


def test_pod_manifest_is_a_valid_pod_with_run_labels_limits_and_no_token(kube, task):
    _, backend = kube
    pod = backend.pod_manifest(task, sandbox_id="t1jax-sbx-0123", run_id="run/step 7")
    assert isinstance(pod, client.V1Pod)
    body = client.ApiClient().sanitize_for_serialization(pod)
    assert client.V1Pod.from_dict(body) == pod  # the JSON is a faithful, loadable Pod
    meta, spec = body["metadata"], body["spec"]
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "t1jax-sandbox-service"
    assert meta["labels"]["t1jax.sandbox-id"] == "t1jax-sbx-0123"
    assert meta["labels"]["t1jax.run-id"] == label_value("run/step 7") != "run/step 7"
    assert meta["annotations"] == {"t1jax.run-id": "run/step 7", "t1jax.task-id": "t1jax/hello"}
    assert meta["labels"]["t1jax.network"] == "isolated"
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 0
    assert spec["activeDeadlineSeconds"] == int(task.limits.total_timeout_sec + 300)
    (container,) = spec["containers"]
    assert container["image"] == "ubuntu:24.04"
    assert container["workingDir"] == "/app"
    assert container["env"] == [{"name": "GREETING", "value": "hi there"}]
    expected = {"cpu": "1", "memory": "2048Mi", "ephemeral-storage": "10240Mi"}
    assert container["resources"] == {"limits": expected, "requests": expected}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_network_policy_denies_all_traffic_of_isolated_pods(kube):
    _, backend = kube
    body = client.ApiClient().sanitize_for_serialization(backend.network_policy_manifest())
    assert client.V1NetworkPolicy.from_dict(body).metadata.name == ISOLATION_POLICY_NAME
    assert body["spec"]["podSelector"] == {"matchLabels": {"t1jax.network": "isolated"}}
    assert body["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert body["spec"]["ingress"] == [] and body["spec"]["egress"] == []


def test_label_values_are_valid_deterministic_and_distinct():
    valid = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
    samples = ["run-1", "org/task name", "x" * 80, "-leading", "ünïcode", "", "a/b", "a-b"]
    values = [label_value(sample) for sample in samples]
    for value in values:
        assert len(value) <= 63 and valid.fullmatch(value), value
    assert label_value("run-1") == "run-1"
    assert values == [label_value(sample) for sample in samples]
    assert len(set(values)) == len(values)


def test_dockerfile_only_task_needs_a_registry_and_maps_to_a_content_tag(tmp_path):
    task = write_hello_task(tmp_path, docker_image=None)
    with pytest.raises(BackendError, match="has only a Dockerfile.*--image-registry"):
        RegistryImages(None).image_for(task)
    name = RegistryImages("registry.example/t1").image_for(task)
    assert re.fullmatch(r"registry\.example/t1/t1jax-task-t1jax-hello:[0-9a-f]{16}", name)
    (task.environment.context_dir / "Dockerfile").write_text("FROM ubuntu:24.04\nRUN true\n")
    assert RegistryImages("registry.example/t1").image_for(task) != name  # new context, new tag


def test_environment_audit_names_the_pulled_image_or_why_there_is_none(kube, task, tmp_path):
    _, backend = kube
    audit = backend.environment_audit(task)
    assert audit.runnable and audit.faithful and audit.image == task.environment.docker_image
    dockerfile_only = write_hello_task(tmp_path / "other", docker_image=None)
    assert backend.environment_audit(dockerfile_only).image == backend.images.image_for(dockerfile_only)
    backend.images = RegistryImages(None)  # a backend given no image registry cannot run it
    skipped = backend.environment_audit(dockerfile_only)
    assert skipped.skip_reason.value == "unsupported_image" and "--image-registry" in skipped.detail


def test_create_exec_close_call_sequence(kube, task):
    server, backend = kube
    sandbox = backend.create(task, run_id="run-1")
    result = sandbox.exec("echo $GREETING; pwd; echo oops >&2; exit 3", 30)
    sandbox.close()
    sandbox.close()  # idempotent

    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == (
        "hi there\n/app\n",
        "oops\n",
        3,
        False,
    )
    calls = [
        (r.method, r.path.rsplit("/", 1)[-1] if r.path.endswith("/exec") else r.path) for r in server.requests
    ]
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods/{sandbox.sandbox_id}"
    assert calls == [
        ("POST", f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies"),
        ("POST", f"/api/v1/namespaces/{NAMESPACE}/pods"),
        ("GET", pod_path),  # Pending
        ("GET", pod_path),  # Running
        ("GET", "exec"),  # prepare: /logs directories
        ("GET", "exec"),  # the command
        ("DELETE", pod_path),
    ]
    exec_request = server.requests[5]
    assert exec_request.query["container"] == ["sandbox"]
    assert exec_request.query["command"][:2] == ["bash", "-c"]
    assert exec_request.query["stdin"] == ["true"] and exec_request.query["tty"] == ["false"]
    delete = server.requests[-1].query
    assert delete["gracePeriodSeconds"] == ["0"] and delete["propagationPolicy"] == ["Background"]
    assert server.live_containers() == 0


def test_exec_timeout_kills_the_whole_process_group_and_keeps_head_and_tail(kube, task):
    _, backend = kube
    with_limit = variant(backend, output_limit_bytes=1000)
    sandbox = with_limit.create(task, run_id="run-1")
    try:
        slow = sandbox.exec("sleep 1234 & sleep 1234; echo never", 1.0)
        assert slow.timed_out and slow.exit_code is None and "never" not in slow.stdout
        survivors = sandbox.exec("ps -eo args | grep -c '^sleep 1234' || true", 30)
        assert survivors.stdout.strip() == "0"

        # A background process that outlives the command does not hold the call open.
        started = time.monotonic()
        detached = sandbox.exec("sleep 300 & echo started", 60)
        assert detached.stdout == "started\n" and time.monotonic() - started < 30

        big = sandbox.exec("printf 'H%.0s' $(seq 600); printf 'T%.0s' $(seq 600)", 30)
        assert big.stdout_omitted_bytes == 200 and big.truncated
        assert big.stdout.startswith("H" * 500) and big.stdout.endswith("T" * 500)
        assert "[... 200 bytes omitted ...]" in big.stdout
    finally:
        sandbox.close()


def test_send_keys_returns_only_new_terminal_output(kube, task):
    _, backend = kube
    sandbox = backend.create(task, run_id="run-1")
    try:
        first = sandbox.send_keys("echo one-$((40+2))\n", 1.0)
        assert "one-42" in first.text
        second = sandbox.send_keys("echo two-$((40+3))\n", 1.0)
        assert "two-43" in second.text and "one-42" not in second.text
        interrupted = sandbox.send_keys("sleep 1000\n", 0.3)
        assert "sleep 1000" in interrupted.text
        after = sandbox.send_keys("C-c", 0.5)  # a tmux key name, as Terminus sends it
        assert "^C" in after.text
    finally:
        sandbox.close()


def test_unpullable_image_fails_fast_and_deletes_the_pod(kube, tmp_path):
    server, backend = kube
    task = write_hello_task(tmp_path, docker_image="registry.invalid/nope:1")
    with pytest.raises(BackendError, match="ErrImagePull"):
        backend.create(task, run_id="run-1")
    assert [r.method for r in server.requests if "/pods" in r.path][-1] == "DELETE"
    assert server.pods == {}


def test_pod_that_never_runs_hits_the_ready_deadline_and_is_deleted(tmp_path, toolchain_dir):
    server = FakeKubeApiServer(pending_reads=10**9)
    core, networking, stream = server.kube_clients()
    backend = KubernetesBackend(
        KubernetesConfig(
            namespace=NAMESPACE,
            pod_ready_timeout_sec=0.3,
            poll_interval_sec=0.05,
            toolchain_dir=toolchain_dir,
        ),
        core_api=core,
        networking_api=networking,
        stream_fn=stream,
    )
    try:
        with pytest.raises(BackendError, match="not running within 0.3s"):
            backend.create(write_hello_task(tmp_path), run_id="run-1")
        assert server.pods == {} and server.live_containers() == 0
    finally:
        server.shutdown()


def test_reap_and_live_sandboxes_select_by_run_label(kube, task):
    server, backend = kube
    mine = [backend.create(task, run_id="run/A") for _ in range(2)]
    other = backend.create(task, run_id="run/B")
    try:
        assert sorted(backend.live_sandboxes("run/A")) == sorted(s.sandbox_id for s in mine)
        assert sorted(backend.reap("run/A")) == sorted(s.sandbox_id for s in mine)
        assert backend.live_sandboxes("run/A") == []
        assert backend.live_sandboxes("run/B") == [other.sandbox_id]
        with pytest.raises(SandboxClosed):  # its pod is gone: the call fails, it does not hang
            mine[0].close()
            mine[0].exec("true", 5)
    finally:
        other.close()
    assert server.live_containers() == 0


def test_active_deadline_kills_a_pod_nobody_closed_and_reap_collects_it(kube, task):
    server, backend = kube
    short = variant(backend, deadline_margin_sec=0.0)
    sandbox = short.create(with_limits(task, 1, 1, 1), run_id="crashed-run")
    # Nobody closes it (as if the controller died); the kubelet enforces activeDeadlineSeconds.
    assert wait_until(lambda: short.live_sandboxes("crashed-run") == [], timeout=30)
    assert server.live_containers() == 0
    assert short.reap("crashed-run") == [sandbox.sandbox_id]  # the Failed pod object is garbage-collected
    assert server.pods == {}


def test_close_during_exec_interrupts_it(kube, task):
    _, backend = kube
    sandbox = backend.create(task, run_id="run-1")
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            sandbox.exec("sleep 1000", 600)
            outcome["error"] = None
        except BaseException as error:  # noqa: BLE001 - recorded for the assertion
            outcome["error"] = error

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.5)
    sandbox.close()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert isinstance(outcome["error"], SandboxClosed)


def test_missing_cluster_credentials_give_a_clear_error(monkeypatch):
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(BackendError, match="neither an in-cluster service account nor a kubeconfig"):
        KubernetesBackend()


def test_verify_copies_tests_and_toolchain_and_runs_the_pinned_pytest(kube):
    """Harbor hello-world (its test.sh calls pytest): unsolved, then solved by its own solution."""
    _, backend = kube
    task = load_task(EXAMPLE_TASKS / "harbor" / "hello-world")
    unsolved = backend.create(task, run_id="run-1")
    try:
        report = unsolved.verify()
    finally:
        unsolved.close()
    assert report.parsed and report.total == 2 and report.passed == 0 and report.binary_outcome is False

    solved = backend.create(task, run_id="run-1")
    try:
        assert solved.exec(task.solution_script.read_text(), 60).exit_code == 0
        # A process the agent leaves behind that would rewrite the tests must not survive verify.
        solved.exec(
            "(while :; do echo 'def test_x(): pass' > /tests/test_outputs.py; sleep 0.01; done) &", 10
        )
        report = solved.verify()
        with pytest.raises(SandboxStateError, match="already"):
            solved.verify()
        with pytest.raises(SandboxStateError):
            solved.exec("true", 5)
    finally:
        solved.close()
    assert report.parsed and report.failure_cause is FailureCause.NONE, report.detail
    assert [a.name for a in report.assertions] == [
        "test_outputs::test_hello_file_exists",
        "test_outputs::test_hello_file_content",
    ]
    assert report.passed == 2 and report.binary_outcome is True and report.reward_value == 1.0


def test_verify_terminal_bench_1_task_ships_run_tests_sh(kube):
    """TB 1.x keeps run-tests.sh beside tests/; it downloads uv, so the pinned pytest runs instead."""
    _, backend = kube
    task = load_task(EXAMPLE_TASKS / "terminal-bench-1" / "hello-world")
    sandbox = backend.create(task, run_id="run-1")
    try:
        sandbox.exec(task.solution_script.read_text(), 60)
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert report.parsed and report.passed == report.total > 0, report.detail
    assert "pinned pytest" in report.detail


def test_missing_toolchain_fails_before_any_pod(kube, tmp_path):
    server, backend = kube
    broken = variant(backend, toolchain_dir=tmp_path / "nowhere")
    with pytest.raises(BackendError, match="no verifier toolchain"):
        broken.create(write_hello_task(tmp_path), run_id="run-1")
    assert server.requests == []


def test_verify_provides_the_test_packages_the_replaced_script_would_install(kube, tmp_path):
    """A test script that downloads (`uvx --with tomlkit==0.13.2 pytest ...`) is replaced by the pinned
    pytest; the package it would have installed is installed by the service for the Pod's own
    python3 and copied in, as the local and container backends provide it."""
    import shutil

    _, backend = kube
    task_dir = shutil.copytree(EXAMPLE_TASKS / "harbor" / "hello-world", tmp_path / "task")
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\nuvx --with tomlkit==0.13.2 pytest /tests/test_outputs.py -rA\n"
    )
    with open(task_dir / "tests" / "test_outputs.py", "a") as tests:
        tests.write("\n\ndef test_the_tests_own_dependency():\n    import tomlkit\n\n"
                    "    assert tomlkit.__version__ == '0.13.2'\n")  # fmt: skip
    task = load_task(task_dir)
    sandbox = backend.create(task, run_id="run-packages")
    try:
        assert sandbox.exec(task.solution_script.read_text(), 60).exit_code == 0
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert report.parsed and (report.passed, report.total) == (3, 3), report.detail
    assert "with tomlkit==0.13.2 (installed from PyPI by the service, copied in)" in report.detail
