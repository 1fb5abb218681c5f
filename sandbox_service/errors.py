"""Errors a sandbox caller can catch, the same in-process and over HTTP.

This module owns the service's exception vocabulary and its wire form. Every class here is a
subclass of the contract's `SandboxError` family (`sandbox_service.contracts`), so a controller
that catches `SandboxDeadlineExpired` or `SandboxLifecycleError` works unchanged whether it talks
to a backend directly, to the in-process `AdmissionController`, or to a remote service:

    contract class            service class (code, HTTP status)
    SandboxError              SandboxServiceError ("sandbox_error", 500), BackendError (502),
                              BadRequest (400), UnknownSandbox (404), UnknownTaskUpload (404),
                              AdmissionTimeout (429), ServiceUnavailable (503)
    SandboxLifecycleError     SandboxStateError (409) > SandboxClosed (410) > TrialCancelled (410)
    SandboxDeadlineExpired    DeadlineExceeded ("deadline_exceeded", 504; `.deadline` says which)
    UnsupportedEnvironment    UnsupportedTaskEnvironment ("unsupported_environment", 422)

Invariants:
- Every class has a unique `code` (the JSON `error` field) and a fixed `http_status`.
- `error_from_json(error_to_json(e))` has the class and message of `e` (and its deadline / task
  fields); an unknown code becomes a plain `SandboxServiceError`, never a crash of the client.
- `translate(error)` maps any exception a backend raises onto this vocabulary without losing
  its meaning (a backend's own deadline stays a deadline, its lifecycle refusal stays one).
"""

from __future__ import annotations

from typing import Any

from sandbox_service.contracts import (
    SandboxDeadlineExpired,
    SandboxError,
    SandboxLifecycleError,
    UnsupportedEnvironment,
)


class SandboxServiceError(SandboxError):
    """Base class: something about a sandbox request failed. `code` names the failure on the wire."""

    code = "sandbox_error"
    http_status = 500


class BadRequest(SandboxServiceError, ValueError):
    """The request itself is malformed (missing field, wrong type, impossible value)."""

    code = "bad_request"
    http_status = 400


class Unauthorized(SandboxServiceError):
    """The request carries no valid bearer token for a service that requires one."""

    code = "unauthorized"
    http_status = 401


class PayloadTooLarge(BadRequest):
    """The request body is larger than the service accepts for that route."""

    code = "payload_too_large"
    http_status = 413


class UnknownSandbox(SandboxServiceError, KeyError):
    """No sandbox (or trial) with this id was ever created by this service."""

    code = "unknown_sandbox"
    http_status = 404

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return RuntimeError.__str__(self)


class UnknownTaskUpload(SandboxServiceError):
    """The service holds no uploaded task directory with this content digest; upload it first."""

    code = "unknown_task"
    http_status = 404


class SandboxStateError(SandboxServiceError, SandboxLifecycleError):
    """The call is not allowed in the sandbox's lifecycle state (e.g. `exec` after `verify`)."""

    code = "invalid_state"
    http_status = 409


class SandboxClosed(SandboxStateError):
    """The sandbox was closed, cancelled or reclaimed; nothing more can run in it."""

    code = "sandbox_closed"
    http_status = 410


class TrialCancelled(SandboxClosed):
    """The trial was cancelled (by `cancel`, a run teardown, or shutdown) while this call ran."""

    code = "trial_cancelled"
    http_status = 410


class DeadlineExceeded(SandboxServiceError, SandboxDeadlineExpired):
    """A layered deadline (`agent`, `verifier` or `total`) has passed; `deadline` says which.

    After the agent deadline, `exec`/`send_keys` raise this but `verify` still runs; after the total
    deadline the sandbox is reclaimed and every call raises this."""

    code = "deadline_exceeded"
    http_status = 504  # the HTTP status gRPC's DEADLINE_EXCEEDED maps to

    def __init__(self, message: str, deadline: str = "unknown"):
        SandboxDeadlineExpired.__init__(self, message, deadline)


class UnsupportedTaskEnvironment(SandboxServiceError, UnsupportedEnvironment):
    """The backend cannot build this task's environment; nothing was started."""

    code = "unsupported_environment"
    http_status = 422

    def __init__(self, task_id: str, reason: str):
        UnsupportedEnvironment.__init__(self, task_id, reason)


class AdmissionTimeout(SandboxServiceError):
    """No creation token or concurrency slot became free within the admission wait limit."""

    code = "admission_timeout"
    http_status = 429


class BackendError(SandboxServiceError):
    """The backend (bubblewrap, Kubernetes, Modal) failed to create or drive a sandbox."""

    code = "backend_error"
    http_status = 502


class ServiceUnavailable(SandboxServiceError):
    """The client could not reach the sandbox service, or it is shutting down."""

    code = "service_unavailable"
    http_status = 503


_ALL: tuple[type[SandboxServiceError], ...] = (
    SandboxServiceError,
    BadRequest,
    Unauthorized,
    PayloadTooLarge,
    UnknownSandbox,
    UnknownTaskUpload,
    SandboxStateError,
    SandboxClosed,
    TrialCancelled,
    DeadlineExceeded,
    UnsupportedTaskEnvironment,
    AdmissionTimeout,
    BackendError,
    ServiceUnavailable,
)
_BY_CODE = {cls.code: cls for cls in _ALL}
assert len(_BY_CODE) == len(_ALL), "error codes must be unique"


def error_to_json(error: SandboxServiceError) -> dict[str, Any]:
    body: dict[str, Any] = {"error": error.code, "message": str(error)}
    if isinstance(error, SandboxDeadlineExpired):
        body["deadline"] = error.deadline
    if isinstance(error, UnsupportedEnvironment):
        body["task_id"], body["reason"] = error.task_id, error.reason
    return body


def error_from_json(body: dict[str, Any]) -> SandboxServiceError:
    """Rebuild the exception a server reported as `{"error": code, "message": ..., ...}`."""
    code, message = str(body.get("error", "")), str(body.get("message", ""))
    cls = _BY_CODE.get(code, SandboxServiceError)
    if cls is DeadlineExceeded:
        return DeadlineExceeded(message, str(body.get("deadline") or "unknown"))
    if cls is UnsupportedTaskEnvironment:
        return UnsupportedTaskEnvironment(str(body.get("task_id", "")), str(body.get("reason", message)))
    return cls(message)


def translate(error: BaseException, context: str) -> SandboxServiceError:
    """The service error for an exception a backend raised while doing `context`."""
    if isinstance(error, SandboxServiceError):
        return error
    if isinstance(error, SandboxDeadlineExpired):
        return DeadlineExceeded(str(error), error.deadline)
    if isinstance(error, UnsupportedEnvironment):
        return UnsupportedTaskEnvironment(error.task_id, error.reason)
    if isinstance(error, SandboxLifecycleError):
        return SandboxStateError(str(error))
    return BackendError(f"{context} failed: {error}")
