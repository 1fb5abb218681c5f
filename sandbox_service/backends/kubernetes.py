"""Kubernetes backend: one Pod per sandbox, driven through the official `kubernetes` client.

This module owns the Pod manifest of a sandbox and the calls that manage its life: create the Pod
from the task's image and resource limits, wait until its container runs (with a deadline and fast
failure on image-pull errors), exec through the websocket stream API, copy files as tar over exec
(see `backends.container`), and delete with grace period 0. Every Pod carries labels naming the run,
the sandbox and the task, so `reap(run_id)` (and a garbage collector after a crash) can find and
delete leaked Pods by label alone.

Defences against leaks that do not depend on this process staying alive:
- `activeDeadlineSeconds` = the trial's total deadline + a margin: the kubelet kills the container
  even if every t1jax process is gone;
- `reap(run_id)` / `python -m sandbox_service reap --backend kubernetes` deletes by label.

Isolation: `automountServiceAccountToken: false`, no service links, no privilege escalation; a Pod
whose task disallows internet is labelled `t1jax.network=isolated` and the backend ensures a
NetworkPolicy in the namespace that denies all ingress and egress for that label (enforced only
when the cluster's CNI implements NetworkPolicy, e.g. Calico or Cilium).

Images: `[environment].docker_image` if the task names one; otherwise a Dockerfile-only task maps to
`<image_registry>/<task slug>:<context digest>`, which a build step must have pushed (see README).

Invariants:
- Label values are valid Kubernetes label values (`label_value`), a deterministic function of the
  id, so selection by run id finds exactly the Pods created for it; the exact ids are annotations.
- `create` either returns a sandbox whose Pod runs, or deletes the Pod it created and raises.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_service import wire
from sandbox_service.backends.container import (
    DEFAULT_OUTPUT_LIMIT_BYTES,
    ContainerSandbox,
    RunOutput,
    require_toolchain,
)
from sandbox_service.contracts import EnvironmentAudit, SkipReason, Task, UnsupportedEnvironment
from sandbox_service.errors import BackendError
from sandbox_service.fidelity import apply_common_rules, multi_step_refusal
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR

MANAGED_BY = "t1jax-sandbox-service"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_RUN = "t1jax.run-id"
LABEL_SANDBOX = "t1jax.sandbox-id"
LABEL_TASK = "t1jax.task-id"
LABEL_NETWORK = "t1jax.network"
CONTAINER_NAME = "sandbox"
ISOLATION_POLICY_NAME = "t1jax-sandbox-isolated"
# The container's main process only keeps the Pod alive; work arrives through exec.
KEEPALIVE_COMMAND = ["/bin/sh", "-c", "while :; do sleep 86400; done"]
# Container waiting reasons that will not resolve by waiting longer.
FATAL_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "ErrImageNeverPull",
        "RunContainerError",
    }
)

_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def label_value(text: str) -> str:
    """A valid label value (<= 63 chars of [A-Za-z0-9_.-], alphanumeric at both ends) naming text.
    Valid ids map to themselves; others get a readable prefix plus a hash of the full id."""
    if len(text) <= 63 and _LABEL_VALUE.fullmatch(text):
        return text
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:50].strip("-_.")
    suffix = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{readable}-{suffix}" if readable else suffix


def slug(text: str) -> str:
    """A lowercase DNS-1123-ish name part (for image repository names)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "task"


