"""Container backend: each trial in a real OCI container, run by podman, built from the task's own
Dockerfile.

This module owns the `container` `SandboxProvider` (`PodmanBackend`): turning a task into an image
(the real base image when it is present or can be pulled, otherwise a stand-in from
`base_images`, with the substitution recorded), one container per trial, the verifier as a
sibling container, and reclaiming containers by label, also after the owning process died.

Images. A task's Dockerfile is built by `podman build` with every `FROM` image resolved first:
present locally, else pulled (`pull="auto"`, once per registry until it answers), else replaced by
a stand-in (the rewritten Dockerfile is built from the task's own context, so RUN, ENV, USER,
WORKDIR, SHELL, heredocs, multi-stage builds and `COPY --from` all have Docker's semantics).
Built images are tagged `localhost/t1jax-task/<task>:<digest of Dockerfile and context>` and
reused; buildah's layer cache shares identical leading layers between tasks.

A trial's container: `podman run -d --rm` of the image with the image's ENTRYPOINT kept and the
command replaced by `sh -c 'sleep infinity'` (what Harbor's compose file does), the task's
memory (memory+swap), CPU quota and the backend's pids limit, `--network none` unless the task
allows internet and the backend grants it, the image's USER for the agent's commands (commands
the service itself runs use uid 0), a copy-on-write root, and `--timeout` = the total deadline
plus a margin, so the container dies by itself if every t1jax process is gone. Disk: with an
XFS graph root podman's own quota (`--storage-opt size=`) applies; otherwise a watchdog measures
the container's upper layer and evicts a container over `storage_mb` (as the kubelet does for
ephemeral storage). Commands go through `podman exec -i` with the scripts of
`backends.container`.

Verification leaves the agent's processes running (a service the task asked for keeps serving) and
runs the verifier in a second container that shares the trial's network namespace (localhost
reaches the service), its pid namespace (the tests see, by the pids the agent saw, and may signal
the processes the agent left running) and its live root filesystem (`podman mount`), but has its
own mount namespace and a capability the trial lacks (CAP_SYS_PTRACE: the trial's processes, seeing
the verifier's, cannot ptrace them or open their /proc/PID/root, fd or mem): /tests is a read-only
bind of a fresh host copy (checked against the task's checksums) that no process of the trial can
open, /logs/verifier a fresh host directory the trial cannot open, the pinned toolchain a
read-only bind, and the task's image *as built* (`podman image mount`, read-only) supplies the
interpreter (`verifier.find_runtime`), so nothing the agent replaced runs before the tests do.
Reports are read from the host directory.

Invariants:
- Every container carries labels naming the service, the run, the sandbox, the task and the owning
  process (boot id, pid, start time); `reap(run_id)` removes the run's containers whose owner is
  gone (or owned by this backend), so `podman ps -a --filter label=t1jax.run-id=R` is empty after
  `close`, after `reap`, and after a SIGKILL of the owner followed by `reap`.
- `create` either returns a running, prepared container or removes what it started and raises.
- Every base-image substitution of a task is in its `EnvironmentAudit` (and so in check-tasks'
  audit and the eval's results).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox_service import reports, wire
from sandbox_service.backends import _proc
from sandbox_service.backends.container import DEFAULT_OUTPUT_LIMIT_BYTES, ContainerSandbox, RunOutput
from sandbox_service.base_images import (
    DEFAULT_STAND_IN_DIR,
    LABEL_KEY,
    LABEL_RECIPE,
    StandInStore,
    Substitution,
    UnsupportedImage,
    pinned_python_requirements,
    stand_in_for,
)
from sandbox_service.contracts import (
    EnvironmentAudit,
    FailureCause,
    ImageSubstitution,
    SkipReason,
    Task,
    UnsupportedEnvironment,
    VerifierReport,
)
from sandbox_service.dockerfile import (
    FromLine,
    add_stage_args,
    from_lines,
    rewrite_from_images,
    translate_heredocs,
)
from sandbox_service.errors import BackendError, SandboxClosed, SandboxStateError
from sandbox_service.fidelity import apply_common_rules, earlier_steps_note, unresolved_hosts
from sandbox_service.host_trust import CA_MOUNT, host_ca_bundle, trust_env
from sandbox_service.locks import file_lock
from sandbox_service.steps import step_count, step_view
from sandbox_service.verifier import (
    DEFAULT_TOOLCHAIN_SUBDIR,
    IMAGE_MOUNT,
    REPORT_DIR,
    TESTS_DIR,
    TOOLCHAIN_MOUNT,
    VERIFIER_TMP,
    RuntimeNotFound,
    Toolchain,
    ToolchainMissing,
    diff_manifests,
    ensure_directory,
    find_runtime,
    manifest_of_sources,
    plan_verifier,
    provide_test_packages,
    task_tests_sources,
    tests_manifest,
)

BACKEND_NAME = "container"
MANAGED_BY = "t1jax-sandbox-service"
LABEL_MANAGED_BY = "t1jax.managed-by"
LABEL_RUN = "t1jax.run-id"
LABEL_SANDBOX = "t1jax.sandbox-id"
LABEL_TASK = "t1jax.task-id"
LABEL_OWNER = "t1jax.owner"
LABEL_ROLE = "t1jax.role"
TASK_IMAGE_REPOSITORY = "localhost/t1jax-task"
KEEPALIVE = ("sh", "-c", "sleep infinity")
VERIFIER_OUTPUT_TAIL_BYTES = 8 * 1024
DEFAULT_CACHE_DIR = Path(".cache") / "sandbox_service"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def owner_token(pid: int | None = None) -> str:
    """`<boot id>:<pid>:<start time>:<nonce>` naming one backend instance of one process: the owner
    label of the containers it creates."""
    pid = os.getpid() if pid is None else pid
    return f"{_boot_id()}:{pid}:{_proc.pid_start_time(pid)}:{uuid.uuid4().hex[:8]}"


def owner_alive(token: str) -> bool:
    """Whether the process named by an owner token is still running (on this boot)."""
    boot, pid, start, *_ = (token.split(":") + ["", "", ""])[:4]
    if boot != _boot_id() or not pid.isdigit():
        return False
    return str(_proc.pid_start_time(int(pid))) == start


def default_engine_args() -> tuple[str, ...]:
    """Global podman flags for this host: crun refuses hybrid (v1 + v2) cgroup hosts, so use runc with
    the cgroupfs manager wherever cgroup v2 is not the only hierarchy and runc is installed."""
    pure_v2 = Path("/sys/fs/cgroup/cgroup.controllers").is_file()
    if not pure_v2 and shutil.which("runc"):
        return ("--runtime", "runc", "--cgroup-manager", "cgroupfs")
    return ()


def _rlimit_flags() -> tuple[str, ...]:
    """`--ulimit` flags within this process's hard limits: podman's defaults (nofile 1048576, nproc
    4194304) need CAP_SYS_RESOURCE, which a root without it (a VM's or a container's) lacks."""
    import resource

    flags = []
    for name, limit, cap in (
        ("nofile", resource.RLIMIT_NOFILE, 1 << 20),
        ("nproc", resource.RLIMIT_NPROC, 32768),
    ):
        _, hard = resource.getrlimit(limit)
        value = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        flags += ["--ulimit", f"{name}={value}:{value}"]
    return tuple(flags)


class PodmanError(BackendError):
    """A podman command failed; the message holds its stderr."""


class StepHostLog:
    """Which built layers' RUN output named hosts that did not resolve, kept across builds.

    podman prints a step's output only when it builds the step; a later build that reuses the layer
    prints "Using cache". The hosts are kept per layer id (in `directory`, shared by every backend
    on the host like the engine's layer store; every built layer gets a record, if only `[]`), so a
    later step failing after a cached `curl ... | sh` that installed nothing is still traced to the
    unreachable host. A cached layer without a record (built before records were kept, or by
    another tool) is `unrecorded`: what its step printed is unknown."""

    _STEP = re.compile(r"^STEP \d+/\d+: ", re.MULTILINE)
    _LAYER = re.compile(r"^--> ([0-9a-f]{11,64})\s*$", re.MULTILINE)

    def __init__(self, directory: Path):
        self.directory = directory

    def earlier_steps(self, output: str) -> tuple[tuple[str, ...], bool]:
        """Hosts that the completed steps of one `podman build`'s `output` could not resolve, built
        now (recorded here) or reused from the cache (read back); and whether a reused RUN step
        had no record."""
        hosts: dict[str, None] = {}
        unrecorded = False
        for segment in self._STEP.split(output)[1:]:
            layer = self._LAYER.search(segment)
            if layer is None:  # the failing (or unfinished) step
                continue
            record = self.directory / f"{layer.group(1)[:12]}.json"
            if "--> Using cache" in segment:
                try:
                    found = tuple(json.loads(record.read_text()))
                except (OSError, ValueError):
                    found = ()
                    unrecorded = unrecorded or segment.startswith("RUN ")
            else:
                found = unresolved_hosts(segment)
                self.directory.mkdir(parents=True, exist_ok=True)
                record.write_text(json.dumps(found))
            hosts.update(dict.fromkeys(found))
        return tuple(hosts), unrecorded


class PodmanEngine:
    """The podman CLI, with this host's global flags. Every call has a timeout."""

    def __init__(
        self, binary: str = "podman", global_args: Sequence[str] | None = None, work_dir: Path | None = None
    ):
        path = shutil.which(binary)
        if path is None:
            raise BackendError(
                f"the container backend needs `{binary}` on PATH "
                "(apt-get install podman runc; `make setup` does it)"
            )
        self.binary = path
        self.global_args = tuple(default_engine_args() if global_args is None else global_args)
        self.rlimit_flags = _rlimit_flags()
        # podman's conmon drops files (e.g. `oom`) into the caller's working directory: give it its own.
        self.work_dir = Path(work_dir or DEFAULT_STAND_IN_DIR.parent / "podman-cwd")
        self.work_dir.mkdir(parents=True, exist_ok=True)

    def argv(self, *args: str) -> list[str]:
        return [self.binary, *self.global_args, *args]

    def call(self, *args: str, timeout_sec: float = 120.0, check: bool = True, stdin: bytes | None = None,
             merge_stderr: bool = False) -> subprocess.CompletedProcess:  # fmt: skip
        """Run podman `args`; `merge_stderr`: stderr interleaved into stdout (`.stderr` is b"")."""
        try:
            done = subprocess.run(
                self.argv(*args),
                input=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                timeout=timeout_sec,
                env={"PATH": _proc.DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"},
                cwd=self.work_dir,
            )
        except subprocess.TimeoutExpired as error:
            raise PodmanError(f"podman {' '.join(args[:2])} timed out after {timeout_sec:g} s") from error
        done.stderr = done.stderr or b""
        if check and done.returncode != 0:
            message = (done.stderr or done.stdout).decode("utf-8", "replace").strip()[-3000:]
            raise PodmanError(f"podman {' '.join(args[:3])} failed (exit {done.returncode}): {message}")
        return done

    def text(self, *args: str, timeout_sec: float = 120.0) -> str:
        return self.call(*args, timeout_sec=timeout_sec).stdout.decode().strip()

    def image_exists(self, ref: str) -> bool:
        return self.call("image", "exists", ref, check=False, timeout_sec=60).returncode == 0

    def inspect_image(self, ref: str) -> dict:
        return json.loads(self.text("image", "inspect", ref))[0]

    def containers(self, labels: Mapping[str, str]) -> list[dict]:
        filters = [arg for key, value in labels.items() for arg in ("--filter", f"label={key}={value}")]
        return json.loads(self.text("ps", "-a", "--format", "json", *filters) or "[]")

    def remove(self, name: str) -> bool:
        """Kill and remove a container now (True if it existed)."""
        done = self.call("rm", "-f", "-t", "0", name, check=False, timeout_sec=120)
        return done.returncode == 0 and bool(done.stdout.strip())


@dataclass(frozen=True)
class ResolvedBase:
    """One `FROM` image and what is used for it: the image itself (`source` "local" or "pulled") or a
    stand-in (`source` "stand-in", `substitution` set)."""

    requested: str
    used: str
    source: str
    substitution: Substitution | None = None


@dataclass(frozen=True)
class PreparedImage:
    """A task's image, ready to run. `config` is podman's image Config (Env, User, WorkingDir...)."""

    tag: str
    image_id: str
    config: Mapping
    bases: tuple[ResolvedBase, ...]

    @property
    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config.get("Env") or [] if "=" in item)

    @property
    def user(self) -> str:
        return self.config.get("User") or ""

    @property
    def substitutions(self) -> tuple[Substitution, ...]:
        return tuple(base.substitution for base in self.bases if base.substitution is not None)


@dataclass(frozen=True)
class PodmanConfig:
    """Options of the container backend. `pull`: "auto" (use a local copy, else pull, else a
    stand-in), "never" (local copy or stand-in), "always" (pull first; stand-in only if that fails).
    `allow_internet` grants the network to tasks that allow it (off: every container is offline).
    `engine_args` None picks this host's (`default_engine_args`). `insecure_registries` (host:port)
    are pulled from over plain HTTP (a registry on localhost, as the tests start one)."""

    cache_dir: Path = DEFAULT_CACHE_DIR
    toolchain_dir: Path | None = None
    stand_in_dir: Path | None = None
    engine: str = "podman"
    engine_args: tuple[str, ...] | None = None
    pull: str = "auto"
    pull_timeout_sec: float = 300.0
    allow_internet: bool = False
    build_network: bool = True
    build_timeout_sec: float = 1800.0
    pids_max: int = 1024
    deadline_margin_sec: float = 300.0
    output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES
    disk_check_interval_sec: float = 5.0
    registry_retry_sec: float = 600.0
    insecure_registries: tuple[str, ...] = ()


class PodmanBackend:
    """`SandboxProvider` running each trial in a podman container (see the module docstring)."""

    name = BACKEND_NAME

    def __init__(self, config: PodmanConfig | None = None, **options):
        config = config or PodmanConfig(**options)
        self.config = config
        self.cache_dir = Path(config.cache_dir).resolve()
        self.toolchain_dir = Path(config.toolchain_dir or self.cache_dir / DEFAULT_TOOLCHAIN_SUBDIR).resolve()
        self.state_dir = self.cache_dir / "container-sandboxes"
        self.build_dir = self.cache_dir / "container-builds"
        self.engine = PodmanEngine(config.engine, config.engine_args, self.cache_dir / "podman-cwd")
        self.stand_ins = StandInStore(config.stand_in_dir or DEFAULT_STAND_IN_DIR)
        # Next to the stand-ins: layer ids are global to the engine's store, not to one cache dir.
        self._step_hosts = StepHostLog(self.stand_ins.directory / "podman-step-hosts")
        self.owner = owner_token()
        self._sandboxes: dict[str, PodmanSandbox] = {}
        self._lock = threading.Lock()
        self._build_locks: dict[str, threading.Lock] = {}
        self._unreachable: dict[str, float] = {}  # registry -> when a pull last failed
        self._storage_quota = self._backing_fs_is_xfs()
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="container-sandboxes", daemon=True)
        self._watchdog.start()

    # -- images ------------------------------------------------------------------------------------

    def resolve_base(self, image: str, *, python_pins: tuple[str, ...] = ()) -> ResolvedBase:
        """What runs for base image `image` (see `PodmanConfig.pull`); raises `UnsupportedImage`.
        `python_pins`: what the task's Dockerfile pip-installs (`base_images.stand_in_for`)."""
        if self.config.pull != "always" and self.engine.image_exists(image):
            if not self._is_stand_in(image):
                return ResolvedBase(image, image, "local")
        if self.config.pull != "never" and self._try_pull(image):
            return ResolvedBase(image, image, "pulled")
        recipe, substitution = stand_in_for(image, python_pins=python_pins)
        if not self.engine.image_exists(recipe.image_tag):
            built = self.stand_ins.build(recipe)
            changes = [f"ENV {key}={value}" for key, value in recipe.env]
            changes += [
                f"CMD {json.dumps(list(recipe.cmd))}",
                f"LABEL {LABEL_RECIPE}={recipe.name}",
                f"LABEL {LABEL_KEY}={recipe.key}",
            ]
            args = ["import", *(arg for change in changes for arg in ("--change", change))]
            self.engine.call(*args, str(built.tarball), recipe.image_tag, timeout_sec=900)
        return ResolvedBase(image, recipe.image_tag, "stand-in", substitution)

    def _is_stand_in(self, image: str) -> bool:
        labels = (self.engine.inspect_image(image).get("Config") or {}).get("Labels") or {}
        return LABEL_RECIPE in labels

    def _try_pull(self, image: str) -> bool:
        registry = image.split("/", 1)[0] if "/" in image and "." in image.split("/", 1)[0] else "docker.io"
        failed_at = self._unreachable.get(registry)
        if failed_at is not None and time.monotonic() - failed_at < self.config.registry_retry_sec:
            return False
        insecure = ("--tls-verify=false",) if registry in self.config.insecure_registries else ()
        done = self.engine.call(
            "pull", "--quiet", *insecure, image, check=False, timeout_sec=self.config.pull_timeout_sec
        )
        if done.returncode == 0:
            return True
        self._unreachable[registry] = time.monotonic()
        return False

    def _dockerfile_text(self, task: Task) -> str:
        """The task's Dockerfile, with RUN heredocs translated for this engine's builder."""
        try:
            return translate_heredocs(task.environment.dockerfile.read_text(encoding="utf-8"))
        except ValueError as error:
            raise UnsupportedEnvironment(
                task.task_id, f"{task.environment.dockerfile.name} {error}"
            ) from error

    def task_bases(self, task: Task) -> list[FromLine]:
        spec = task.environment
        if spec.dockerfile is None:
            return []
        try:
            return from_lines(spec.dockerfile.read_text(encoding="utf-8"))
        except ValueError as error:
            raise UnsupportedEnvironment(task.task_id, f"{spec.dockerfile.name}: {error}") from error

    def resolve_task(self, task: Task) -> tuple[ResolvedBase, ...]:
        """Every base image of the task resolved (stand-ins built and imported where needed)."""
        spec = task.environment
        if spec.dockerfile is None:
            if not spec.docker_image:
                raise UnsupportedEnvironment(task.task_id, "no Dockerfile and no docker_image")
            return (self._resolve(task, spec.docker_image),)
        images = dict.fromkeys(line.image for line in self.task_bases(task) if line.image is not None)
        return tuple(self._resolve(task, image) for image in images)

    def _resolve(self, task: Task, image: str) -> ResolvedBase:
        dockerfile = task.environment.dockerfile
        pins = pinned_python_requirements(dockerfile.read_text(encoding="utf-8")) if dockerfile else ()
        try:
            return self.resolve_base(image, python_pins=pins)
        except UnsupportedImage as error:
            raise UnsupportedEnvironment(task.task_id, f"base image {image!r}: {error.reason}") from error

    def prepare(self, task: Task) -> PreparedImage:
        """The task's image: built from its Dockerfile (once per Dockerfile and context), or its
        `docker_image` (or that image's stand-in). Raises `UnsupportedEnvironment`/`BackendError`."""
        bases = self.resolve_task(task)
        spec = task.environment
        if spec.dockerfile is None:
            tag = bases[0].used
        else:
            used = {base.requested: base.used for base in bases}
            dockerfile = rewrite_from_images(self._dockerfile_text(task), used)
            if self.config.build_network and host_ca_bundle() is not None:
                dockerfile = add_stage_args(dockerfile, trust_env())  # see host_trust
            context = spec.context_dir or spec.dockerfile.parent
            digest = hashlib.sha256(
                json.dumps([dockerfile, wire.task_digest(context), self.config.build_network]).encode()
            ).hexdigest()[:20]
            tag = f"{TASK_IMAGE_REPOSITORY}/{_slug(task.task_id)}:{digest}"
            self._build(task, tag, dockerfile, context)
        info = self.engine.inspect_image(tag)
        return PreparedImage(tag, info["Id"], info.get("Config") or {}, bases)

    def _build(self, task: Task, tag: str, dockerfile: str, context: Path) -> None:
        if self.engine.image_exists(tag):
            return
        with self._lock:
            lock = self._build_locks.setdefault(tag, threading.Lock())
        self.build_dir.mkdir(parents=True, exist_ok=True)
        with lock, file_lock(self.build_dir / f"{tag.rsplit(':', 1)[-1]}.lock"):
            if self.engine.image_exists(tag):
                return
            with tempfile.TemporaryDirectory(dir=self.build_dir) as scratch:
                path = Path(scratch) / "Dockerfile"
                path.write_text(dockerfile)
                bundle = host_ca_bundle() if self.config.build_network else None
                args = [
                    "build",
                    "--pull=never",
                    "--layers",
                    "--force-rm",  # no build container left behind by a failed step
                    "-f",
                    str(path),
                    "-t",
                    tag,
                    *self.engine.rlimit_flags,
                    *(() if self.config.build_network else ("--network", "none")),
                    *(("--volume", f"{bundle}:{CA_MOUNT}:ro") if bundle else ()),
                    "--label",
                    f"{LABEL_TASK}={task.task_id}",
                    str(context),
                ]
                for cache in ((), ("--no-cache",)):
                    try:  # a RUN step's stderr (curl's, apt's errors) in order with its step's stdout
                        done = self.engine.call(
                            *args[:1], *cache, *args[1:], timeout_sec=self.config.build_timeout_sec,
                            check=False, merge_stderr=True,
                        )  # fmt: skip
                    except PodmanError as error:
                        raise BackendError(
                            f"task {task.task_id!r}: building its Dockerfile failed: {error}"
                        ) from error
                    output = done.stdout.decode("utf-8", "replace").strip()
                    earlier, unrecorded = self._step_hosts.earlier_steps(output)
                    if done.returncode == 0:
                        return
                    # The failing step's output, then podman's line naming the step.
                    tail = output[-3000:]
                    if unrecorded and not earlier and not unresolved_hosts(tail):
                        continue  # a reused step's output is unknown: build once more, uncached
                    break
                earlier = tuple(host for host in earlier if host not in unresolved_hosts(tail))
                raise BackendError(
                    f"task {task.task_id!r}: building its Dockerfile failed "
                    f"(exit {done.returncode}): {tail}{earlier_steps_note(earlier)}"
                )

    # -- audit ---------------------------------------------------------------------------------------

    def environment_audit(self, task: Task) -> EnvironmentAudit:
        """How this backend runs `task` (resolves base images; builds nothing but stand-in roots)."""
        spec = task.environment

        def skipped(reason: SkipReason, detail: str, requested: tuple[str, ...] = ()) -> EnvironmentAudit:
            return EnvironmentAudit(task.task_id, BACKEND_NAME, None, requested, (), reason, detail)

        try:
            if spec.dockerfile is not None:
                self._dockerfile_text(task)
                requested = tuple(dict.fromkeys(line.image for line in self.task_bases(task) if line.image))
            else:
                requested = (spec.docker_image,) if spec.docker_image else ()
        except UnsupportedEnvironment as error:
            return skipped(SkipReason.UNSUPPORTED_DOCKERFILE, error.reason)
        try:
            bases = self.resolve_task(task)
        except UnsupportedEnvironment as error:
            return skipped(SkipReason.UNSUPPORTED_IMAGE, error.reason, requested)
        substitutions = tuple(
            ImageSubstitution(b.requested, b.used, b.substitution.differences)
            for b in bases
            if b.substitution
        )
        if spec.dockerfile is None:
            image = bases[0].used
        else:
            image = f"{TASK_IMAGE_REPOSITORY}/{_slug(task.task_id)} (built from {spec.dockerfile.name})"
        sources = ", ".join(f"{b.requested}: {b.source}" for b in bases)
        audit = EnvironmentAudit(task.task_id, BACKEND_NAME, image, requested, substitutions, None, sources)
        return apply_common_rules(audit, task, internet_granted=self.config.allow_internet)

    # -- SandboxProvider ------------------------------------------------------------------------------

    def check_environment(self, task: Task) -> None:
        """Raise `UnsupportedEnvironment` if a base image can neither be had nor stood in for."""
        for line in self.task_bases(task):
            if line.image is not None:
                try:
                    stand_in_for(line.image)
                except UnsupportedImage as error:
                    if not self.engine.image_exists(line.image):
                        raise UnsupportedEnvironment(task.task_id, error.reason) from error

    def create(self, task: Task, *, run_id: str = "default") -> PodmanSandbox:
        if self._closed.is_set():
            raise SandboxStateError("this container backend is closed")
        try:
            toolchain = Toolchain.at(self.toolchain_dir)
        except ToolchainMissing as error:
            raise BackendError(str(error)) from error
        prepared = self.prepare(task)
        sandbox = PodmanSandbox(self, task, prepared, run_id, toolchain)
        with self._lock:
            self._sandboxes[sandbox.sandbox_id] = sandbox
        try:
            sandbox.start()
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    def labels(self, run_id: str, sandbox_id: str, task: Task, role: str) -> dict[str, str]:
        return {
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_RUN: run_id,
            LABEL_SANDBOX: sandbox_id,
            LABEL_TASK: task.task_id,
            LABEL_OWNER: self.owner,
            LABEL_ROLE: role,
        }

    def live_sandboxes(self, run_id: str | None = None) -> list[str]:
        """Sandbox ids with a container (any state, any owner) of this service, of `run_id` or all."""
        return sorted({c["Labels"][LABEL_SANDBOX] for c in self._containers(run_id)})

    def own_containers(self) -> list[str]:
        """Names of the containers (any state) this backend instance created and has not removed."""
        containers = self.engine.containers({LABEL_MANAGED_BY: MANAGED_BY, LABEL_OWNER: self.owner})
        return sorted(name for c in containers for name in c.get("Names") or [])

    def reap(self, run_id: str | None = None) -> list[str]:
        """Remove the run's containers that this backend owns or whose owning process is gone;
        containers of another live process are left alone. Returns the sandbox ids reaped."""
        reaped = set()
        for container in self._containers(run_id):
            labels = container.get("Labels") or {}
            sandbox_id = labels.get(LABEL_SANDBOX, "")
            with self._lock:
                mine = self._sandboxes.get(sandbox_id)
            if mine is not None:
                mine.close()
            elif labels.get(LABEL_OWNER) != self.owner and owner_alive(labels.get(LABEL_OWNER, "")):
                continue
            else:
                for name in container.get("Names") or []:
                    self.engine.remove(name)
                shutil.rmtree(self.state_dir / sandbox_id, ignore_errors=True)
            reaped.add(sandbox_id)
        return sorted(reaped)

    def _containers(self, run_id: str | None) -> list[dict]:
        labels = {LABEL_MANAGED_BY: MANAGED_BY, **({LABEL_RUN: run_id} if run_id is not None else {})}
        return [c for c in self.engine.containers(labels) if LABEL_SANDBOX in (c.get("Labels") or {})]

    def close(self) -> None:
        """Close every sandbox this backend created. Idempotent."""
        self._closed.set()
        with self._lock:
            sandboxes = list(self._sandboxes.values())
        for sandbox in sandboxes:
            sandbox.close()

    def __enter__(self) -> PodmanBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._sandboxes.pop(sandbox_id, None)

    # -- disk watchdog ---------------------------------------------------------------------------------

    def _backing_fs_is_xfs(self) -> bool:
        try:
            info = json.loads(self.engine.text("info", "--format", "json"))
        except (BackendError, json.JSONDecodeError):
            return False
        status = (info.get("store") or {}).get("graphStatus") or {}
        return status.get("Backing Filesystem", "").lower() == "xfs"

    def _watch(self) -> None:
        while not self._closed.wait(self.config.disk_check_interval_sec):
            if self._storage_quota:
                continue
            with self._lock:
                sandboxes = list(self._sandboxes.values())
            for sandbox in sandboxes:
                try:
                    sandbox.check_disk()
                except Exception:  # a sandbox closing under us; the next round sees it gone
                    continue


