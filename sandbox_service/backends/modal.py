"""Modal backend: one `modal.Sandbox` per sandbox, the same contract as the other backends.

This module owns how a task becomes a Modal sandbox: the image (`modal.Image.from_registry` for a
task's `docker_image`, `modal.Image.from_dockerfile` for a Dockerfile-only task: Modal builds it),
resources (cpu, memory), network blocking for tasks without internet, a hard lifetime (`timeout`)
of the trial's total deadline plus a margin, and tags naming the run, sandbox and task. Commands
run through `sandbox.exec` with the scripts of `backends.container`; `close()` is `terminate()`.

Credentials: `modal.App.lookup` needs a Modal token (`modal token new`, or MODAL_TOKEN_ID /
MODAL_TOKEN_SECRET). Without one it raises `modal.exception.AuthError`, which `create` reports as a
`BackendError` saying so. Nothing here is exercised against Modal's service in this repository's
tests; they drive this code through a recording stand-in for the `modal` module.

Invariants:
- Every sandbox carries tags `t1jax.run-id`, `t1jax.sandbox-id`, `t1jax.task-id`;
  `live_sandboxes` / `reap` select by them, so sandboxes of a crashed process are still found.
- Modal's own `timeout` ends every sandbox at its total deadline plus the margin, even if no t1jax
  process survives to close it.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_service.backends.container import (
    DEFAULT_OUTPUT_LIMIT_BYTES,
    ContainerSandbox,
    RunOutput,
    require_toolchain,
)
from sandbox_service.backends.kubernetes import KEEPALIVE_COMMAND, LABEL_RUN, LABEL_SANDBOX, LABEL_TASK
from sandbox_service.contracts import EnvironmentAudit, Task, UnsupportedEnvironment
from sandbox_service.errors import BackendError
from sandbox_service.fidelity import apply_common_rules, multi_step_refusal
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR


@dataclass(frozen=True)
class ModalConfig:
    app_name: str = "t1jax-sandboxes"
    environment_name: str | None = None
    region: str | None = None
    deadline_margin_sec: float = 300.0  # Modal timeout = total deadline + this
    output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES
    toolchain_dir: Path = DEFAULT_TOOLCHAIN_DIR  # the pinned pytest copied in at verify time


class ModalBackend:
    """Creates sandboxes on Modal. `modal_module` defaults to the real `modal` package (tests pass
    a recording stand-in with the same surface: App.lookup, Image.*, Sandbox.create/list)."""

    name = "modal"

    def __init__(self, config: ModalConfig | None = None, *, modal_module: Any = None):
        self.config = config or ModalConfig()
        if modal_module is None:
            import modal as modal_module  # noqa: PLC0415 - heavy import, only when real
        self.modal = modal_module
        self._app: Any = None

    def app(self) -> Any:
        if self._app is None:
            try:
                self._app = self.modal.App.lookup(
                    self.config.app_name,
                    create_if_missing=True,
                    environment_name=self.config.environment_name,
                )
            except Exception as error:
                hint = ""
                if type(error).__name__ == "AuthError":
                    hint = (
                        " (no Modal credentials: run `modal token new` "
                        "or set MODAL_TOKEN_ID/MODAL_TOKEN_SECRET)"
                    )
                raise BackendError(
                    f"looking up Modal app {self.config.app_name!r} failed{hint}: {error}"
                ) from error
        return self._app

    def image_for(self, task: Task) -> Any:
        env = task.environment
        if env.docker_image:
            return self.modal.Image.from_registry(env.docker_image)
        if env.dockerfile is not None:
            context = env.context_dir or env.dockerfile.parent
            return self.modal.Image.from_dockerfile(str(env.dockerfile), context_dir=str(context))
        raise BackendError(f"task {task.task_id} names neither a docker_image nor a Dockerfile")

    def tags(self, task: Task, *, sandbox_id: str, run_id: str) -> dict[str, str]:
        return {LABEL_RUN: run_id, LABEL_SANDBOX: sandbox_id, LABEL_TASK: task.task_id}

    def environment_audit(self, task: Task) -> EnvironmentAudit:
        """The task's own image (Modal pulls it, or builds the task's Dockerfile): nothing stands in."""
        env = task.environment
        image = env.docker_image or (f"built by Modal from {env.dockerfile.name}" if env.dockerfile else None)
        audit = EnvironmentAudit(
            task.task_id, self.name, image, (env.docker_image,) if env.docker_image else (), ()
        )
        return apply_common_rules(audit, task, internet_granted=env.allow_internet, verifies_steps=False)

    def create(self, task: Task, *, run_id: str = "default") -> ModalSandbox:
        require_toolchain(self.config.toolchain_dir)
        if task.steps:
            raise UnsupportedEnvironment(task.task_id, multi_step_refusal(self.name))
        env = task.environment
        sandbox_id = f"t1jax-sbx-{uuid.uuid4().hex[:16]}"
        app = self.app()
        try:
            handle = self.modal.Sandbox.create(
                *KEEPALIVE_COMMAND,
                app=app,
                image=self.image_for(task),
                tags=self.tags(task, sandbox_id=sandbox_id, run_id=run_id),
                env=dict(env.env) or None,
                timeout=int(math.ceil(task.limits.total_timeout_sec + self.config.deadline_margin_sec)),
                workdir=env.workdir,
                cpu=float(env.cpus),
                memory=int(env.memory_mb),
                block_network=not env.allow_internet,
                region=self.config.region,
            )
        except BackendError:
            raise
        except Exception as error:
            raise BackendError(f"creating a Modal sandbox for task {task.task_id} failed: {error}") from error
        sandbox = ModalSandbox(self, handle, sandbox_id, task)
        try:
            sandbox.prepare()
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    def _list(self, run_id: str | None) -> list[Any]:
        tags = None if run_id is None else {LABEL_RUN: run_id}
        return list(self.modal.Sandbox.list(app_id=self.app().app_id, tags=tags))

    def live_sandboxes(self, run_id: str | None = None) -> list[str]:
        """t1jax sandbox ids of the run's sandboxes that are still running."""
        return [handle.get_tags().get(LABEL_SANDBOX, handle.object_id) for handle in self._list(run_id)]

    def reap(self, run_id: str | None = None) -> list[str]:
        reaped = []
        for handle in self._list(run_id):
            name = handle.get_tags().get(LABEL_SANDBOX, handle.object_id)
            handle.terminate()
            reaped.append(name)
        return reaped


class ModalSandbox(ContainerSandbox):
    container_kind = "Modal sandbox"

    def __init__(self, backend: ModalBackend, handle: Any, sandbox_id: str, task: Task):
        super().__init__(
            sandbox_id,
            task,
            toolchain_dir=backend.config.toolchain_dir,
            output_limit_bytes=backend.config.output_limit_bytes,
        )
        self._handle = handle

    @property
    def modal_object_id(self) -> str:
        return self._handle.object_id

    def _run(self, argv: list[str], stdin: bytes, timeout_sec: float, *, as_root: bool = False) -> RunOutput:
        # Modal runs every exec as the image user; there is no other uid to choose (as_root is moot).
        process = self._handle.exec(*argv, timeout=int(math.ceil(timeout_sec)), text=False)
        if stdin:
            process.stdin.write(stdin)
        process.stdin.write_eof()
        process.stdin.drain()
        stdout = process.stdout.read()
        stderr = process.stderr.read()
        returncode = process.wait()
        # Modal reports -1 when it killed the process at `timeout`.
        return RunOutput(stdout=bytes(stdout), stderr=bytes(stderr), finished=returncode != -1)

    def _terminate(self) -> None:
        self._handle.terminate()