@dataclass(frozen=True)
class RegistryImages:
    """Maps a task to the container image a Pod should run.

    A task that names `[environment].docker_image` runs it as is. A task with only a Dockerfile runs
    `<registry>/<task slug>:<first 16 hex of the build context's digest>`: the tag changes exactly when
    the build context does, so a build step can push each task's image once and never re-push.
    With a `publisher` (`sandbox_service.registry.ImagePublisher`: anything with `image_for(task)`)
    the image is built and pushed here, and the Pod names it by the digest the registry stored."""

    registry: str | None = None
    publisher: Any = None

    def image_for(self, task: Task) -> str:
        env = task.environment
        if env.docker_image:
            return env.docker_image
        if env.dockerfile is None:
            raise BackendError(f"task {task.task_id} names neither a docker_image nor a Dockerfile")
        if self.publisher is not None:
            return self.publisher.image_for(task)
        if not self.registry:
            raise BackendError(
                f"task {task.task_id} has only a Dockerfile ({env.dockerfile}); "
                "remote backends need a pushed "
                "image: build it, push it, and pass --image-registry so it maps to "
                f"{self.image_name_hint(task)}"
            )
        return f"{self.registry.rstrip('/')}/{self.repository_and_tag(task)}"

    @staticmethod
    def repository_and_tag(task: Task) -> str:
        context = task.environment.context_dir or (
            task.environment.dockerfile.parent if task.environment.dockerfile else task.source_dir
        )
        return f"t1jax-task-{slug(task.task_id)}:{wire.task_digest(context)[:16]}"

    def image_name_hint(self, task: Task) -> str:
        return f"{self.registry or '<registry>'}/{self.repository_and_tag(task)}"


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str = "t1jax-sandboxes"
    image_registry: str | None = None
    pod_ready_timeout_sec: float = 600.0
    poll_interval_sec: float = 0.5
    deadline_margin_sec: float = 300.0  # activeDeadlineSeconds = total deadline + this
    runtime_class_name: str | None = None  # e.g. "gvisor" for a stronger boundary
    service_account_name: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    image_pull_secrets: tuple[str, ...] = ()
    manage_network_policy: bool = True
    output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES
    toolchain_dir: Path = DEFAULT_TOOLCHAIN_DIR  # the pinned pytest copied in at verify time


def _api_status(error: Exception) -> int | None:
    return getattr(error, "status", None)


