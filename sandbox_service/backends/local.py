"""Local backend: bubblewrap sandboxes on this host that behave like a container and hold a hostile agent.

This module owns the `local` `SandboxProvider`: creating, driving, verifying and reclaiming
sandboxes with bubblewrap, Linux namespaces and cgroups (v1 or v2), without a container engine.

Isolation design (one sandbox):
- Identity. The sandbox runs in its own user namespace mapping uids and gids 0..65535 to host
  `SANDBOX_UID_BASE` + 0..65535 (made by the holder, handed to bwrap with `--userns`). Inside,
  root is uid 0 and `useradd`, `chown 1000`, `tar -x` of other users' files and setuid switches
  (su, sudo, apt's `_apt`) work as in a container; on the host every one of those ids is
  unprivileged and owns nothing outside the sandbox's own files. Commands run as the image's `USER`
  (root by default) with Docker's default capability set (dropped with the image's own `setpriv`;
  an agent that replaced it keeps every capability of its user namespace, which reaches nothing
  beyond it). All sandboxes share that uid range (their root filesystems are pre-shifted copies of
  the stand-in bases); they cannot name each other's processes (separate pid namespaces) or reach
  each other's files (separate mount namespaces); per-uid kernel counters (inotify instances,
  keyrings) are shared.
- Namespaces. Own pid namespace (`ps` shows only the sandbox), ipc, uts (hostname `sandbox`), mount,
  and a network namespace holding only loopback unless the task allows internet *and* the backend
  was created with `allow_internet=True` (then the host network namespace is shared).
- Filesystem. A holder process (`_holder.py`, root, in a private mount namespace of its own) mounts
  the sandbox's root: a writable overlay whose lower layers are the task's built environment
  (`envbuild`: Dockerfile layers over a Debian stand-in of its base image, never the host's root)
  and whose upper layer lives on a tmpfs of the task's `storage_mb` (the disk cap, for every write
  anywhere in the root; its pages also count against the sandbox's memory limit). So `/etc`,
  `/usr/local`, `/opt`, `/var/log`, `/solution` are writable copy-on-write, as in a container.
  `/dev/shm` is a 64 MiB tmpfs; /etc/hosts and /etc/hostname are the sandbox's own.
- Resources. One cgroup (v2) or one per controller (v1: memory, pids, freezer, cpu) per sandbox,
  nested under the service's own: memory limit = task `memory_mb` (memory+swap too), `pids.max` =
  backend `pids_max`, CPU quota = task `cpus`. Every process of the sandbox joins before it execs.
- Processes. The holder spawns the sandbox's init (`bwrap ... sh -c 'sleep infinity'`, or the
  image's ENTRYPOINT with that as its command) into the cgroups and waits until it reports ready.
  Each `exec` is a fresh `bash -c` (not a login shell: the image's ENV PATH survives) entered into
  the init's namespaces with nsenter, in its own session; at the command's deadline the whole
  session is killed. Background processes survive until `close` or the trial deadline, *also
  through verification* (a service the task asked for keeps serving the verifier).
- Interactive terminal. `send_keys` drives a tmux server started inside the sandbox (entered the
  same way as `exec`), running an interactive non-login bash.
- Verification. `verify` copies the task's tests into a fresh directory of the holder's staging
  tree, checks them against the checksums taken at `create`, and runs the verifier as a new bwrap
  sandbox that shares the sandbox's network namespace (localhost reaches the agent's services) and
  sees its live root, but has its own user namespace (same id mapping, so the agent's capabilities
  do not reach it) and mount namespace, and runs in the pid namespace *above* the agent's: the
  agent's pid namespace is a child of one the holder made for the sandbox (its init is bwrap's
  outer process), so the verifier sees, and may signal, every process the agent left running, by
  the pids the agent saw (`_align_pids`: both namespaces allocate in step), while the agent's
  processes cannot see the verifier's at all. /tests (read-only), /logs/verifier (fresh)
  and the toolchain exist only there, and the interpreter is the environment's *pristine* copy
  (mounted read-only; `verifier.find_runtime`), so nothing the agent replaced runs before the
  tests. `sandbox_service.verifier` says what it executes; `sandbox_service.reports` how its
  report is read.
- Reclamation. `close` kills the init, a running verifier's session and the cgroups' members,
  ends the holder (its mount namespace, and with it every tmpfs and overlay of the sandbox,
  disappears), removes the cgroups and the state directory.
  If the service dies, each holder sees EOF on its stdin and kills its sandbox by itself; `reap`
  then removes the leftover cgroups and state (state records hold pids with start times, cgroup
  paths and the run id).

Invariants:
- `LocalBackend` is safe to use from many threads; each `LocalSandbox` serializes its lifecycle
  transitions (exec may run concurrently with exec, never with verify or close).
- After `close` (or `reap`) no process, cgroup, mount or state directory of the sandbox remains.
- `create` raises `UnsupportedEnvironment` before starting any process if the task's environment
  is outside the Dockerfile subset, and leaves nothing behind when it fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from enum import Enum
from pathlib import Path

from sandbox_service.backends import _proc
from sandbox_service.backends._cgroup import CgroupHierarchy, CgroupUnavailable, SandboxCgroups
from sandbox_service.backends._proc import DEFAULT_PATH, HOLDER_COMMAND, HolderProcess, require_tool
from sandbox_service.base_images import DEFAULT_STAND_IN_DIR, StandInStore, stand_in_for
from sandbox_service.contracts import (
    EnvironmentAudit,
    ExecResult,
    FailureCause,
    ImageSubstitution,
    SandboxDeadlineExpired,
    SandboxError,
    SandboxLifecycleError,
    SkipReason,
    Task,
    TerminalRead,
    UnsupportedEnvironment,
    VerifierReport,
)
from sandbox_service.envbuild import (
    DOCKER_CAPABILITIES,
    SANDBOX_UID_BASE,
    SANDBOX_UID_COUNT,
    BuiltEnvironment,
    EnvironmentBuilder,
    check_environment,
    resolve_user,
    stack_file,
    user_home,
)
from sandbox_service.fidelity import apply_common_rules
from sandbox_service.host_trust import CA_MOUNT, host_ca_bundle, trust_env
from sandbox_service.reports import build_report
from sandbox_service.steps import step_count, step_view
from sandbox_service.verifier import (
    DEFAULT_TOOLCHAIN_SUBDIR,
    IMAGE_MOUNT,
    TOOLCHAIN_MOUNT,
    VERIFIER_TMP,
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

BACKEND_NAME = "local"
DEFAULT_CACHE_DIR = Path(".cache") / "sandbox_service"
STAGING = "/run/t1jax"
TMUX_SOCKET = "/tmp/.t1jax-tmux.sock"
TMUX_SESSION = "main"
TERMINAL_COLUMNS, TERMINAL_ROWS = 160, 40
VERIFIER_OUTPUT_TAIL_BYTES = 8 * 1024
LOG_DIRS = ("/logs/agent", "/logs/verifier", "/logs/artifacts")  # what Harbor gives every container
_TMUX_KEYS = frozenset(
    {
        "Enter",
        "Escape",
        "Tab",
        "BSpace",
        "Up",
        "Down",
        "Left",
        "Right",
        "Home",
        "End",
        "PageUp",
        "PageDown",
        "Space",
        "DC",
        "IC",
        "NPage",
        "PPage",
        "BTab",
    }
)
_BOUNDING_SET = "-all," + ",".join("+" + cap.removeprefix("CAP_").lower() for cap in DOCKER_CAPABILITIES)


class _State(Enum):
    RUNNING = "running"
    VERIFYING = "verifying"
    VERIFIED = "verified"
    EXPIRED = "expired"
    CLOSED = "closed"


class LocalBackend:
    """`SandboxProvider` running bubblewrap sandboxes on this host (see the module docstring).

    `cache_dir` holds built environments (`envs/`, `layers/`), sandbox state (`sandboxes/`) and, by
    default, the verifier toolchain (created by `python -m sandbox_service.verifier --setup`);
    stand-in base roots live in `stand_in_dir` (default: the user's shared
    `base_images.DEFAULT_STAND_IN_DIR`). `allow_internet=False` keeps every sandbox off the network
    whatever its task says; `build_network` lets Dockerfile RUN steps reach package registries.

    Needs root on a host with cgroup v1 (memory, pids, freezer, cpu) or cgroup v2 (memory, pids),
    bubblewrap >= 0.8, util-linux (nsenter, setpriv, unshare) and, to build stand-in bases,
    mmdebstrap; `send_keys` needs tmux in the environment (every stand-in has it).
    """

    name = BACKEND_NAME

    def __init__(
        self,
        *,
        cache_dir: str | Path | None = None,
        toolchain_dir: str | Path | None = None,
        allow_internet: bool = False,
        build_network: bool = True,
        pids_max: int = 1024,
        max_output_bytes: int = 1 << 20,
        terminal_read_bytes: int = 10_000,
        build_timeout_sec: float = 1800.0,
        shm_mb: int = 64,
        watchdog_interval_sec: float = 0.5,
        cgroups: CgroupHierarchy | None = None,
        stand_in_dir: str | Path | None = None,
    ):
        self.cache_dir = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).resolve()
        self.toolchain_dir = Path(toolchain_dir or self.cache_dir / DEFAULT_TOOLCHAIN_SUBDIR).resolve()
        self.state_dir = self.cache_dir / "sandboxes"
        self.allow_internet = allow_internet
        self.pids_max = pids_max
        self.max_output_bytes = max_output_bytes
        self.terminal_read_bytes = terminal_read_bytes
        self.shm_mb = shm_mb
        try:
            self.cgroups = cgroups or CgroupHierarchy.detect()
        except CgroupUnavailable as error:
            raise SandboxError(f"the local backend cannot limit sandboxes on this host: {error}") from error
        stand_ins = StandInStore(stand_in_dir or DEFAULT_STAND_IN_DIR)
        self.builder = EnvironmentBuilder(
            self.cache_dir, stand_ins=stand_ins, network=build_network, build_timeout_sec=build_timeout_sec
        )
        self.tools = {name: require_tool(name) for name in ("bwrap", "nsenter", "setpriv", "unshare")}
        self._sandboxes: dict[str, LocalSandbox] = {}
        self._creating: dict[str, LocalSandbox] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch_deadlines, args=(watchdog_interval_sec,), name="sandbox-deadlines", daemon=True
        )
        self._watchdog.start()

    # -- SandboxProvider --------------------------------------------------------------------------

    def check_environment(self, task: Task) -> None:
        """Raise `UnsupportedEnvironment` if this backend cannot build `task` (a static check)."""
        check_environment(task)

    def environment_audit(self, task: Task) -> EnvironmentAudit:
        """How this backend runs `task`: always on a stand-in of its base image (it cannot pull)."""
        base = task.environment.docker_image or ""
        try:
            plan = check_environment(task)
        except UnsupportedEnvironment as error:
            if "base image" in error.reason:  # nothing stands in for it: no backend here runs it
                reason, detail = SkipReason.UNSUPPORTED_IMAGE, error.reason
            else:  # beyond the local builder's subset: `podman build` may build it
                reason, detail = (
                    SkipReason.UNSUPPORTED_DOCKERFILE,
                    f"{error.reason} (--backend container may run it)",
                )
            return EnvironmentAudit(
                task.task_id, BACKEND_NAME, None, (base,) if base else (), (), reason, detail
            )
        recipe, substitution = stand_in_for(plan.base_image, python_pins=plan.python_pins)
        image = f"{recipe.name} stand-in root" + (
            f" + {len(plan.steps)} Dockerfile steps" if plan.steps else ""
        )
        audit = EnvironmentAudit(
            task.task_id,
            BACKEND_NAME,
            image,
            (plan.base_image,),
            (ImageSubstitution(plan.base_image, recipe.image_tag, substitution.differences),),
            None,
            "the local backend always runs a stand-in root of the base image",
        )
        return apply_common_rules(audit, task, internet_granted=self.allow_internet)

    def create(self, task: Task, *, run_id: str = "default") -> LocalSandbox:
        """Build (or reuse) the task's environment and start a sandbox for one trial."""
        if self._closed.is_set():
            raise SandboxLifecycleError("this LocalBackend is closed")
        environment = self.builder.build(task)  # UnsupportedEnvironment before anything starts
        try:
            toolchain = Toolchain.at(self.toolchain_dir)
        except ToolchainMissing as error:
            raise SandboxError(str(error)) from error
        sandbox = LocalSandbox(self, task, environment, run_id)
        with self._lock:
            self._creating[sandbox.sandbox_id] = sandbox
        launched = False
        try:
            sandbox._launch(toolchain)
            launched = True
        finally:
            with self._lock:
                del self._creating[sandbox.sandbox_id]
                if launched:
                    self._sandboxes[sandbox.sandbox_id] = sandbox
        return sandbox

    def live_sandboxes(self, run_id: str | None = None) -> list[str]:
        """Ids of sandboxes with state under this cache dir (this process's or a dead one's), of `run_id`."""
        return [
            meta["sandbox_id"]
            for meta in self._state_records()
            if run_id is None or meta.get("run_id") == run_id
        ]

    def reap(self, run_id: str | None = None) -> list[str]:
        """Kill and remove the sandboxes left behind (of `run_id`, or all); return their ids.

        That is every sandbox this backend created and has not closed, and every sandbox under this
        cache dir whose owning process is gone. Sandboxes of another live process sharing the cache
        dir (their holder is alive) and sandboxes still being created here are left alone.
        """
        reaped = []
        for meta in self._state_records():
            if run_id is not None and meta.get("run_id") != run_id:
                continue
            sandbox_id = meta["sandbox_id"]
            with self._lock:
                sandbox = self._sandboxes.get(sandbox_id)
                creating = sandbox_id in self._creating
            if sandbox is not None:
                sandbox.close()
            elif creating or _holder_alive(meta):
                continue
            else:
                _reap_record(self.state_dir / sandbox_id, meta)
            reaped.append(sandbox_id)
        return reaped

    def close(self) -> None:
        """Close every sandbox this backend created and stop its deadline watchdog. Idempotent."""
        self._closed.set()
        with self._lock:
            sandboxes = list(self._sandboxes.values())
        for sandbox in sandboxes:
            sandbox.close()
        self.cgroups.remove_parents_if_empty()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._sandboxes.pop(sandbox_id, None)

    def _state_records(self) -> list[dict]:
        records = []
        if not self.state_dir.is_dir():
            return records
        for entry in sorted(self.state_dir.iterdir()):
            try:
                records.append(json.loads((entry / "meta.json").read_text()))
            except (OSError, json.JSONDecodeError):
                records.append({"sandbox_id": entry.name})  # half-created: still reapable
        return records

    def _watch_deadlines(self, interval: float) -> None:
        while not self._closed.wait(interval):
            with self._lock:
                sandboxes = list(self._sandboxes.values())
            now = time.monotonic()
            for sandbox in sandboxes:
                if now >= sandbox.total_deadline:
                    sandbox._expire()


