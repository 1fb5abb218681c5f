"""Stand-ins for the two things that cannot run here: a Kubernetes API server (+ kubelet) and Modal.

No kube-apiserver can be installed on this machine and Modal needs credentials and network, so the
Kubernetes and Modal backends are tested against recording stand-ins placed exactly at their API
boundary:

- `FakeKubeApiServer` sits *below* the real `kubernetes` client: it replaces the REST transport of a
  real `ApiClient` (so `CoreV1Api` / `NetworkingV1Api` build the real URLs, query strings and JSON
  bodies from real model objects) and the websocket connect of the real `kubernetes.stream.stream`
  (so exec goes through the client's real URL building). It records every request.
- `FakeModal` replaces the `modal` module: `App.lookup`, `Image.*`, `Sandbox.create/list`, and
  sandbox handles with `exec` / `terminate` / `get_tags`. It records every call.

Behind both, a "container" is a `LocalContainer`: a bubblewrap sandbox with its own pid, mount, ipc,
uts (and, unless internet is allowed, network) namespace whose pid 1 is the Pod's keepalive
command; exec enters it with `nsenter`, as a container runtime does. So the bash scripts the
backends send (exec wrapper, tar copy, tmux, verifier) run for real; only the cluster is simulated.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LocalContainer:
    """A throwaway container made with bubblewrap; see the module docstring."""

    def __init__(
        self,
        command: list[str],
        *,
        workdir: str = "/app",
        env: dict[str, str] | None = None,
        network: bool = False,
        extra_ro_binds: tuple[str, ...] = (),
    ):
        read_end, write_end = os.pipe()
        argv = ["bwrap", "--unshare-pid", "--as-pid-1", "--die-with-parent", "--unshare-ipc", "--unshare-uts"]
        if not network:
            argv.append("--unshare-net")
        argv += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        for name in ("bin", "lib", "lib64", "sbin"):
            path = f"/{name}"
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        for path in extra_ro_binds:
            argv += ["--ro-bind", path, path]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "--dir",
            "/root",
            "--dir",
            workdir,
            "--chdir",
            workdir,
            "--info-fd",
            str(write_end),
            "--",
        ] + command
        self.env = {"PATH": CONTAINER_PATH, "HOME": "/root", **(env or {})}
        self._bwrap = subprocess.Popen(
            argv,
            pass_fds=(write_end,),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(write_end)
        with os.fdopen(read_end, "rb") as info:
            data = info.read()
        self.pid = json.loads(data or b"{}").get("child-pid")
        if self.pid is None:
            self._bwrap.kill()
            raise RuntimeError(f"bubblewrap did not start a container: {data!r}")
        self.killed = False
        # bwrap reports the pid before it has finished setting up the mounts; the container is
        # ready once that process has exec'd the container's command.
        give_up = time.monotonic() + 30
        while os.readlink(f"/proc/{self.pid}/exe").endswith("bwrap"):
            if time.monotonic() > give_up:
                self.kill()
                raise RuntimeError("the container never started its command")
            time.sleep(0.005)

    def alive(self) -> bool:
        if self.killed:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def spawn(self, argv: list[str]) -> subprocess.Popen:
        env_args = [f"{key}={value}" for key, value in self.env.items()]
        return subprocess.Popen(
            ["nsenter", "-t", str(self.pid), "-a", "-r", "-w", "--", "env", "-i", *env_args, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def kill(self) -> None:
        """Kill pid 1 of the container: the kernel then kills everything in its pid namespace."""
        self.killed = True
        for pid in (self.pid, self._bwrap.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._bwrap.wait(timeout=30)


def communicate(process: subprocess.Popen, stdin: bytes, timeout: float | None) -> tuple[bytes, bytes, bool]:
    """(stdout, stderr, finished); on timeout the process is killed and finished is False."""
    try:
        out, err = process.communicate(stdin, timeout=timeout)
        return out, err, True
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return out, err, False
    except (BrokenPipeError, OSError):
        out, err = process.communicate()
        return out, err, True


# --------------------------------------------------------------------------------------------------
# Kubernetes


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


class _Response:
    """What the real client reads from its REST layer (status, reason, headers, data)."""

    def __init__(self, status: int, body: Any, reason: str = ""):
        self.status = status
        self.reason = reason or {200: "OK", 201: "Created", 404: "Not Found", 409: "Conflict"}.get(status, "")
        self.data = json.dumps(body).encode()
        self.headers = {"content-type": "application/json"}

    def read(self) -> bytes:
        return self.data

    def getheaders(self) -> dict[str, str]:
        return self.headers

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass
class _FakePod:
    manifest: dict[str, Any]
    container: LocalContainer | None = None
    reads: int = 0
    phase: str = "Pending"
    reason: str | None = None
    deadline_timer: threading.Timer | None = None
    waiting_reason: str | None = None


@dataclass
class FakeKubeApiServer:
    """An in-memory API server + kubelet for pods; see the module docstring.

    `pending_reads`: reads of a new Pod that still report Pending (exercises the wait loop).
    `unpullable_prefix`: images starting with it report ErrImagePull forever.
    `extra_ro_binds`: host paths visible read-only inside every container (e.g. a Python)."""

    pending_reads: int = 1
    unpullable_prefix: str = "registry.invalid/"
    extra_ro_binds: tuple[str, ...] = ()
    requests: list[RecordedRequest] = field(default_factory=list)
    pods: dict[tuple[str, str], _FakePod] = field(default_factory=dict)
    policies: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    exec_argvs: list[list[str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- REST transport (replaces ApiClient.rest_client) ------------------------------------------

    def request(
        self,
        method: str,
        url: str,
        headers: Any = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Any = None,
    ) -> _Response:
        parsed = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qs(parsed.query)
        with self.lock:
            self.requests.append(RecordedRequest(method, parsed.path, query, body))
        parts = parsed.path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) >= 5 and parts[4] == "pods":
            namespace = parts[3]
            name = parts[5] if len(parts) > 5 else None
            if method == "POST" and name is None:
                return self._create_pod(namespace, body)
            if method == "GET" and name is None:
                return self._list_pods(namespace, query.get("labelSelector", [""])[0])
            if method == "GET" and name is not None:
                return self._read_pod(namespace, name)
            if method == "DELETE" and name is not None:
                return self._delete_pod(namespace, name)
        if (
            parts[:3] == ["apis", "networking.k8s.io", "v1"]
            and parts[-1] == "networkpolicies"
            and method == "POST"
        ):
            key = (parts[4], body["metadata"]["name"])
            with self.lock:
                if key in self.policies:
                    return _Response(
                        409, _status(409, "AlreadyExists", f"networkpolicies {key[1]} already exists")
                    )
                self.policies[key] = body
            return _Response(201, body)
        return _Response(
            404, _status(404, "NotFound", f"the fake API server has no route {method} {parsed.path}")
        )

    def _create_pod(self, namespace: str, body: dict[str, Any]) -> _Response:
        name = body["metadata"]["name"]
        with self.lock:
            if (namespace, name) in self.pods:
                return _Response(409, _status(409, "AlreadyExists", f'pods "{name}" already exists'))
        container_spec = body["spec"]["containers"][0]
        pod = _FakePod(manifest=body)
        if container_spec["image"].startswith(self.unpullable_prefix):
            pod.waiting_reason = "ErrImagePull"
        else:
            env = {item["name"]: item["value"] for item in container_spec.get("env") or []}
            isolated = body["metadata"]["labels"].get("t1jax.network") == "isolated"
            pod.container = LocalContainer(
                container_spec["command"],
                workdir=container_spec.get("workingDir", "/"),
                env=env,
                network=not isolated,
                extra_ro_binds=self.extra_ro_binds,
            )
            deadline = body["spec"].get("activeDeadlineSeconds")
            if deadline is not None:
                pod.deadline_timer = threading.Timer(
                    deadline, self._deadline_exceeded, args=(namespace, name)
                )
                pod.deadline_timer.daemon = True
                pod.deadline_timer.start()
        with self.lock:
            self.pods[(namespace, name)] = pod
        return _Response(201, self._pod_json(pod))

    def _deadline_exceeded(self, namespace: str, name: str) -> None:
        """What the kubelet does at activeDeadlineSeconds: kill the containers, phase Failed."""
        with self.lock:
            pod = self.pods.get((namespace, name))
        if pod is not None and pod.container is not None:
            pod.container.kill()
            pod.phase, pod.reason = "Failed", "DeadlineExceeded"

    def _pod_json(self, pod: _FakePod) -> dict[str, Any]:
        data = json.loads(json.dumps(pod.manifest))
        container = data["spec"]["containers"][0]
        status: dict[str, Any] = {"phase": pod.phase}
        if pod.reason:
            status["reason"] = pod.reason
        state: dict[str, Any]
        if pod.waiting_reason:
            state = {
                "waiting": {"reason": pod.waiting_reason, "message": f"cannot pull {container['image']}"}
            }
        elif pod.phase == "Running":
            state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        elif pod.phase == "Failed":
            state = {"terminated": {"exitCode": 137, "reason": pod.reason or "Error"}}
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        status["containerStatuses"] = [
            {
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": pod.phase == "Running",
                "restartCount": 0,
                "state": state,
            }
        ]
        data["status"] = status
        return data

    def _read_pod(self, namespace: str, name: str) -> _Response:
        with self.lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                return _Response(404, _status(404, "NotFound", f'pods "{name}" not found'))
            pod.reads += 1
            if pod.phase == "Pending" and pod.container is not None and pod.reads > self.pending_reads:
                pod.phase = "Running"
            return _Response(200, self._pod_json(pod))

    def _list_pods(self, namespace: str, selector: str) -> _Response:
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        with self.lock:
            items = [
                self._pod_json(pod)
                for (ns, _), pod in self.pods.items()
                if ns == namespace
                and all(pod.manifest["metadata"]["labels"].get(k) == v for k, v in wanted.items())
            ]
        return _Response(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

    def _delete_pod(self, namespace: str, name: str) -> _Response:
        with self.lock:
            pod = self.pods.pop((namespace, name), None)
        if pod is None:
            return _Response(404, _status(404, "NotFound", f'pods "{name}" not found'))
        if pod.deadline_timer is not None:
            pod.deadline_timer.cancel()
        if pod.container is not None and not pod.container.killed:
            pod.container.kill()
        return _Response(200, self._pod_json(pod))

    # ---- websocket connect (replaces kubernetes.stream.ws_client.websocket_call) -------------------

    def websocket_call(self, configuration: Any, method: str, url: str, **kwargs: Any) -> FakeExecSocket:
        from kubernetes.client.rest import ApiException

        parsed = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qs(parsed.query)
        with self.lock:
            self.requests.append(RecordedRequest(method, parsed.path, query, None))
        parts = parsed.path.strip("/").split("/")
        namespace, name = parts[3], parts[5]
        with self.lock:
            pod = self.pods.get((namespace, name))
        if pod is None or pod.container is None or not pod.container.alive():
            raise ApiException(status=0, reason=f"Handshake status 404 Not Found: pod {name}")
        argv = query["command"]
        with self.lock:
            self.exec_argvs.append(argv)
        return FakeExecSocket(pod.container.spawn(argv))

    def live_containers(self) -> int:
        with self.lock:
            return sum(1 for pod in self.pods.values() if pod.container is not None and pod.container.alive())

    def shutdown(self) -> None:
        with self.lock:
            pods = list(self.pods.values())
            self.pods.clear()
        for pod in pods:
            if pod.deadline_timer is not None:
                pod.deadline_timer.cancel()
            if pod.container is not None and not pod.container.killed:
                pod.container.kill()

    def kube_clients(self) -> tuple[Any, Any, Any]:
        """A real CoreV1Api and NetworkingV1Api over this server, and a real `stream` whose
        websocket connect lands here."""
        import functools
        import sys

        import kubernetes.stream  # noqa: F401 - registers the submodule
        from kubernetes import client

        configuration = client.Configuration(host="https://kube-apiserver.invalid:6443")
        api_client = client.ApiClient(configuration)
        api_client.rest_client = self
        stream_module = sys.modules["kubernetes.stream.stream"]
        stream_fn = functools.partial(stream_module._websocket_request, self.websocket_call, None)
        return client.CoreV1Api(api_client), client.NetworkingV1Api(api_client), stream_fn


class FakeExecSocket:
    """The parts of `kubernetes.stream.ws_client.WSClient` an exec uses (binary mode)."""

    def __init__(self, process: subprocess.Popen):
        self._process = process
        self._stdin = bytearray()
        self._channels: dict[int, bytes] = {}
        self._open = True

    def write_stdin(self, data: bytes) -> None:
        self._stdin += data

    def close_channel(self, channel: int) -> None:
        pass

    def run_forever(self, timeout: float | None = None) -> None:
        out, err, finished = communicate(self._process, bytes(self._stdin), timeout)
        self._channels = {1: out, 2: err}
        self._open = not finished

    def is_open(self) -> bool:
        return self._open

    def read_channel(self, channel: int, timeout: float = 0) -> bytes:
        return self._channels.pop(channel, b"")

    def close(self, **kwargs: Any) -> None:
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        self._open = False


# --------------------------------------------------------------------------------------------------
# Modal


class FakeAuthError(Exception):
    pass


FakeAuthError.__name__ = "AuthError"


@dataclass
class ModalCall:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _FakeStream:
    def __init__(self, process: _FakeProcess, index: int):
        self._process, self._index = process, index

    def read(self) -> bytes:
        return self._process._result()[self._index]


class _FakeStdin:
    def __init__(self, process: _FakeProcess):
        self._process = process

    def write(self, data: bytes) -> None:
        self._process.stdin_data += data

    def write_eof(self) -> None:
        self._process.eof = True

    def drain(self) -> None:
        pass


class _FakeProcess:
    def __init__(self, process: subprocess.Popen, timeout: int | None):
        self._process, self._timeout = process, timeout
        self.stdin_data = b""
        self.eof = False
        self.stdin = _FakeStdin(self)
        self.stdout = _FakeStream(self, 0)
        self.stderr = _FakeStream(self, 1)
        self._outcome: tuple[bytes, bytes, int] | None = None

    def _result(self) -> tuple[bytes, bytes, int]:
        if self._outcome is None:
            out, err, finished = communicate(self._process, self.stdin_data, self._timeout)
            self._outcome = (out, err, self._process.returncode if finished else -1)
        return self._outcome

    def wait(self) -> int:
        return self._result()[2]


class FakeModalSandbox:
    _ids = itertools.count()

    def __init__(self, owner: FakeModal, command: tuple[str, ...], kwargs: dict[str, Any]):
        self.owner = owner
        self.object_id = f"sb-fake{next(self._ids):06d}"
        self.kwargs = kwargs
        self._tags = dict(kwargs.get("tags") or {})
        self.container = LocalContainer(
            list(command),
            workdir=kwargs.get("workdir") or "/",
            env=kwargs.get("env") or {},
            network=not kwargs.get("block_network"),
            extra_ro_binds=owner.extra_ro_binds,
        )
        self.timer = threading.Timer(kwargs["timeout"], self.container.kill)
        self.timer.daemon = True
        self.timer.start()

    def exec(self, *argv: str, timeout: int | None = None, text: bool = True, **kwargs: Any) -> _FakeProcess:
        assert text is False, "the backend reads bytes"
        self.owner.record("Sandbox.exec", argv, {"timeout": timeout, "text": text, **kwargs})
        if not self.container.alive():
            raise RuntimeError(f"Sandbox {self.object_id} has terminated")  # modal's SandboxTerminatedError
        return _FakeProcess(self.container.spawn(list(argv)), timeout)

    def terminate(self) -> None:
        self.owner.record("Sandbox.terminate", (self.object_id,), {})
        self.timer.cancel()
        if not self.container.killed:
            self.container.kill()

    def get_tags(self) -> dict[str, str]:
        return dict(self._tags)


class FakeModal:
    """A recording stand-in for the `modal` module; see the module docstring."""

    def __init__(self, *, authenticated: bool = True, extra_ro_binds: tuple[str, ...] = ()):
        self.authenticated = authenticated
        self.extra_ro_binds = extra_ro_binds
        self.calls: list[ModalCall] = []
        self.sandboxes: list[FakeModalSandbox] = []
        self._lock = threading.Lock()
        owner = self

        class App:
            @staticmethod
            def lookup(name: str, **kwargs: Any) -> Any:
                owner.record("App.lookup", (name,), kwargs)
                if not owner.authenticated:
                    raise FakeAuthError("Token missing. Could not authenticate client.")
                return type("FakeApp", (), {"app_id": f"ap-{name}", "name": name})()

        class Image:
            @staticmethod
            def from_registry(tag: str, **kwargs: Any) -> Any:
                owner.record("Image.from_registry", (tag,), kwargs)
                return ("registry-image", tag)

            @staticmethod
            def from_dockerfile(path: str, **kwargs: Any) -> Any:
                owner.record("Image.from_dockerfile", (path,), kwargs)
                return ("dockerfile-image", path)

        class Sandbox:
            @staticmethod
            def create(*command: str, **kwargs: Any) -> FakeModalSandbox:
                owner.record("Sandbox.create", command, kwargs)
                sandbox = FakeModalSandbox(owner, command, kwargs)
                with owner._lock:
                    owner.sandboxes.append(sandbox)
                return sandbox

            @staticmethod
            def list(*, app_id: str | None = None, tags: dict[str, str] | None = None) -> Any:
                owner.record("Sandbox.list", (), {"app_id": app_id, "tags": tags})
                with owner._lock:
                    sandboxes = list(owner.sandboxes)
                for sandbox in sandboxes:
                    if sandbox.container.alive() and all(
                        sandbox.get_tags().get(k) == v for k, v in (tags or {}).items()
                    ):
                        yield sandbox

        self.App, self.Image, self.Sandbox = App, Image, Sandbox

    def record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with self._lock:
            self.calls.append(ModalCall(name, args, kwargs))

    def names(self) -> list[str]:
        return [call.name for call in self.calls]

    def live_containers(self) -> int:
        return sum(1 for sandbox in self.sandboxes if sandbox.container.alive())

    def shutdown(self) -> None:
        for sandbox in self.sandboxes:
            sandbox.timer.cancel()
            if not sandbox.container.killed:
                sandbox.container.kill()


def wait_until(predicate: Any, timeout: float = 30.0, interval: float = 0.05) -> bool:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