class KubernetesBackend:
    """Creates sandboxes as Pods. `core_api` / `networking_api` default to clients built from the
    in-cluster service account or the local kubeconfig; `stream_fn` defaults to
    `kubernetes.stream.stream` (tests pass recording stand-ins for these three only)."""

    name = "kubernetes"

    def __init__(
        self,
        config: KubernetesConfig | None = None,
        *,
        core_api: Any = None,
        networking_api: Any = None,
        stream_fn: Callable[..., Any] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        image_publisher: Any = None,
    ):
        """`image_publisher` builds and pushes Dockerfile-only tasks' images (`RegistryImages`)."""
        self.config = config or KubernetesConfig()
        self.images = RegistryImages(self.config.image_registry, image_publisher)
        if core_api is None:
            core_api, networking_api = _default_apis()
        self.core_api = core_api
        self.networking_api = networking_api
        if stream_fn is None:
            from kubernetes.stream import stream as stream_fn  # noqa: PLC0415 - heavy import, only when real
        self._stream = stream_fn
        self._sleep = sleep
        self._policy_ready = not self.config.manage_network_policy

    # ---- manifests ---------------------------------------------------------------------------------

    def pod_manifest(self, task: Task, *, sandbox_id: str, run_id: str) -> Any:
        from kubernetes import client  # noqa: PLC0415

        env = task.environment
        quantities = {
            "cpu": f"{env.cpus:g}",
            "memory": f"{env.memory_mb}Mi",
            "ephemeral-storage": f"{env.storage_mb}Mi",
        }
        labels = {
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_RUN: label_value(run_id),
            LABEL_SANDBOX: label_value(sandbox_id),
            LABEL_TASK: label_value(task.task_id),
            LABEL_NETWORK: "internet" if env.allow_internet else "isolated",
        }
        container = client.V1Container(
            name=CONTAINER_NAME,
            image=self.images.image_for(task),
            command=KEEPALIVE_COMMAND,
            working_dir=env.workdir,
            env=[client.V1EnvVar(name=key, value=value) for key, value in sorted(env.env.items())] or None,
            resources=client.V1ResourceRequirements(requests=dict(quantities), limits=dict(quantities)),
            security_context=client.V1SecurityContext(allow_privilege_escalation=False, privileged=False),
            stdin=False,
            tty=False,
        )
        spec = client.V1PodSpec(
            containers=[container],
            restart_policy="Never",
            automount_service_account_token=False,
            enable_service_links=False,
            termination_grace_period_seconds=0,
            active_deadline_seconds=int(task.limits.total_timeout_sec + self.config.deadline_margin_sec),
            hostname="sandbox",
            runtime_class_name=self.config.runtime_class_name,
            service_account_name=self.config.service_account_name,
            node_selector=dict(self.config.node_selector) or None,
            tolerations=[client.V1Toleration(**dict(t)) for t in self.config.tolerations] or None,
            image_pull_secrets=[client.V1LocalObjectReference(name=n) for n in self.config.image_pull_secrets]
            or None,
        )
        return client.V1Pod(
            api_version="v1",
            kind="Pod",
            metadata=client.V1ObjectMeta(
                name=sandbox_id,
                namespace=self.config.namespace,
                labels=labels,
                annotations={LABEL_RUN: run_id, LABEL_TASK: task.task_id},
            ),
            spec=spec,
        )

    def network_policy_manifest(self) -> Any:
        """Deny all ingress and egress for Pods labelled `t1jax.network=isolated`."""
        from kubernetes import client  # noqa: PLC0415

        return client.V1NetworkPolicy(
            api_version="networking.k8s.io/v1",
            kind="NetworkPolicy",
            metadata=client.V1ObjectMeta(
                name=ISOLATION_POLICY_NAME,
                namespace=self.config.namespace,
                labels={LABEL_MANAGED_BY: MANAGED_BY},
            ),
            spec=client.V1NetworkPolicySpec(
                pod_selector=client.V1LabelSelector(match_labels={LABEL_NETWORK: "isolated"}),
                policy_types=["Ingress", "Egress"],
                ingress=[],
                egress=[],
            ),
        )

    def run_selector(self, run_id: str | None) -> str:
        selector = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
        return selector if run_id is None else f"{selector},{LABEL_RUN}={label_value(run_id)}"

    # ---- SandboxProvider ---------------------------------------------------------------------------

    def environment_audit(self, task: Task) -> EnvironmentAudit:
        """The image the Pod runs (the task's own: the cluster pulls it, nothing stands in), or why
        the task cannot run here (a Dockerfile-only task without an image registry)."""
        base = (task.environment.docker_image,) if task.environment.docker_image else ()
        try:
            image = self.images.image_for(task)
        except BackendError as error:
            return EnvironmentAudit(
                task.task_id, self.name, None, base, (), SkipReason.UNSUPPORTED_IMAGE, str(error)
            )
        audit = EnvironmentAudit(task.task_id, self.name, image, base, (), None, "pulled by the cluster")
        internet = task.environment.allow_internet
        return apply_common_rules(audit, task, internet_granted=internet, verifies_steps=False)

    def create(self, task: Task, *, run_id: str = "default") -> KubernetesSandbox:
        require_toolchain(self.config.toolchain_dir)
        if task.steps:
            raise UnsupportedEnvironment(task.task_id, multi_step_refusal(self.name))
        self._ensure_network_policy(task)
        sandbox_id = f"t1jax-sbx-{uuid.uuid4().hex[:16]}"
        pod = self.pod_manifest(task, sandbox_id=sandbox_id, run_id=run_id)
        namespace = self.config.namespace
        try:
            self.core_api.create_namespaced_pod(namespace=namespace, body=pod)
        except Exception as error:
            raise BackendError(
                f"creating pod {sandbox_id} for task {task.task_id} failed: {error}"
            ) from error
        sandbox = KubernetesSandbox(self, sandbox_id, task)
        try:
            self._wait_running(sandbox_id)
            sandbox.prepare()
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    def live_sandboxes(self, run_id: str | None = None) -> list[str]:
        """Sandbox ids of this run's Pods that still run or wait to (not yet being deleted)."""
        pods = self.core_api.list_namespaced_pod(
            namespace=self.config.namespace, label_selector=self.run_selector(run_id)
        )
        return [
            pod.metadata.name
            for pod in pods.items
            if pod.metadata.deletion_timestamp is None
            and (pod.status is None or pod.status.phase not in ("Succeeded", "Failed"))
        ]

    def reap(self, run_id: str | None = None) -> list[str]:
        """Delete every Pod of the run (any phase: finished Pods are garbage too); returns names."""
        pods = self.core_api.list_namespaced_pod(
            namespace=self.config.namespace, label_selector=self.run_selector(run_id)
        )
        deleted = []
        for pod in pods.items:
            if self.delete_pod(pod.metadata.name):
                deleted.append(pod.metadata.name)
        return deleted

    # ---- Pod plumbing --------------------------------------------------------------------------------

    def delete_pod(self, name: str) -> bool:
        """Delete with grace 0; False if it was already gone."""
        try:
            self.core_api.delete_namespaced_pod(
                name=name,
                namespace=self.config.namespace,
                grace_period_seconds=0,
                propagation_policy="Background",
            )
            return True
        except Exception as error:
            if _api_status(error) == 404:
                return False
            raise BackendError(f"deleting pod {name} failed: {error}") from error

    def _ensure_network_policy(self, task: Task) -> None:
        if self._policy_ready or task.environment.allow_internet:
            return
        if self.networking_api is None:
            raise BackendError(
                "a task without internet needs the isolation NetworkPolicy, but no networking API was given"
            )
        try:
            self.networking_api.create_namespaced_network_policy(
                namespace=self.config.namespace, body=self.network_policy_manifest()
            )
        except Exception as error:
            if _api_status(error) != 409:  # 409: it already exists, which is what we want
                raise BackendError(
                    f"creating NetworkPolicy {ISOLATION_POLICY_NAME} failed: {error}"
                ) from error
        self._policy_ready = True

    def _wait_running(self, name: str) -> None:
        deadline = time.monotonic() + self.config.pod_ready_timeout_sec
        delay = min(0.1, self.config.poll_interval_sec)
        last_note = "no status yet"
        while True:
            pod = self.core_api.read_namespaced_pod(name=name, namespace=self.config.namespace)
            status = pod.status
            phase = status.phase if status is not None else None
            if phase in ("Failed", "Succeeded"):
                raise BackendError(
                    f"pod {name} ended before it ran ({phase}: {status.reason or ''} {status.message or ''})"
                )
            for container in (status.container_statuses or []) if status is not None else []:
                waiting = container.state.waiting if container.state is not None else None
                if waiting is not None and waiting.reason in FATAL_WAITING_REASONS:
                    raise BackendError(
                        f"pod {name} cannot start its container: {waiting.reason}: {waiting.message or ''}"
                    )
                if (
                    phase == "Running"
                    and container.name == CONTAINER_NAME
                    and container.state.running is not None
                ):
                    return
            for condition in (status.conditions or []) if status is not None else []:
                if condition.status == "False" and condition.message:
                    last_note = f"{condition.type}: {condition.reason}: {condition.message}"
            if time.monotonic() >= deadline:
                raise BackendError(
                    f"pod {name} was not running within {self.config.pod_ready_timeout_sec:g}s "
                    f"(phase {phase}; {last_note})"
                )
            self._sleep(delay)
            delay = min(delay * 2, self.config.poll_interval_sec)

    def exec_in_pod(self, name: str, argv: list[str], stdin: bytes, timeout_sec: float) -> RunOutput:
        """Run argv in the sandbox container over the exec websocket (v4/v5 channel protocol)."""
        ws = self._stream(
            self.core_api.connect_get_namespaced_pod_exec,
            name,
            self.config.namespace,
            container=CONTAINER_NAME,
            command=argv,
            stdin=True,
            stdout=True,
            stderr=True,
            tty=False,
            _preload_content=False,
            binary=True,
        )
        try:
            if stdin:
                ws.write_stdin(stdin)
            ws.close_channel(0)  # EOF on stdin under the v5 protocol; a no-op under v4
            ws.run_forever(timeout=timeout_sec)
            finished = not ws.is_open()
            stdout = ws.read_channel(1) or b""
            stderr = ws.read_channel(2) or b""
        finally:
            ws.close()
        return RunOutput(stdout=bytes(stdout), stderr=bytes(stderr), finished=finished)


class KubernetesSandbox(ContainerSandbox):
    """One Pod. `verify()` and the other calls come from `ContainerSandbox`."""

    container_kind = "pod"

    def __init__(self, backend: KubernetesBackend, pod_name: str, task: Task):
        super().__init__(
            pod_name,
            task,
            toolchain_dir=backend.config.toolchain_dir,
            output_limit_bytes=backend.config.output_limit_bytes,
        )
        self._backend = backend

    def _run(self, argv: list[str], stdin: bytes, timeout_sec: float, *, as_root: bool = False) -> RunOutput:
        # The pod's container runs as its image user; exec cannot choose another (as_root is moot).
        return self._backend.exec_in_pod(self.sandbox_id, argv, stdin, timeout_sec)

    def _terminate(self) -> None:
        self._backend.delete_pod(self.sandbox_id)


def _default_apis() -> tuple[Any, Any]:
    from kubernetes import client, config  # noqa: PLC0415

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as error:
            raise BackendError(
                "the kubernetes backend found neither an in-cluster service account nor a kubeconfig "
                f"(KUBECONFIG or ~/.kube/config): {error}"
            ) from error
    return client.CoreV1Api(), client.NetworkingV1Api()
