"""Errors a sandbox caller can catch, the same in-process and over HTTP.

This module owns the exception vocabulary of the sandbox service. Admission control raises these
in-process; the server maps each to one HTTP status and a stable `code`; the client maps the code
back to the same class with the server's message. So a controller written against the in-process
`AdmissionController` handles a remote service unchanged.

Invariants:
- Every class has a unique `code` (the JSON `error` field) and a fixed `http_status`.
- `error_from_code` inverts the mapping; an unknown code becomes a plain `SandboxServiceError`, never
  a crash of the client.
"""

from __future__ import annotations


class SandboxServiceError(RuntimeError):
    """Base class: something about a sandbox request failed. `code` names the failure on the wire."""

    code = "sandbox_error"
    http_status = 500


class BadRequest(SandboxServiceError, ValueError):
    """The request itself is malformed (missing field, wrong type, impossible value)."""

    code = "bad_request"
    http_status = 400


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


class SandboxStateError(SandboxServiceError):
    """The call is not allowed in the sandbox's lifecycle state (e.g. `exec` after `verify`)."""

    code = "invalid_state"
    http_status = 409


class SandboxClosed(SandboxServiceError):
    """The sandbox was closed, cancelled or reclaimed; nothing more can run in it."""

    code = "sandbox_closed"
    http_status = 410


class TrialCancelled(SandboxClosed):
    """The trial was cancelled (by `cancel`, a run teardown, or shutdown) while this call ran."""

    code = "trial_cancelled"
    http_status = 410


class DeadlineExceeded(SandboxServiceError):
    """A layered deadline (`agent`, `verifier` or `total`) has passed; `deadline` says which.

    After the agent deadline, `exec`/`send_keys` raise this but `verify` still runs; after the total
    deadline the sandbox is reclaimed and every call raises this."""

    code = "deadline_exceeded"
    http_status = 504  # the HTTP status gRPC's DEADLINE_EXCEEDED maps to

    def __init__(self, message: str, deadline: str = "unknown"):
        super().__init__(message)
        self.deadline = deadline


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
    UnknownSandbox,
    UnknownTaskUpload,
    SandboxStateError,
    SandboxClosed,
    TrialCancelled,
    DeadlineExceeded,
    AdmissionTimeout,
    BackendError,
    ServiceUnavailable,
)
_BY_CODE = {cls.code: cls for cls in _ALL}
assert len(_BY_CODE) == len(_ALL), "error codes must be unique"


def error_from_code(code: str, message: str, *, deadline: str | None = None) -> SandboxServiceError:
    """Rebuild the exception a server reported as `{"error": code, "message": message}`."""
    cls = _BY_CODE.get(code, SandboxServiceError)
    if cls is DeadlineExceeded:
        return DeadlineExceeded(message, deadline or "unknown")
    return cls(message)