class LocalSandbox:
    """One live trial sandbox of a `LocalBackend` (see the `Sandbox` protocol for the lifecycle)."""

    def __init__(self, backend: LocalBackend, task: Task, environment: BuiltEnvironment, run_id: str):
        self._backend = backend
        self._task = task
        self._environment = environment
        self.run_id = run_id
        self._id = f"sbx-{uuid.uuid4().hex[:16]}"
        self._state = _State.RUNNING
        self._lock = threading.Lock()
        self._active_execs = 0
        self._idle = threading.Condition(self._lock)
        self._holder: HolderProcess | None = None
        self.cgroups: SandboxCgroups | None = None
        self.init_pid: int | None = None
        self._init_start: int | None = None
        self._terminal_started = False
        self._terminal_seen = ""
        self._terminal_lock = threading.Lock()
        self._tests_manifests: list[dict[str, str]] = []  # one a step
        self.step = 0  # the current step of a multi-step task (see `Sandbox.verify`)
        self.created_at = time.monotonic()
        self.agent_deadline = self.created_at + task.limits.agent_timeout_sec
        self.total_deadline = self.created_at + task.limits.total_timeout_sec
        self.state_path = backend.state_dir / self._id
        self._network_shared = task.environment.allow_internet and backend.allow_internet
        # task.toml's workdir if it names one, else the Dockerfile's final WORKDIR (Docker's "/" without one).
        self.workdir = (
            task.environment.workdir if task.environment.workdir_from == "task.toml" else environment.workdir
        )
        self._exec_sessions: set[int] = set()
        # The running verifier's session: it has a pid namespace of its own, so the init's death
        # does not end it, and it joins the cgroups only after it starts (a close in between would
        # miss it): `_release` kills this session too, and a verifier starting after the close
        # kills itself (`_track_verifier`).
        self._verifier_session: int | None = None
        self.uid = self.gid = 0
        self.env: dict[str, str] = {}
        self._setpriv: str | None = None

    # -- Sandbox protocol -------------------------------------------------------------------------

    @property
    def sandbox_id(self) -> str:
        return self._id

    @property
    def task(self) -> Task:
        return self._task

    @property
    def environment(self) -> BuiltEnvironment:
        return self._environment

    @property
    def holder_pid(self) -> int | None:
        return self._holder.pid if self._holder else None

    @property
    def host_root(self) -> Path:
        """The sandbox's live root as the host sees it (for tests and debugging)."""
        return Path(f"/proc/{self.holder_pid}/root{STAGING}/root")

    def exec(self, command: str, timeout_sec: float) -> ExecResult:
        timeout = self._begin_agent_call(timeout_sec)
        try:
            run = self._run_inside(["/bin/bash", "-c", command], timeout)
        finally:
            self._end_agent_call()
        exit_code = run.exit_code
        if (
            exit_code is not None and exit_code < 0
        ):  # nsenter re-raises a fatal signal: report it as a shell does
            exit_code = 128 - exit_code
        return ExecResult(
            stdout=run.stdout,
            stderr=run.stderr,
            exit_code=exit_code,
            timed_out=run.timed_out,
            duration_sec=run.duration_sec,
            stdout_omitted_bytes=run.stdout_omitted_bytes,
            stderr_omitted_bytes=run.stderr_omitted_bytes,
        )

    def send_keys(self, keys: str, wait_sec: float) -> TerminalRead:
        """Type `keys` into the sandbox's tmux session (160x40), wait, return the new output.

        `keys` is literal text, each newline sent as Enter; a string that is exactly one tmux key
        name (`C-c`, `C-d`, `Escape`, `Up`, ...) is sent as that key. The read returns the text
        added since the previous read, or the whole visible screen when earlier text changed
        (a full-screen program, `clear`).
        """
        wait = self._begin_agent_call(wait_sec)
        try:
            with self._terminal_lock:
                self._ensure_terminal()
                self._tmux(_tmux_key_commands(keys))
                if wait > 0:
                    time.sleep(wait)
                return self._read_terminal()
        finally:
            self._end_agent_call()

    def verify(self) -> VerifierReport:
        with self._lock:
            self._check_usable()
            if self._state in (_State.VERIFYING, _State.VERIFIED):
                raise SandboxLifecycleError(f"sandbox {self._id}: verify() already ran for its last step")
            self._state = _State.VERIFYING
            while self._active_execs:  # a concurrent exec is being killed below; wait for it to return
                self._stop_agent_calls()
                self._idle.wait(timeout=0.1)
        try:
            return self._verify()
        except Exception as error:  # a bug or host failure, not something the agent did
            return VerifierReport(
                (), False, FailureCause.SANDBOX_ERROR, None, None, f"{type(error).__name__}: {error}"
            )
        finally:
            with self._lock:
                if self._state == _State.VERIFYING:
                    self._state = _State.VERIFIED
                    if self.step + 1 < step_count(self._task):  # the next step's agent phase
                        self.step += 1
                        self._state = _State.RUNNING
                        agent_sec = step_view(self._task, self.step).limits.agent_timeout_sec
                        self.agent_deadline = min(self.total_deadline, time.monotonic() + agent_sec)

    def close(self) -> None:
        with self._lock:
            if self._state == _State.CLOSED:
                return
            previous, self._state = self._state, _State.CLOSED
        if previous != _State.EXPIRED:
            self._release()
        self._backend._forget(self._id)

    # -- lifecycle internals ------------------------------------------------------------------------

    def _launch(self, toolchain: Toolchain) -> None:
        """Record, limit and start the sandbox; on any failure undo everything and re-raise."""
        task, backend = self._task, self._backend
        try:
            self._tests_manifests = [
                manifest_of_sources(step_view(task, index)) for index in range(step_count(task))
            ]
            self.state_path.mkdir(parents=True)
            self.cgroups = backend.cgroups.planned(self._id)  # recorded before they exist
            self._write_meta()
            spec = task.environment
            self.cgroups = backend.cgroups.create(
                self._id, memory_bytes=spec.memory_mb << 20, pids_max=backend.pids_max, cpus=spec.cpus
            )
            stack = self._environment.lower_stack
            self.uid, self.gid = resolve_user(stack, self._environment.user)
            self.env = _sandbox_env(
                task, self._environment, user_home(stack, self.uid), self.uid, self._network_shared
            )
            self._setpriv = next(
                (f"/{p}" for p in ("usr/bin/setpriv", "bin/setpriv") if stack_file(stack, p)), None
            )
            entrypoint = " ".join(f'"${i + 1}"' for i in range(len(self._environment.entrypoint)))
            init = "echo ready >&{ready_fd}; exec {ready_fd}>&-; exec " + (
                f"{entrypoint} sh -c 'sleep infinity'" if entrypoint else "sleep infinity"
            )
            spawn = {
                "argv": [
                    backend.tools["bwrap"],
                    "--userns",
                    "{userns_fd}",
                    *self._bwrap_args(verifier=False),
                    "--info-fd",
                    "{info_fd}",
                    "--",
                    "/bin/sh",
                    "-c",
                    init,
                    "sh",
                    *self._environment.entrypoint,
                ],  # fmt: skip
                "env": self.env,
                "uid": SANDBOX_UID_BASE,
                "gid": SANDBOX_UID_BASE,
                "cgroup_procs": self.cgroups.procs_files,
                "userns": "agent",
                "pid_namespace": True,  # the verifier's: the agent's is a child of it (see `_verify`)
            }
            self._holder = HolderProcess.start(backend.tools["unshare"], self._holder_ops(toolchain), spawn)
            self.init_pid = self._holder.child["child-pid"]
            self._init_start = _proc.pid_start_time(self.init_pid)
            self._write_meta()
            self._align_pids()
        except BaseException:
            self._release()
            raise
        self.created_at = time.monotonic()  # deadlines count from a running sandbox, not the build
        self.agent_deadline = self.created_at + task.limits.agent_timeout_sec
        self.total_deadline = self.created_at + task.limits.total_timeout_sec

    def _write_meta(self) -> None:
        holder = self._holder
        meta = {
            "sandbox_id": self._id,
            "run_id": self.run_id,
            "task_id": self._task.task_id,
            "created_at": time.time(),
            "cgroups": self.cgroups.to_json() if self.cgroups else {},
            "holder_pid": holder.pid if holder else None,
            "holder_start": _proc.pid_start_time(holder.pid) if holder else None,
            "init_pid": self.init_pid,
            "init_start": self._init_start,
        }
        temporary = self.state_path / "meta.json.tmp"
        temporary.write_text(json.dumps(meta))
        temporary.replace(self.state_path / "meta.json")

    def _holder_ops(self, toolchain: Toolchain) -> list[dict]:
        spec, environment = self._task.environment, self._environment
        disk = f"{STAGING}/disk"
        lower = ":".join(str(path) for path in environment.lower_stack)
        inodes = max(16384, spec.storage_mb * 64)
        base = SANDBOX_UID_BASE
        return [
            {
                "op": "mount",
                "source": f"t1jax-staging-{self._id}",
                "target": "/run",
                "fstype": "tmpfs",
                "options": "mode=0755,size=64m",
            },
            *(
                {"op": "mkdir", "path": f"{STAGING}/{name}", "mode": 0o755}
                for name in ("empty", "root", "pristine", "disk", "toolchain", "verify")
            ),
            {
                "op": "mount",
                "source": f"t1jax-env-{environment.key}",
                "target": f"{STAGING}/pristine",
                "fstype": "overlay",
                "readonly": True,
                "nosuid": False,
                "options": f"lowerdir={lower}:{STAGING}/empty",
            },
            {
                "op": "mount",
                "source": f"t1jax-disk-{self._id}",
                "target": disk,
                "fstype": "tmpfs",
                "options": f"size={spec.storage_mb}m,nr_inodes={inodes},mode=0755,uid={base},gid={base}",
            },
            {"op": "mkdir", "path": f"{disk}/upper", "mode": 0o755, "uid": base, "gid": base},
            {"op": "mkdir", "path": f"{disk}/work", "mode": 0o755, "uid": base, "gid": base},
            {
                "op": "mount",
                "source": f"t1jax-root-{self._id}",
                "target": f"{STAGING}/root",
                "fstype": "overlay",
                "nosuid": False,
                "options": f"lowerdir={lower},upperdir={disk}/upper,workdir={disk}/work",
            },
            # The workdir exists, as `docker run -w` makes it, and Harbor's log directories (owned by
            # the sandbox's root).
            *(
                {
                    "op": "mkdir",
                    "path": f"{STAGING}/root{path}",
                    "mode": 0o755,
                    "uid": base,
                    "gid": base,
                    "exist_ok": True,
                }
                for path in (self.workdir, *LOG_DIRS)
            ),
            {
                "op": "file",
                "path": f"{STAGING}/hosts",
                "mode": 0o644,
                "content": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                "127.0.1.1\tsandbox\n",
            },
            {"op": "file", "path": f"{STAGING}/hostname", "mode": 0o644, "content": "sandbox\n"},
            {
                "op": "bind",
                "source": str(toolchain.directory),
                "target": f"{STAGING}/toolchain",
                "readonly": True,
            },
            {"op": "userns", "name": "agent", "base": base, "count": SANDBOX_UID_COUNT},
            {"op": "userns", "name": "verifier", "base": base, "count": SANDBOX_UID_COUNT},
        ]

    def _bwrap_args(self, *, verifier: bool, join_network: bool = True) -> list[str]:
        """bwrap arguments (after `--userns FD`) for the agent's init or the verifier; paths are in the
        holder's staging tree. The verifier is started inside the sandbox's network namespace and
        the pid namespace above the agent's (`join_network`: both unless gone with the sandbox's
        init); it then sees that namespace's processes through the procfs its reaper mounted."""
        network = self._network_shared or (verifier and join_network)
        joined_pids = verifier and join_network
        args = [
            *([] if joined_pids else ["--unshare-pid"]),
            "--unshare-ipc",
            "--unshare-uts",
            "--hostname",
            "sandbox",
            *([] if network else ["--unshare-net"]),
            "--die-with-parent",
            "--new-session",
            "--bind",
            f"{STAGING}/root",
            "/",
            *(["--ro-bind", "/proc", "/proc"] if joined_pids else ["--proc", "/proc"]),
            "--dev",
            "/dev",
            "--size",
            str(self._backend.shm_mb << 20),
            "--tmpfs",
            "/dev/shm",
            "--ro-bind",
            f"{STAGING}/hosts",
            "/etc/hosts",
            "--ro-bind",
            f"{STAGING}/hostname",
            "/etc/hostname",
            *(["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"] if self._network_shared else []),
        ]
        bundle = host_ca_bundle() if self._network_shared else None
        if bundle is not None:  # the internet is granted behind a TLS-inspecting proxy (see host_trust)
            args += ["--ro-bind", str(bundle), CA_MOUNT]
        if verifier:
            args += [
                "--cap-drop",
                "ALL",
                *[arg for cap in DOCKER_CAPABILITIES for arg in ("--cap-add", cap)],
                "--ro-bind",
                f"{STAGING}/verify/tests",
                "/tests",
                "--bind",
                f"{STAGING}/verify/logs",
                "/logs/verifier",
                "--ro-bind",
                f"{STAGING}/toolchain",
                TOOLCHAIN_MOUNT,
                "--ro-bind",
                f"{STAGING}/pristine",
                IMAGE_MOUNT,
                "--bind",
                f"{STAGING}/verify/tmp",
                VERIFIER_TMP,
            ]
        return [*args, "--chdir", self.workdir if verifier else "/"]

    def _check_usable(self) -> None:
        if self._state == _State.CLOSED:
            raise SandboxLifecycleError(f"sandbox {self._id} is closed")
        if self._state == _State.EXPIRED:
            limit = self._task.limits.total_timeout_sec
            raise SandboxDeadlineExpired(
                f"sandbox {self._id}: trial deadline ({limit:.0f} s) passed", "total"
            )

    def _begin_agent_call(self, timeout_sec: float) -> float:
        """Admit an agent call; returns its timeout clamped to the agent deadline."""
        with self._lock:
            self._check_usable()
            if self._state != _State.RUNNING:
                raise SandboxLifecycleError(f"sandbox {self._id}: the agent phase ended with verify()")
            remaining = self.agent_deadline - time.monotonic()
            if remaining <= 0:
                limit = self._task.limits.agent_timeout_sec
                raise SandboxDeadlineExpired(
                    f"sandbox {self._id}: agent deadline ({limit:.0f} s) passed", "agent"
                )
            if _proc.pid_start_time(self.init_pid) != self._init_start:
                raise SandboxLifecycleError(
                    f"sandbox {self._id}: its init process is gone (killed from inside?)"
                )
            self._active_execs += 1
            return min(max(0.0, timeout_sec), remaining)

    def _end_agent_call(self) -> None:
        with self._lock:
            self._active_execs -= 1
            self._idle.notify_all()

    def _run_inside(self, argv: list[str], timeout_sec: float, env: Mapping[str, str] | None = None):
        """Run `argv` inside the running sandbox's namespaces and cgroups as the image's user (root
        with Docker's default capabilities, via the image's setpriv); kill its session at the deadline."""
        tools = self._backend.tools
        # With a shared (host) network namespace there is nothing to enter, and nothing we may enter.
        net = [] if self._network_shared else ["-n"]
        drop = (
            [self._setpriv, f"--bounding-set={_BOUNDING_SET}", "--"]
            if self.uid == 0 and self._setpriv
            else []
        )
        command = [
            "/bin/sh",
            "-c",
            _JOIN_CGROUPS,
            "sh",
            *self.cgroups.procs_files,
            "--",
            tools["nsenter"],
            "-t",
            str(self.init_pid),
            "-U",
            "-m",
            "-p",
            *net,
            "-i",
            "-u",
            "-r",
            f"--wdns={self.workdir}",
            "-S",
            str(self.uid),
            "-G",
            str(self.gid),
            "--",
            *drop,
            *argv,
        ]
        half = self._backend.max_output_bytes // 2
        started: list[int] = []

        def track(proc) -> None:
            started.append(proc.pid)
            self._exec_sessions.add(proc.pid)

        try:
            return _proc.run_captured(
                command,
                env=dict(env or self.env),
                timeout_sec=timeout_sec,
                head_bytes=half,
                tail_bytes=half,
                on_timeout=lambda proc: _proc.kill_session(proc.pid),
                on_start=track,
            )
        finally:
            self._exec_sessions.difference_update(started)

    def _align_pids(self) -> None:
        """Make the agent's pid namespace allocate its next pid where the outer (verifier's) one will,
        so a process the agent starts has the same pid in both views: a pid file the agent wrote
        names, for the verifier, the process it named for the agent. Both allocate in step while
        only the agent's processes fork (each of them takes a pid in both); the outer init and the
        verifier's processes take pids of the outer one only, which this realigns. (A hostile agent
        with its namespace's capabilities can move its own counter: it then misleads only itself.)"""
        script = (
            'while read -r key outer_host outer inner rest; do [ "$key" = NSpid: ] || continue; '
            '[ -n "$inner" ] && echo "$outer" > /proc/sys/kernel/ns_last_pid; exit; '
            "done < /proc/self/status; exit 3"
        )
        enter = [self._backend.tools["nsenter"], f"--pid=/proc/{self.init_pid}/ns/pid", "--"]
        done = subprocess.run(
            [*enter, "/bin/sh", "-c", script],
            capture_output=True, text=True, timeout=30, env={"PATH": DEFAULT_PATH},
        )  # fmt: skip
        if done.returncode != 0:
            raise SandboxError(
                f"sandbox {self._id}: aligning its pid namespaces failed: {done.stderr.strip()}"
            )

    def _stop_agent_calls(self) -> None:
        """Kill the sessions of agent commands still running (verify ends the agent phase); what they
        started in sessions of their own (a service) lives on through verification."""
        for session in list(self._exec_sessions):
            _proc.kill_session(session)

    def _stop_agent_processes(self) -> None:
        _proc.kill_if_same(self.init_pid, self._init_start)  # the pid namespace dies with its init
        with self._lock:
            verifier = self._verifier_session
        if verifier is not None:
            _proc.kill_session(verifier)
        if self.cgroups is not None:
            self.cgroups.kill_all()

    def _track_verifier(self, proc) -> None:
        """Record the verifier's session for `_release`; kill it at once if the sandbox was closed
        (or expired) after `verify` began: `_release` may already have run and missed it."""
        with self._lock:
            self._verifier_session = proc.pid
            ended = self._state in (_State.CLOSED, _State.EXPIRED)
        if ended:
            _proc.kill_session(proc.pid)  # its pid namespace's init is in it: the namespace ends
            if self.cgroups is not None:  # it may have joined them after `_release` emptied them
                self.cgroups.kill_all()
                self.cgroups.remove()

    def _expire(self) -> None:
        with self._lock:
            if self._state in (_State.CLOSED, _State.EXPIRED):
                return
            self._state = _State.EXPIRED
        self._release()

    def _release(self) -> None:
        """Kill every process, end the holder (and its mounts), remove cgroups and state."""
        try:
            self._stop_agent_processes()
        finally:
            if self._holder is not None:
                self._holder.stop()
            if self.cgroups is not None:
                self.cgroups.kill_all()
                self.cgroups.remove()
            shutil.rmtree(self.state_path, ignore_errors=True)

    # -- terminal ---------------------------------------------------------------------------------

    def _tmux(self, commands: list[list[str]], timeout_sec: float = 10.0):
        argv = ["tmux", "-S", TMUX_SOCKET]  # the sandbox's own tmux (its PATH, its root view)
        for index, command in enumerate(commands):
            argv += ([";"] if index else []) + command
        run = self._run_inside(argv, timeout_sec)
        if run.exit_code != 0:
            raise SandboxError(
                f"sandbox {self._id}: tmux {commands[0][0]} failed: {run.stderr.strip()[:500]}"
            )
        return run

    def _ensure_terminal(self) -> None:
        if self._terminal_started:
            return
        if self._run_inside(["/bin/sh", "-c", "command -v tmux"], 10).exit_code != 0:
            raise SandboxError(f"sandbox {self._id}: no tmux in the environment (apt-get install tmux)")
        # An interactive bash, not a login shell: /etc/profile would reset the image's ENV PATH.
        self._tmux(
            [
                ["-f", "/dev/null", "start-server"],
                ["set-option", "-g", "history-limit", "100000"],
                [
                    "new-session",
                    "-d",
                    "-s",
                    TMUX_SESSION,
                    "-x",
                    str(TERMINAL_COLUMNS),
                    "-y",
                    str(TERMINAL_ROWS),
                    "-c",
                    self.workdir,
                    "/bin/bash",
                ],
            ]
        )
        self._terminal_started = True

    def _read_terminal(self) -> TerminalRead:
        history = self._tmux(
            [["capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", TMUX_SESSION]]
        ).stdout.rstrip()
        previous, self._terminal_seen = self._terminal_seen, history
        if history.startswith(previous):
            new_text = history[len(previous) :].lstrip("\n") if previous else history
        else:  # earlier text changed (clear, full-screen program): show the current screen
            new_text = "\n".join(history.splitlines()[-TERMINAL_ROWS:])
        return _cap_terminal_text(new_text, self._backend.terminal_read_bytes)

    # -- verification -----------------------------------------------------------------------------

    def _verify(self) -> VerifierReport:
        task = step_view(self._task, self.step)
        limits = task.limits
        remaining_total = self.total_deadline - time.monotonic()
        timeout = min(limits.verifier_timeout_sec, remaining_total)
        if timeout <= 0:
            return VerifierReport(
                (), False, FailureCause.VERIFIER_TIMEOUT, None, None, "trial deadline passed before verify"
            )
        staging = Path(f"/proc/{self._holder.pid}/root{STAGING}")
        verify_dir = staging / "verify"
        for child in list(verify_dir.iterdir()):
            _remove(child)
        tests = verify_dir / "tests"
        tests.mkdir(mode=0o755)
        for sub, mode in (("logs", 0o755), ("tmp", 0o1777)):
            (verify_dir / sub).mkdir(mode=mode)
            os.chmod(verify_dir / sub, mode)
            os.chown(verify_dir / sub, SANDBOX_UID_BASE, SANDBOX_UID_BASE)
        for source, name in task_tests_sources(task):
            if source.is_dir():
                shutil.copytree(source, tests, dirs_exist_ok=True, symlinks=True)
            else:
                shutil.copy2(source, tests / name)
        _make_world_readable(tests)
        problems = diff_manifests(self._tests_manifests[self.step], tests_manifest(tests))
        if problems:
            detail = "tests differ from the task's at create time: " + ", ".join(problems[:10])
            return VerifierReport((), False, FailureCause.TESTS_TAMPERED, None, None, detail)

        ensure_directory(staging / "root", "logs/verifier", uid=SANDBOX_UID_BASE, gid=SANDBOX_UID_BASE)
        env = {**self.env, **task.verifier_env, "HOME": "/root", "USER": "root", "LOGNAME": "root"}
        runtime = find_runtime(staging / "pristine", search_path=env.get("PATH", DEFAULT_PATH))
        toolchain = Toolchain(self._backend.toolchain_dir)  # checked at create; mounted at launch
        plan = provide_test_packages(plan_verifier(task, env, runtime), toolchain, runtime)
        tools = self._backend.tools
        host_binds = [arg for host, mount in runtime.host_mounts for arg in ("--ro-bind", host, mount)]
        userns = os.open(f"/proc/{self._holder.userns['verifier']}/ns/user", os.O_RDONLY)
        # The verifier joins the agent's network namespace and the pid namespace above the agent's
        # while the sandbox's init lives (they end with it).
        join = _proc.pid_start_time(self.init_pid) == self._init_start
        outer = os.readlink(f"/proc/{self._holder.pid}/ns/pid_for_children") if join else None

        def stop_verifier(proc) -> None:  # its processes in the outer namespace are in no session of its
            _proc.kill_session(proc.pid)
            if outer is not None:
                _proc.kill_namespace_members(outer)

        try:
            command = [
                tools["nsenter"],
                f"--mount=/proc/{self._holder.pid}/ns/mnt",
                *([f"--net=/proc/{self.init_pid}/ns/net"] if join and not self._network_shared else []),
                *([f"--pid=/proc/{self._holder.pid}/ns/pid_for_children"] if join else []),
                "--",
                *HOLDER_COMMAND,
                "--reap-exec",
                *(["--own-proc"] if join else []),
                *self.cgroups.procs_files,
                "--",
                tools["setpriv"],
                "--reuid",
                str(SANDBOX_UID_BASE),
                "--regid",
                str(SANDBOX_UID_BASE),
                "--clear-groups",
                "--",
                tools["bwrap"],
                "--userns",
                str(userns),
                *self._bwrap_args(verifier=True, join_network=join),
                *host_binds,
                "--",
                *plan.argv,
            ]
            run = _proc.run_captured(
                command,
                env=plan.env,
                timeout_sec=timeout,
                head_bytes=64 * 1024,
                tail_bytes=self._backend.max_output_bytes,
                on_timeout=stop_verifier,
                on_start=self._track_verifier,
                pass_fds=(userns,),
            )
        finally:
            os.close(userns)
            with self._lock:
                self._verifier_session = None
        if join and _proc.pid_start_time(self.init_pid) == self._init_start:
            try:  # the verifier's processes took pids of the outer namespace only
                self._align_pids()
            except (SandboxError, OSError, subprocess.SubprocessError):
                pass  # a sandbox closed meanwhile; an agent phase after this one finds pids unaligned
        output = run.stdout + "\n" + run.stderr
        report = build_report(
            report_dir=verify_dir / "logs",
            output=output,
            exit_code=run.exit_code,
            timed_out=run.timed_out,
            detail=plan.note,
        )
        return dataclasses.replace(report, output_tail=output[-VERIFIER_OUTPUT_TAIL_BYTES:])


