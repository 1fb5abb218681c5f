"""Access to the HTTP service: no bind beyond loopback without a token, the bearer token on every
request, each run reaching only its own sandboxes, and one-line 4xx answers to bad requests
(malformed JSON, oversized bodies, paths escaping the task directory, unknown ids) after which the
service keeps serving. A real uvicorn server on localhost, the real client, real sandboxes."""

from __future__ import annotations

import gzip
import io
import subprocess
import sys
import tarfile

import httpx
import pytest

from sandbox_service import server as server_module
from sandbox_service import wire
from sandbox_service.access import (
    RUN_HEADER,
    AccessPolicy,
    AccessRefused,
    check_bind,
    is_loopback,
    load_token,
)
from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.client import SandboxServiceClient
from sandbox_service.errors import Unauthorized
from sandbox_service.server import ServiceThread, TaskStore, create_app, serve

pytestmark = pytest.mark.sandbox

TOKEN = "a-test-token-of-enough-length-0123456789"


@pytest.fixture
def guarded(backend, tmp_path):
    controller = AdmissionController(
        backend, AdmissionConfig(create_rate_per_sec=None, reaper_interval_sec=0.1)
    )
    app = create_app(
        controller, TaskStore(tmp_path / "store"), backend_name="test", access=AccessPolicy(TOKEN)
    )
    thread = ServiceThread(app).start()
    yield thread
    thread.stop()


def _raw(thread: ServiceThread, **headers) -> httpx.Client:
    return httpx.Client(base_url=thread.url + wire.API_PREFIX, headers=headers, timeout=60)


def _one_line_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == code and "\n" not in body["message"] and body["message"]
    return body["message"]


def test_binding_beyond_loopback_needs_a_token(tmp_path):
    for host in ("127.0.0.1", "::1", "localhost"):
        assert is_loopback(host)
        check_bind(host, None)
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        assert not is_loopback(host)
        with pytest.raises(AccessRefused, match="without a token"):
            check_bind(host, None)
        check_bind(host, TOKEN)
    app = create_app(AdmissionController(_NoBackend(), AdmissionConfig()), TaskStore(tmp_path / "s"))
    with pytest.raises(AccessRefused):  # the library's `serve` refuses it too, before binding
        serve(app, host="0.0.0.0", port=0)


class _NoBackend:
    def create(self, task, *, run_id="default"):
        raise AssertionError("never called")


def test_the_token_comes_from_a_file_or_a_variable(tmp_path, monkeypatch):
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert load_token(token_file=tmp_path / "token") == TOKEN
    monkeypatch.setenv("SERVICE_TOKEN", TOKEN)
    assert load_token(token_env="SERVICE_TOKEN") == TOKEN
    assert load_token() is None
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(AccessRefused, match="at least 16 characters"):
        load_token(token_file=tmp_path / "short")
    with pytest.raises(AccessRefused, match="cannot read the token file"):
        load_token(token_file=tmp_path / "missing")


def test_serve_beyond_loopback_without_a_token_exits_2_with_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "sandbox_service", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "without a token" in lines[0] and "Traceback" not in done.stderr


def test_every_request_needs_the_bearer_token(guarded, hello_task):
    for headers in ({}, {"authorization": "Bearer wrong-token-of-some-length"}, {"authorization": TOKEN}):
        _one_line_error(_raw(guarded, **headers).get("/health"), 401, "unauthorized")
    with pytest.raises(Unauthorized):
        SandboxServiceClient(guarded.url, token="not-the-token-at-all").health()
    client = SandboxServiceClient(guarded.url, token=TOKEN, timeout_margin_sec=30)
    sandbox = client.create(hello_task, run_id="run-a")
    try:
        assert sandbox.exec("echo hi", 30).stdout == "hi\n"
    finally:
        sandbox.close()
        client.close()