class PodmanSandbox(ContainerSandbox):
    """One trial's container (see the module docstring). exec/send_keys come from `ContainerSandbox`."""

    container_kind = "container"

    def __init__(self, backend: PodmanBackend, task: Task, prepared: PreparedImage, run_id: str,
                 toolchain: Toolchain):  # fmt: skip
        sandbox_id = f"sbx-{uuid.uuid4().hex[:16]}"
        super().__init__(
            sandbox_id,
            task,
            toolchain_dir=toolchain.directory,
            output_limit_bytes=backend.config.output_limit_bytes,
        )
        self._backend = backend
        self._prepared = prepared
        self._toolchain = toolchain
        self.run_id = run_id
        self.name = f"t1jax-{sandbox_id}"
        self.verifier_name = f"{self.name}-verify"
        self.state_path = backend.state_dir / sandbox_id
        self._tests_manifests = [manifest_of_sources(step_view(task, i)) for i in range(step_count(task))]
        self.step = 0  # the current step of a multi-step task (see `Sandbox.verify`)
        self._evicted: str | None = None
        self._upper_dir: str | None = None
        self._workdir = _workdir(task, prepared)
        spec = task.environment
        self._network = "none"
        if spec.allow_internet and backend.config.allow_internet:
            self._network = "bridge"

    @property
    def image(self) -> PreparedImage:
        return self._prepared

    @property
    def workdir(self) -> str:
        return self._workdir

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        backend, task, spec = self._backend, self._task, self._task.environment
        self.state_path.mkdir(parents=True, exist_ok=True)
        labels = backend.labels(self.run_id, self.sandbox_id, task, "agent")
        lifetime = int(task.limits.total_timeout_sec + backend.config.deadline_margin_sec)
        args = [
            "run",
            "-d",
            "--rm",
            "--name",
            self.name,
            *(arg for key, value in labels.items() for arg in ("--label", f"{key}={value}")),
            "--network",
            self._network,
            "--hostname",
            "sandbox",
            "--memory",
            f"{spec.memory_mb}m",
            "--memory-swap",
            f"{spec.memory_mb}m",
            "--cpus",
            f"{spec.cpus:g}",
            "--pids-limit",
            str(backend.config.pids_max),
            *backend.engine.rlimit_flags,
            "--timeout",
            str(lifetime),
            *(("--storage-opt", f"size={spec.storage_mb}m") if backend._storage_quota else ()),
            *(arg for key, value in sorted(spec.env.items()) for arg in ("--env", f"{key}={value}")),
            *self._trust_flags(),
            self._prepared.tag,
            *KEEPALIVE,
        ]
        backend.engine.call(*args, timeout_sec=300)
        self.prepare()

    def _trust_flags(self) -> list[str]:
        """With the network granted behind a TLS-inspecting proxy, the host's CAs (see host_trust)."""
        bundle = host_ca_bundle() if self._network != "none" else None
        if bundle is None:
            return []
        return [
            "-v",
            f"{bundle}:{CA_MOUNT}:ro",
            *(a for k, v in trust_env().items() for a in ("--env", f"{k}={v}")),
        ]

    def prepare(self) -> None:
        """The directories Harbor tasks expect (owned by the image's user), and a working bash."""
        # The workdir as `docker run -w` would: created if the image lacks it (podman's -w refuses).
        script = (
            f"mkdir -p {shlex.quote(self._workdir)} /logs/agent /logs/verifier /logs/artifacts "
            "/tmp/.t1jax && "
            "chmod 1777 /tmp/.t1jax && echo T1JAX_READY"
        )
        output = self._run(["bash", "-c", script], b"", 120.0, as_root=True)
        if b"T1JAX_READY" not in output.stdout:
            raise BackendError(
                f"container {self.name} runs, but a bash script failed in it (the image needs bash, "
                f"coreutils and tar): {output.stderr[-1000:].decode('utf-8', 'replace')}"
            )
        if self._prepared.user not in ("", "root", "0", "0:0"):
            user = self._prepared.user
            chown = f"chown {user} /logs/agent /logs/artifacts 2>/dev/null; true"
            self._run(["bash", "-c", chown], b"", 60.0, as_root=True)

    def _run(self, argv: list[str], stdin: bytes, timeout_sec: float, *, as_root: bool = False) -> RunOutput:
        engine = self._backend.engine
        args = engine.argv("exec", "-i", *(("--user", "0") if as_root else ()), self.name, *argv)
        try:
            done = subprocess.run(
                args,
                input=stdin,
                capture_output=True,
                timeout=timeout_sec,
                env={"PATH": _proc.DEFAULT_PATH, "HOME": "/root"},
                cwd=engine.work_dir,
            )
        except subprocess.TimeoutExpired as error:
            return RunOutput(error.stdout or b"", error.stderr or b"", finished=False)
        if (
            done.returncode in (125, 126, 127)
            and b"Error:" in done.stderr
            and b"T1JAX_END" not in done.stdout
        ):
            if self._evicted:
                raise SandboxClosed(f"sandbox {self.sandbox_id} was evicted: {self._evicted}")
            if self.closed:
                raise SandboxClosed(f"sandbox {self.sandbox_id} is closed")
            raise BackendError(
                f"podman exec in {self.name} failed: {done.stderr.decode('utf-8', 'replace')[-2000:]}"
            )
        return RunOutput(done.stdout, done.stderr, finished=True)

    def _terminate(self) -> None:
        engine = self._backend.engine
        engine.remove(self.verifier_name)
        engine.remove(self.name)
        shutil.rmtree(self.state_path, ignore_errors=True)
        self._backend._forget(self.sandbox_id)

    def check_disk(self) -> None:
        """Evict the container if its writable layer outgrew the task's storage_mb."""
        if self.closed or self._evicted:
            return
        if self._upper_dir is None:
            upper = self._backend.engine.text(
                "inspect", "--format", "{{.GraphDriver.Data.UpperDir}}", self.name
            )
            self._upper_dir = upper or ""
        if not self._upper_dir:
            return
        done = subprocess.run(["du", "-sxb", self._upper_dir], capture_output=True, text=True, timeout=60)
        used = int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout else 0
        limit = self._task.environment.storage_mb << 20
        if used > limit:
            self._evicted = f"its writable layer grew to {used >> 20} MiB, over the task's {limit >> 20} MiB"
            self._backend.engine.remove(self.name)

    # -- verification -----------------------------------------------------------------------------------

    def verify(self) -> VerifierReport:
        """Run the task's verifier in a sibling container (see the module docstring); the trial's own
        processes keep running."""
        if self._verified:
            raise SandboxStateError(f"verify() was already called for sandbox {self.sandbox_id}")
        if self.closed:
            raise SandboxClosed(f"cannot verify: sandbox {self.sandbox_id} is closed")
        self._verified = True
        if self._evicted:
            return VerifierReport(
                (), False, FailureCause.SANDBOX_ERROR, None, None, f"evicted: {self._evicted}"
            )
        try:
            return self._verify()
        except SandboxClosed:
            raise
        except (BackendError, RuntimeNotFound, OSError) as error:
            if self.closed:
                raise SandboxClosed(f"verify interrupted: sandbox {self.sandbox_id} was closed") from error
            return VerifierReport((), False, FailureCause.SANDBOX_ERROR, None, None, str(error))
        finally:
            if not self.closed and self.step + 1 < step_count(self._task):  # the next step's agent phase
                self.step += 1
                self._verified = False

    def _verify(self) -> VerifierReport:
        task, engine = step_view(self._task, self.step), self._backend.engine
        verify_dir = self.state_path / "verify"
        shutil.rmtree(verify_dir, ignore_errors=True)
        tests, logs, scratch = verify_dir / "tests", verify_dir / "logs", verify_dir / "tmp"
        for directory in (tests, logs, scratch):
            directory.mkdir(parents=True)
        logs.chmod(0o777)
        scratch.chmod(0o1777)
        for source, name in task_tests_sources(task):
            if source.is_dir():
                shutil.copytree(source, tests, dirs_exist_ok=True, symlinks=True)
            else:
                shutil.copy2(source, tests / name)
        problems = diff_manifests(self._tests_manifests[self.step], tests_manifest(tests))
        if problems:
            detail = "tests differ from the task's at create time: " + ", ".join(problems[:10])
            return VerifierReport((), False, FailureCause.TESTS_TAMPERED, None, None, detail)
        image_root = engine.text("image", "mount", self._prepared.image_id)
        rootfs = None
        try:
            rootfs = engine.text("mount", self.name)
            ensure_directory(Path(rootfs), "logs/verifier")
            env = {**self._prepared.env, **task.environment.env, **task.verifier_env, "HOME": "/root"}
            runtime = find_runtime(Path(image_root), search_path=env.get("PATH", _proc.DEFAULT_PATH))
            plan = provide_test_packages(plan_verifier(task, env, runtime), self._toolchain, runtime)
            env_file = verify_dir / "env"
            env_file.write_text("".join(f"{key}={value}\n" for key, value in plan.env.items()))
            mounts = [
                (str(tests), TESTS_DIR, "ro"),
                (str(logs), REPORT_DIR, "rw"),
                (str(self._toolchain.directory), TOOLCHAIN_MOUNT, "ro"),
                (image_root, IMAGE_MOUNT, "ro"),
                (str(scratch), VERIFIER_TMP, "rw"),
                *((h, m, "ro") for h, m in runtime.host_mounts),
            ]
            spec = task.environment
            labels = self._backend.labels(self.run_id, self.sandbox_id, task, "verifier")
            args = [
                "run",
                "--rm",
                "--name",
                self.verifier_name,
                *(arg for key, value in labels.items() for arg in ("--label", f"{key}={value}")),
                "--network",
                f"container:{self.name}",
                # The trial's pid namespace, so the tests see (and may signal) what the agent left
                # running. CAP_SYS_PTRACE, which the trial's container lacks, keeps the verifier's
                # processes out of the trial's reach: ptrace and /proc/PID/{root,fd,mem,environ}
                # need the target's capabilities to be a subset of the caller's.
                "--pid",
                f"container:{self.name}",
                "--cap-add",
                "SYS_PTRACE",
                "--user",
                "0:0",
                "--workdir",
                self._workdir,
                "--memory",
                f"{spec.memory_mb}m",
                "--memory-swap",
                f"{spec.memory_mb}m",
                "--pids-limit",
                str(self._backend.config.pids_max),
                *engine.rlimit_flags,
                "--env-file",
                str(env_file),
                *(arg for host, target, mode in mounts for arg in ("-v", f"{host}:{target}:{mode}")),
                "--rootfs",
                rootfs,
                *plan.argv,
            ]
            run = _proc.run_captured(
                engine.argv(*args),
                env={"PATH": _proc.DEFAULT_PATH, "HOME": "/root"},
                timeout_sec=task.limits.verifier_timeout_sec,
                head_bytes=64 * 1024,
                tail_bytes=4 << 20,
                on_timeout=lambda proc: (engine.remove(self.verifier_name), proc.kill()),
                cwd=str(engine.work_dir),
            )
        finally:
            if rootfs is not None:
                engine.call("umount", self.name, check=False)
            engine.call("image", "umount", self._prepared.image_id, check=False)
        output = run.stdout + "\n" + run.stderr
        if run.exit_code in (125, 126, 127) and "Error: " in run.stderr and not any(logs.iterdir()):
            return VerifierReport(
                (),
                False,
                FailureCause.SANDBOX_ERROR,
                None,
                None,
                f"the verifier container did not run: {run.stderr.strip()[-1500:]}",
                output_tail=output[-VERIFIER_OUTPUT_TAIL_BYTES:],
            )
        report = reports.build_report(
            report_dir=logs, output=output, exit_code=run.exit_code, timed_out=run.timed_out, detail=plan.note
        )
        return _with_output(report, output)


def _with_output(report: VerifierReport, output: str) -> VerifierReport:
    import dataclasses

    return dataclasses.replace(report, output_tail=output[-VERIFIER_OUTPUT_TAIL_BYTES:])


def _workdir(task: Task, prepared: PreparedImage) -> str:
    """task.toml's workdir if it names one, else the image's WORKDIR, else the task's default."""
    spec = task.environment
    if spec.workdir_from == "task.toml":
        return spec.workdir
    return prepared.config.get("WorkingDir") or spec.workdir


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "task"
