"""HTTP client of the sandbox service: a `SandboxProvider` whose sandboxes live in another process.

This module owns the caller's side of the wire protocol in `sandbox_service.server`. The controller
uses `SandboxServiceClient.create(task)` exactly as it would use an in-process `AdmissionController`:
the returned `RemoteSandbox` implements the `Sandbox` contract, and server errors come back as the
same `sandbox_service.errors` classes with the server's message.

Invariants:
- A task directory is uploaded at most once per service (by content digest); later creates send
  only the digest and the task's JSON.
- Every create carries a trial id chosen here, so a create that fails on the client side (timeout,
  broken connection) is followed by a best-effort cancel of that trial: the service never keeps a
  sandbox nobody can name.
- Every request has a bounded timeout: the call's own timeout plus `timeout_margin_sec`.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx

from sandbox_service import wire
from sandbox_service.access import RUN_HEADER, TOKEN_ENV
from sandbox_service.admission import LeakReport
from sandbox_service.contracts import (
    EnvironmentAudit,
    ExecResult,
    Task,
    TaskLimits,
    TerminalRead,
    VerifierReport,
)
from sandbox_service.errors import (
    SandboxServiceError,
    ServiceUnavailable,
    UnknownSandbox,
    UnknownTaskUpload,
    error_from_json,
)


class SandboxServiceClient:
    """Talks to one sandbox service at `base_url` (e.g. `http://127.0.0.1:8765`). Thread-safe: one
    client may serve every trial of a controller (httpx pools the connections)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_sec: float = 10.0,
        timeout_margin_sec: float = 60.0,
        default_admission_wait_sec: float = 3600.0,
        max_connections: int = 256,
        transport: httpx.BaseTransport | None = None,
        token: str | None = None,
    ):
        """`token`: the service's bearer token (default: the `T1JAX_SANDBOX_TOKEN` variable, if set)."""
        self.base_url = base_url.rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        auth = {"authorization": f"Bearer {token}"} if token else {}
        self.timeout_margin_sec = timeout_margin_sec
        self.default_admission_wait_sec = default_admission_wait_sec
        self._connect_timeout = connect_timeout_sec
        self._http = httpx.Client(
            base_url=self.base_url + wire.API_PREFIX,
            timeout=httpx.Timeout(connect_timeout_sec + timeout_margin_sec, connect=connect_timeout_sec),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
            headers=auth,
        )
        self._uploaded: set[str] = set()
        self._runs: dict[str, str] = {}  # trial id -> its run (every sandbox request names its run)
        self._digests: dict[Path, tuple[tuple[int, int], str]] = {}
        self._lock = threading.Lock()

    # ---- plumbing --------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        timeout_sec: float | None = None,
        run_id: str | None = None,
        **kwargs: Any,
    ) -> Any:
        if run_id is not None:
            kwargs["headers"] = {**kwargs.get("headers", {}), RUN_HEADER: run_id}
        timeout = httpx.Timeout(
            None if timeout_sec is None else timeout_sec + self.timeout_margin_sec,
            connect=self._connect_timeout,
        )
        try:
            response = self._http.request(method, path, timeout=timeout, **kwargs)
        except httpx.TimeoutException as error:
            raise ServiceUnavailable(
                f"{method} {path}: the sandbox service at {self.base_url} did not answer in time ({error!r})"
            ) from error
        except httpx.TransportError as error:
            raise ServiceUnavailable(
                f"{method} {path}: cannot reach the sandbox service at {self.base_url}: {error}"
            ) from error
        if response.is_success:
            return response.json() if response.content else None
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "error" in body:
            raise error_from_json(body)
        raise SandboxServiceError(f"{method} {path}: HTTP {response.status_code}: {response.text[:500]}")

    def _digest(self, source_dir: Path) -> str:
        """The task directory's digest, recomputed only when an entry's mtime or the count changes."""
        source_dir = Path(source_dir).resolve()
        newest, count = 0, 0
        for path in source_dir.rglob("*"):
            newest = max(newest, path.lstat().st_mtime_ns)
            count += 1
        signature = (newest, count)
        with self._lock:
            cached = self._digests.get(source_dir)
        if cached is not None and cached[0] == signature:
            return cached[1]
        digest = wire.task_digest(source_dir)
        with self._lock:
            self._digests[source_dir] = (signature, digest)
        return digest

    def upload_task(self, task: Task) -> str:
        """Make sure the service holds the task's directory; returns its digest."""
        digest = self._digest(task.source_dir)
        self._upload(digest, task.source_dir)
        return digest

    def _upload(self, digest: str, source_dir: Path) -> None:
        with self._lock:
            if digest in self._uploaded:
                return
        self._request(
            "PUT",
            f"/tasks/{digest}",
            content=wire.pack_task_dir(source_dir),
            headers={"content-type": "application/gzip"},
            timeout_sec=300.0,
        )
        with self._lock:
            self._uploaded.add(digest)

    # ---- SandboxProvider ---------------------------------------------------------------------------

    def create(
        self,
        task: Task,
        *,
        run_id: str = "default",
        trial_id: str | None = None,
        admission_wait_sec: float | None = None,
    ) -> RemoteSandbox:
        """Create a sandbox for `task` on the service. `trial_id` (default: fresh) lets another
        thread `cancel` it while this call waits. The request times out after the admission wait
        plus the task's total deadline plus the margin."""
        trial_id = trial_id or uuid.uuid4().hex
        with self._lock:
            self._runs[trial_id] = run_id
        digest = self._digest(task.source_dir)
        body = {
            "task_digest": digest,
            "task": wire.task_to_json(task),
            "run_id": run_id,
            "trial_id": trial_id,
        }
        if admission_wait_sec is not None:
            body["admission_timeout_sec"] = admission_wait_sec
        wait = self.default_admission_wait_sec if admission_wait_sec is None else admission_wait_sec
        timeout = wait + task.limits.total_timeout_sec
        with self._lock:
            known = digest in self._uploaded
        if not known:
            self._upload(digest, task.source_dir)
        try:
            try:
                reply = self._request("POST", "/sandboxes", json=body, timeout_sec=timeout, run_id=run_id)
            except UnknownTaskUpload:  # the service restarted and lost its store: upload again
                with self._lock:
                    self._uploaded.discard(digest)
                self._upload(digest, task.source_dir)
                reply = self._request("POST", "/sandboxes", json=body, timeout_sec=timeout, run_id=run_id)
        except ServiceUnavailable:
            self._cancel_quietly(trial_id)
            raise
        with self._lock:
            self._runs[str(reply["sandbox_id"])] = run_id
        return RemoteSandbox(self, task, reply)

    def environment_audit(self, task: Task) -> EnvironmentAudit:
        """How the service's backend will run `task` (`fidelity.environment_audit`, asked remotely)."""
        digest = self._digest(task.source_dir)
        with self._lock:
            known = digest in self._uploaded
        if not known:
            self._upload(digest, task.source_dir)
        body = {"task_digest": digest, "task": wire.task_to_json(task)}
        try:
            reply = self._request("POST", "/environment-audit", json=body)
        except UnknownTaskUpload:
            with self._lock:
                self._uploaded.discard(digest)
            self._upload(digest, task.source_dir)
            reply = self._request("POST", "/environment-audit", json=body)
        return EnvironmentAudit.from_json(reply)

    def _cancel_quietly(self, trial_id: str) -> None:
        try:
            self.cancel(trial_id)
        except SandboxServiceError:
            pass

    # ---- run-level control -------------------------------------------------------------------------

    def cancel(self, trial_or_sandbox_id: str) -> bool:
        """Cancel a trial at any point (also while its create is still waiting or running)."""
        with self._lock:
            run_id = self._runs.get(trial_or_sandbox_id)
        reply = self._request("DELETE", f"/trials/{trial_or_sandbox_id}", timeout_sec=120.0, run_id=run_id)
        return bool(reply["cancelled"])

    def leak_check(self, run_id: str) -> LeakReport:
        return _leak_report(
            self._request("POST", f"/runs/{run_id}/leak-check", timeout_sec=300.0, run_id=run_id)
        )

    def reclaim_run(self, run_id: str) -> tuple[list[str], LeakReport]:
        """Cancel every open trial of the run, then leak-check it. Returns (cancelled, report)."""
        reply = self._request("DELETE", f"/runs/{run_id}", timeout_sec=300.0, run_id=run_id)
        return list(reply["cancelled"]), _leak_report(reply)

    def cancel_run(self, run_id: str) -> list[str]:
        """Cancel every open trial of the run (what `AdmissionController.cancel_run` does, remotely)."""
        return self.reclaim_run(run_id)[0]

    def trials(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """The open trials of `run_id` (the service shows a run only its own)."""
        return list(self._request("GET", "/sandboxes", timeout_sec=30.0, run_id=run_id)["trials"])

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health", timeout_sec=30.0)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SandboxServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _leak_report(data: dict[str, Any]) -> LeakReport:
    return LeakReport(
        run_id=data["run_id"],
        unclosed_trials=tuple(data["unclosed_trials"]),
        orphaned_sandboxes=tuple(data["orphaned_sandboxes"]),
        remaining=tuple(data["remaining"]),
    )


class RemoteSandbox:
    """A sandbox on the service; implements the `Sandbox` contract over HTTP."""

    def __init__(self, client: SandboxServiceClient, task: Task, reply: dict[str, Any]):
        self._client = client
        self._task = task
        self._sandbox_id = str(reply["sandbox_id"])
        self.trial_id = str(reply["trial_id"])
        self.run_id = str(reply["run_id"])
        self.limits: TaskLimits = wire.limits_from_json(reply["limits"], "create reply limits")
        self._closed = False

    @property
    def sandbox_id(self) -> str:
        return self._sandbox_id

    @property
    def task(self) -> Task:
        return self._task

    def exec(self, command: str, timeout_sec: float) -> ExecResult:
        reply = self._client._request(
            "POST",
            f"/sandboxes/{self._sandbox_id}/exec",
            run_id=self.run_id,
            json={"command": command, "timeout_sec": timeout_sec},
            timeout_sec=_as_seconds(timeout_sec),
        )
        return wire.exec_result_from_json(reply)

    def send_keys(self, keys: str, wait_sec: float) -> TerminalRead:
        reply = self._client._request(
            "POST",
            f"/sandboxes/{self._sandbox_id}/keys",
            run_id=self.run_id,
            json={"keys": keys, "wait_sec": wait_sec},
            timeout_sec=_as_seconds(wait_sec),
        )
        return wire.terminal_read_from_json(reply)

    def verify(self) -> VerifierReport:
        longest = max(
            [self.limits.verifier_timeout_sec, *(s.limits.verifier_timeout_sec for s in self._task.steps)]
        )
        reply = self._client._request(
            "POST", f"/sandboxes/{self._sandbox_id}/verify", timeout_sec=longest, run_id=self.run_id
        )
        return wire.verifier_report_from_json(reply)

    def close(self) -> None:
        """Idempotent; a sandbox the service already reclaimed (or, after a restart of the service,
        no longer knows) counts as closed."""
        if self._closed:
            return
        try:
            self._client._request(
                "DELETE", f"/sandboxes/{self._sandbox_id}", timeout_sec=120.0, run_id=self.run_id
            )
        except UnknownSandbox:
            pass
        self._closed = True

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RemoteSandbox({self._sandbox_id}, task={self._task.task_id}, service={self._client.base_url})"
        )


def _as_seconds(value: Any) -> float:
    """A usable HTTP timeout for a request carrying `value` seconds; bad values are the server's
    to reject with a clear message, so they only need not crash here."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return 0.0
    return seconds if seconds == seconds and 0 <= seconds < 1e7 else 0.0
