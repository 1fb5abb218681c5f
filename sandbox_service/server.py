"""The sandbox service's HTTP/JSON API: a Starlette ASGI app served by uvicorn.

This module owns the wire protocol of the service and its process-level duties: it unpacks
uploaded task directories into a content-addressed store, routes every request to one shared
`AdmissionController`, runs every blocking backend call in a bounded worker-thread pool (the event
loop never blocks, so a long `exec` never delays another trial's request), and reclaims sandboxes
on request, on client disconnect during creation, and at shutdown.

API (all bodies JSON unless noted; errors are `{"error": code, "message": ..., ["deadline": ...]}`
with the status of the matching `sandbox_service.errors` class):

    GET    /v1/health                          -> {"status", "backend", "stats"}
    GET    /v1/tasks/{digest}                  -> 200 if the task directory is stored, else 404
    PUT    /v1/tasks/{digest}   (gzip tar)     -> 201 stored (200 if already there); 400 on digest mismatch
    POST   /v1/environment-audit  {task_digest, task}  -> EnvironmentAudit (how the backend runs it)
    POST   /v1/sandboxes  {task_digest, task, run_id, trial_id?, admission_timeout_sec?}
                                               -> 201 {sandbox_id, trial_id, run_id, limits}
    GET    /v1/sandboxes?run_id=               -> {"trials": [...open trials...]}
    POST   /v1/sandboxes/{id}/exec   {command, timeout_sec}  -> ExecResult
    POST   /v1/sandboxes/{id}/keys   {keys, wait_sec}        -> TerminalRead
    POST   /v1/sandboxes/{id}/verify                         -> VerifierReport
    DELETE /v1/sandboxes/{id}                  -> {"closed": bool}   (idempotent close)
    DELETE /v1/trials/{trial_id}               -> {"cancelled": bool} (works while create is in flight)
    POST   /v1/runs/{run_id}/leak-check        -> LeakReport
    DELETE /v1/runs/{run_id}                   -> cancel every open trial of the run, then leak-check it

`{id}` may be a sandbox id or a trial id.

Invariants:
- A task directory is stored under its digest only after the unpacked copy re-hashes to it.
- Every sandbox created for a request is either returned to the client or closed: if the client
  disconnected while it was being created, it is closed at once.
- Shutdown (lifespan end) closes every open trial before the process exits.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sandbox_service import wire
from sandbox_service.access import RUN_HEADER, AccessPolicy, check_bind
from sandbox_service.admission import AdmissionController, LeakReport, TrialInfo, TrialState
from sandbox_service.contracts import SandboxError
from sandbox_service.errors import (
    BadRequest,
    PayloadTooLarge,
    SandboxServiceError,
    Unauthorized,
    UnknownSandbox,
    UnknownTaskUpload,
    error_to_json,
    translate,
)

log = logging.getLogger(__name__)

API_PREFIX = wire.API_PREFIX
NO_TOKEN = AccessPolicy()  # loopback only (`serve` refuses any other host without a token)
MAX_JSON_BYTES = 64 << 20


class TaskStore:
    """Content-addressed store of uploaded task directories: `root/<digest>/`."""

    def __init__(self, root: Path, *, max_upload_bytes: int = 256 << 20):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_upload_bytes = max_upload_bytes

    def path(self, digest: str) -> Path:
        _check_digest(digest)
        return self.root / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_dir()

    def require(self, digest: str) -> Path:
        path = self.path(digest)
        if not path.is_dir():
            raise UnknownTaskUpload(
                f"no task directory with digest {digest} is stored; PUT /v1/tasks/{digest} first"
            )
        return path

    def put(self, digest: str, data: bytes) -> bool:
        """Unpack and store; True if newly stored. Concurrent puts of one digest are safe: each
        unpacks into its own temporary directory and the first rename wins."""
        final = self.path(digest)
        if final.is_dir():
            return False
        if len(data) > self.max_upload_bytes:
            raise BadRequest(
                f"task upload of {len(data)} bytes exceeds the {self.max_upload_bytes}-byte limit"
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=self.root))
        try:
            wire.unpack_task_dir(data, staging)
            actual = wire.task_digest(staging)
            if actual != digest:
                raise BadRequest(
                    f"uploaded task directory hashes to {actual}, "
                    f"not to the digest {digest} it was sent under"
                )
            try:
                os.rename(staging, final)
            except OSError:
                if final.is_dir():  # another upload of the same content won the race
                    return False
                raise
            return True
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def _check_digest(digest: str) -> None:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise BadRequest(f"task digest must be 64 lowercase hex characters (sha256), got {digest!r}")


# --------------------------------------------------------------------------------------------------
# Request helpers


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit`: by its Content-Length
    before anything is read, or while streaming one that has none (chunked)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(request: Request) -> dict[str, Any]:
    body = await _read_body(request, MAX_JSON_BYTES)
    if not body:
        return {}
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        raise BadRequest(f"request body is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def _number(
    data: dict[str, Any], key: str, *, default: float | None = None, required: bool = True
) -> float | None:
    if key not in data or data[key] is None:
        if required and default is None:
            raise BadRequest(f"field {key!r} is required")
        return default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"field {key!r} must be a finite number, got {value!r}")
    return float(value)


def _string(data: dict[str, Any], key: str, *, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise BadRequest(f"field {key!r} must be a string" + (" and is required" if value is None else ""))
    return value


def _trial_to_json(info: TrialInfo) -> dict[str, Any]:
    return {
        "trial_id": info.trial_id,
        "run_id": info.run_id,
        "task_id": info.task_id,
        "sandbox_id": info.sandbox_id,
        "state": info.state.value,
        "limits": wire.limits_to_json(info.limits),
    }


def leak_report_to_json(report: LeakReport) -> dict[str, Any]:
    return {
        "run_id": report.run_id,
        "unclosed_trials": list(report.unclosed_trials),
        "orphaned_sandboxes": list(report.orphaned_sandboxes),
        "remaining": list(report.remaining),
        "leaked": report.leaked,
    }


def _error_response(error: SandboxServiceError) -> JSONResponse:
    body = error_to_json(error)
    body["message"] = " ".join(str(body["message"]).split())  # one line, whatever the cause printed
    return JSONResponse(body, status_code=error.http_status)


def _run_of_request(request: Request) -> str:
    run = request.headers.get(RUN_HEADER, "")
    if not run:
        raise BadRequest(f"the request names no run: send the {RUN_HEADER} header")
    return run


# --------------------------------------------------------------------------------------------------
# The app


def create_app(
    controller: AdmissionController,
    task_store: TaskStore,
    *,
    backend_name: str = "unknown",
    worker_threads: int | None = None,
    on_shutdown: Callable[[], None] | None = None,
    access: AccessPolicy = NO_TOKEN,
) -> Starlette:
    """The ASGI app. `worker_threads` bounds concurrent backend calls (default: enough for every
    live sandbox to have an exec and a close in flight, plus queued creates). At shutdown the app
    closes every trial, then calls `on_shutdown` (e.g. to close the backend). `access`: the bearer
    token every request must carry, if any (`sandbox_service.access`)."""
    threads = anyio.CapacityLimiter(worker_threads or max(64, 3 * controller.config.max_live_sandboxes + 16))

    async def blocking(fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=threads)

    def endpoint(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                if not access.authorizes(request.headers.get("authorization")):
                    raise Unauthorized("missing or wrong bearer token (Authorization: Bearer TOKEN)")
                return await handler(request)
            except SandboxServiceError as error:
                return _error_response(error)
            except SandboxError as error:  # a backend's contract error that no layer translated
                return _error_response(translate(error, f"{request.method} {request.url.path}"))
            except Exception as error:  # a bug, not a sandbox outcome: report it, keep serving
                log.exception("unhandled error in %s %s", request.method, request.url.path)
                return JSONResponse(
                    {"error": "internal_error", "message": f"{type(error).__name__}: {error}"},
                    status_code=500,
                )

        return wrapped

    def owned(request: Request, key: str = "sandbox_id") -> str:
        """The trial or sandbox id of the path, if it belongs to the run the request names; an id
        of another run is answered exactly as an unknown one."""
        wanted, run = request.path_params[key], _run_of_request(request)
        try:
            if controller.run_of(wanted) == run:
                return wanted
        except UnknownSandbox:
            pass
        raise UnknownSandbox(f"no sandbox or trial with id {wanted!r} exists in run {run!r}")

    def same_run(request: Request, run_id: str) -> str:
        run = _run_of_request(request)
        if run_id != run:
            raise BadRequest(f"the request names run {run!r} but addresses run {run_id!r}")
        return run

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "backend": backend_name, "stats": controller.stats()})

    async def get_task(request: Request) -> Response:
        digest = request.path_params["digest"]
        task_store.require(digest)
        return JSONResponse({"digest": digest, "stored": True})

    async def put_task(request: Request) -> Response:
        digest = request.path_params["digest"]
        _check_digest(digest)
        if task_store.has(digest):
            return JSONResponse({"digest": digest, "stored": True, "new": False}, status_code=200)
        body = await _read_body(request, task_store.max_upload_bytes)
        created = await blocking(task_store.put, digest, body)
        return JSONResponse(
            {"digest": digest, "stored": True, "new": created}, status_code=201 if created else 200
        )

    async def create_sandbox(request: Request) -> Response:
        data = await _json_body(request)
        digest = _string(data, "task_digest")
        root = task_store.require(digest)
        task = wire.task_from_json(data.get("task"), root)
        run_id = _string(data, "run_id", default="default")  # the body names it; a header must agree
        if request.headers.get(RUN_HEADER) is not None:
            same_run(request, run_id)
        trial_id = data.get("trial_id")
        if trial_id is not None and (not isinstance(trial_id, str) or not trial_id):
            raise BadRequest("field 'trial_id' must be a non-empty string when given")
        wait = _number(data, "admission_timeout_sec", required=False)
        if wait is not None and wait < 0:
            raise BadRequest(f"field 'admission_timeout_sec' must be >= 0, got {wait}")
        sandbox = await blocking(
            lambda: controller.create(task, run_id=run_id, trial_id=trial_id, admission_timeout_sec=wait)
        )
        if await request.is_disconnected():
            log.warning("client went away while trial %s was being created; closing it", sandbox.trial_id)
            await blocking(sandbox.close)
            return JSONResponse({"error": "client_disconnected", "message": "closed"}, status_code=499)
        return JSONResponse(
            {
                "sandbox_id": sandbox.sandbox_id,
                "trial_id": sandbox.trial_id,
                "run_id": sandbox.run_id,
                "limits": wire.limits_to_json(sandbox.limits),
            },
            status_code=201,
        )

    async def audit_environment(request: Request) -> Response:
        data = await _json_body(request)
        root = task_store.require(_string(data, "task_digest"))
        task = wire.task_from_json(data.get("task"), root)
        audit = await blocking(controller.environment_audit, task)
        return JSONResponse(audit.to_json())

    async def list_sandboxes(request: Request) -> Response:
        run_id = same_run(request, request.query_params.get("run_id") or _run_of_request(request))
        return JSONResponse({"trials": [_trial_to_json(info) for info in controller.trials(run_id)]})

    async def exec_command(request: Request) -> Response:
        sandbox = controller.get(owned(request))
        data = await _json_body(request)
        command = _string(data, "command")
        timeout_sec = _number(data, "timeout_sec")
        result = await blocking(sandbox.exec, command, timeout_sec)
        return JSONResponse(wire.exec_result_to_json(result))

    async def send_keys(request: Request) -> Response:
        sandbox = controller.get(owned(request))
        data = await _json_body(request)
        keys = _string(data, "keys")
        wait_sec = _number(data, "wait_sec", default=0.0, required=False)
        read = await blocking(sandbox.send_keys, keys, wait_sec)
        return JSONResponse(wire.terminal_read_to_json(read))

    async def verify(request: Request) -> Response:
        sandbox = controller.get(owned(request))
        report = await blocking(sandbox.verify)
        return JSONResponse(wire.verifier_report_to_json(report))

    async def close_sandbox(request: Request) -> Response:
        sandbox = controller.get(owned(request))
        was_open = sandbox.state is not TrialState.CLOSED
        await blocking(sandbox.close)
        return JSONResponse({"closed": was_open})

    async def cancel_trial(request: Request) -> Response:
        cancelled = await blocking(controller.cancel, owned(request, "trial_id"))
        return JSONResponse({"cancelled": cancelled})

    async def leak_check(request: Request) -> Response:
        report = await blocking(controller.leak_check, same_run(request, request.path_params["run_id"]))
        return JSONResponse(leak_report_to_json(report))

    async def delete_run(request: Request) -> Response:
        run_id = same_run(request, request.path_params["run_id"])
        cancelled = await blocking(controller.cancel_run, run_id)
        report = await blocking(controller.leak_check, run_id)
        return JSONResponse({"cancelled": cancelled, **leak_report_to_json(report)})

    @asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        log.info("sandbox service shutting down: closing every open trial")
        await anyio.to_thread.run_sync(controller.shutdown)
        if on_shutdown is not None:
            await anyio.to_thread.run_sync(on_shutdown)

    p = API_PREFIX
    routes = [
        Route(f"{p}/health", endpoint(health), methods=["GET"]),
        Route(f"{p}/tasks/{{digest}}", endpoint(get_task), methods=["GET"]),
        Route(f"{p}/tasks/{{digest}}", endpoint(put_task), methods=["PUT"]),
        Route(f"{p}/environment-audit", endpoint(audit_environment), methods=["POST"]),
        Route(f"{p}/sandboxes", endpoint(create_sandbox), methods=["POST"]),
        Route(f"{p}/sandboxes", endpoint(list_sandboxes), methods=["GET"]),
        Route(f"{p}/sandboxes/{{sandbox_id}}/exec", endpoint(exec_command), methods=["POST"]),
        Route(f"{p}/sandboxes/{{sandbox_id}}/keys", endpoint(send_keys), methods=["POST"]),
        Route(f"{p}/sandboxes/{{sandbox_id}}/verify", endpoint(verify), methods=["POST"]),
        Route(f"{p}/sandboxes/{{sandbox_id}}", endpoint(close_sandbox), methods=["DELETE"]),
        Route(f"{p}/trials/{{trial_id}}", endpoint(cancel_trial), methods=["DELETE"]),
        Route(f"{p}/runs/{{run_id}}/leak-check", endpoint(leak_check), methods=["POST"]),
        Route(f"{p}/runs/{{run_id}}", endpoint(delete_run), methods=["DELETE"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.access = access  # `serve` refuses a non-loopback bind without a token

    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse(
            {"error": "not_found", "message": f"no route {request.method} {request.url.path}"},
            status_code=getattr(exc, "status_code", 404),
        )

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_found)
    return app


# --------------------------------------------------------------------------------------------------
# Running it


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: Starlette, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=75,
        timeout_graceful_shutdown=30,
        access_log=False,
    )
    return uvicorn.Server(config)


def serve(app: Starlette, *, host: str = "127.0.0.1", port: int = 8765, log_level: str = "info") -> None:
    """Run the service in the foreground until SIGINT/SIGTERM; shutdown closes every sandbox.
    Raises `access.AccessRefused` for a host beyond loopback when the app has no token."""
    check_bind(host, getattr(app.state, "access", NO_TOKEN).token)
    sock = _bind(host, port)
    actual_host, actual_port = sock.getsockname()[:2]
    print(f"sandbox service listening on http://{actual_host}:{actual_port}{API_PREFIX}", flush=True)
    _uvicorn_server(app, log_level).run(sockets=[sock])


class ServiceThread:
    """The service on a background thread of this process, on a free localhost port: a real
    uvicorn server for tests and for controllers that want the HTTP path without a second process.
    `stop()` runs the app's shutdown (closing every sandbox) and joins the thread."""

    def __init__(self, app: Starlette, *, host: str = "127.0.0.1", log_level: str = "warning"):
        self._sock = _bind(host, 0)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        self._server = _uvicorn_server(app, log_level)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="sandbox-service", daemon=True
        )

    def start(self, timeout_sec: float = 30.0) -> ServiceThread:
        self._thread.start()
        give_up = time.monotonic() + timeout_sec
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > give_up:
                raise RuntimeError("the in-process sandbox service did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_sec: float = 120.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_sec)
        self._sock.close()

    def __enter__(self) -> ServiceThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