# Joins the cgroups named before "--" (as root), then execs the rest of its arguments.
_JOIN_CGROUPS = 'while [ "$1" != "--" ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def _sandbox_env(
    task: Task, environment: BuiltEnvironment, home: str, uid: int, network_shared: bool
) -> dict[str, str]:
    """What `docker exec` gives a command: the image's ENV and the task's, plus HOME and HOSTNAME."""
    env = {"PATH": DEFAULT_PATH, "HOSTNAME": "sandbox", "HOME": home, "TERM": "xterm-256color"}
    env.update(dict(environment.env))
    env.update(task.environment.env)
    if task.environment.allow_internet and network_shared and host_ca_bundle() is not None:
        env.update(trust_env())
    if uid == 0:
        env.setdefault("USER", "root")
    return env


def _tmux_key_commands(keys: str) -> list[list[str]]:
    if keys in _TMUX_KEYS or (len(keys) in (3, 4) and keys[:2] in ("C-", "M-") and "\n" not in keys):
        return [["send-keys", "-t", TMUX_SESSION, keys]]
    commands: list[list[str]] = []
    for index, chunk in enumerate(keys.split("\n")):
        if index:
            commands.append(["send-keys", "-t", TMUX_SESSION, "Enter"])
        if chunk:
            commands.append(["send-keys", "-t", TMUX_SESSION, "-l", "--", chunk])
    return commands or [["send-keys", "-t", TMUX_SESSION, "-l", "--", ""]]