def test_a_run_reaches_only_its_own_sandboxes(guarded, hello_task):
    client = SandboxServiceClient(guarded.url, token=TOKEN, timeout_margin_sec=30)
    mine = client.create(hello_task, run_id="run-a")
    other = _raw(guarded, authorization=f"Bearer {TOKEN}", **{RUN_HEADER: "run-b"})
    try:
        for method, path, body in (
            ("POST", f"/sandboxes/{mine.sandbox_id}/exec", {"command": "id", "timeout_sec": 5}),
            ("POST", f"/sandboxes/{mine.sandbox_id}/verify", None),
            ("DELETE", f"/sandboxes/{mine.sandbox_id}", None),
            ("DELETE", f"/trials/{mine.trial_id}", None),
        ):
            message = _one_line_error(other.request(method, path, json=body), 404, "unknown_sandbox")
            assert "in run 'run-b'" in message  # answered as an id that does not exist
        assert other.get("/sandboxes").json()["trials"] == []
        _one_line_error(other.post("/runs/run-a/leak-check"), 400, "bad_request")
        nameless = _raw(guarded, authorization=f"Bearer {TOKEN}")
        assert "names no run" in _one_line_error(nameless.get("/sandboxes"), 400, "bad_request")
        assert [t["sandbox_id"] for t in client.trials("run-a")] == [mine.sandbox_id]
        assert mine.exec("echo still mine", 30).stdout == "still mine\n"  # untouched
    finally:
        mine.close()
        client.close()


def test_bad_requests_get_one_line_and_the_service_keeps_serving(guarded, hello_task, monkeypatch, tmp_path):
    monkeypatch.setattr(server_module, "MAX_JSON_BYTES", 4096)
    client = SandboxServiceClient(guarded.url, token=TOKEN, timeout_margin_sec=30)
    sandbox = client.create(hello_task, run_id="run-a")
    http = _raw(guarded, authorization=f"Bearer {TOKEN}", **{RUN_HEADER: "run-a"})
    exec_path = f"/sandboxes/{sandbox.sandbox_id}/exec"
    try:
        _one_line_error(http.post(exec_path, content=b'{"command": "id", '), 400, "bad_request")
        _one_line_error(http.post(exec_path, content=b"[1, 2]"), 400, "bad_request")
        big = {"command": "x" * 10_000, "timeout_sec": 5}
        _one_line_error(http.post(exec_path, json=big), 413, "payload_too_large")
        chunks = (b"x" * 1024 for _ in range(8))  # no Content-Length: refused while streaming
        _one_line_error(http.post(exec_path, content=chunks), 413, "payload_too_large")
        # Paths that escape the task directory: in an uploaded tarball, and in the task's JSON.
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            data = b"owned\n"
            info = tarfile.TarInfo("../../escaped.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        digest = "0" * 64
        put = http.put(f"/tasks/{digest}", content=gzip.compress(archive.getvalue()))
        assert "not a valid task tarball" in _one_line_error(put, 400, "bad_request")
        assert not (tmp_path / "escaped.txt").exists()  # the store is tmp_path/store/<staging>/
        task_json = wire.task_to_json(hello_task)
        task_json["tests_dir"] = {"task_relative": "../../etc"}
        real_digest = wire.task_digest(hello_task.source_dir)
        create = http.post(
            "/sandboxes", json={"task_digest": real_digest, "task": task_json, "run_id": "run-a"}
        )
        assert "escapes the task directory" in _one_line_error(create, 400, "bad_request")
        _one_line_error(http.post("/sandboxes/sbx-0000000000000000/exec", json={"command": "id"}), 404,
                        "unknown_sandbox")  # fmt: skip
        _one_line_error(http.delete("/trials/no-such-trial"), 404, "unknown_sandbox")
        assert client.health()["status"] == "ok"  # and it keeps serving
        assert sandbox.exec("echo alive", 30).stdout == "alive\n"
    finally:
        sandbox.close()
        client.close()