def _cap_terminal_text(text: str, limit: int) -> TerminalRead:
    data = text.encode()
    if len(data) <= limit:
        return TerminalRead(text=text)
    half = limit // 2
    omitted = len(data) - 2 * half
    head = data[:half].decode(errors="ignore")
    tail = data[-half:].decode(errors="ignore")
    return TerminalRead(text=f"{head}\n[... {omitted} bytes omitted ...]\n{tail}", omitted_bytes=omitted)


def _remove(path: Path) -> None:
    """Remove a file, symlink (not its target) or directory tree the agent may have crafted."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _make_world_readable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(mode | (0o555 if path.is_dir() else 0o444))


def _holder_alive(meta: Mapping) -> bool:
    """Whether the sandbox's holder (and so its owning service process) is still running."""
    start = meta.get("holder_start")
    return start is not None and _proc.pid_start_time(meta.get("holder_pid")) == start


def _reap_record(state_path: Path, meta: Mapping) -> None:
    """Clean up a sandbox whose owning process is gone, from its state record."""
    _proc.kill_if_same(meta.get("holder_pid"), meta.get("holder_start"))
    _proc.kill_if_same(meta.get("init_pid"), meta.get("init_start"))
    cgroups = meta.get("cgroups") or {}
    if cgroups:
        groups = SandboxCgroups.from_json(cgroups)
        groups.kill_all()
        groups.remove()
    shutil.rmtree(state_path, ignore_errors=True)
