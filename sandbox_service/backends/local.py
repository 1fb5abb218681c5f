"""Local backend: bubblewrap sandboxes on this host, isolated well enough for a hostile agent.

This module owns the `local` `SandboxProvider`: creating, driving, verifying and reclaiming
sandboxes with bubblewrap, Linux namespaces and cgroup v1, without Docker.

Isolation design (one sandbox):
- Identity. The sandbox runs in its own user namespace in which uid/gid 0 is mapped to one
  unprivileged host uid/gid N picked for this sandbox (bwrap runs as N with `--unshare-user
  --uid 0`). Inside, commands look like root and own their files; on the host they are uid N, so
  every host file they can see belongs to an unmapped user: mode-600 files such as /etc/shadow are
  unreadable, and nothing is writable without an explicit writable mount. All capabilities are
  dropped (bwrap for its child; `setpriv --bounding-set=-all --no-new-privs` for each command
  entered with nsenter), so setuid binaries gain nothing and mounts cannot be changed. Nested user
  namespaces are not blocked (no seccomp filter here; bwrap's --disable-userns would also stop
  nsenter from entering the sandbox's other namespaces).
- Namespaces. Own pid namespace (`ps` shows only the sandbox; other sandboxes' and the host's
  processes cannot be signalled or even named), ipc, uts (hostname `sandbox`), mount, and a network
  namespace holding only loopback unless the task allows internet *and* the backend was created
  with `allow_internet=True` (then the host network namespace is shared).
- Filesystem. A holder process (`_holder.py`, root, in a private mount namespace of its own) builds
  a staging tree under a tmpfs on `/run`: the root view is a read-only overlay of the task's built
  environment layer over an overlay of the host root (`envbuild`), so only the root filesystem's
  own content is visible (no host submounts such as /sys/fs/cgroup or /proc). Host top-level
  entries outside bin/sbin/lib*/usr/etc/opt/var (e.g. /root, /home, /work with the repository,
  /srv, /mnt, the service's cache) are replaced by empty read-only ones (or by what the task's
  build put there). Writable and private to the sandbox: the task workdir (e.g. /app, seeded from
  the build), /root, /tmp, /var/tmp and /logs - all on one tmpfs of the task's `storage_mb` (the
  disk cap; its pages also count against the sandbox's memory limit) - plus 64 MiB tmpfs /run and
  /dev/shm. /tests exists but is an empty read-only directory while the agent runs.
- Resources. One cgroup per controller (memory, pids, freezer, cpu) per sandbox, nested under the
  service's own cgroup: memory limit = task `memory_mb` (memory+swap too where available),
  `pids.max` = backend `pids_max`, CPU quota = task `cpus`. Every process of the sandbox joins them
  before it execs; no cgroupfs is mounted inside, so nothing can leave.
- Processes. The holder spawns the sandbox's init (`bwrap ... sleep infinity`) into the cgroups and
  waits until it reports ready (bwrap announces its pid before its mounts are done). Each `exec` is
  a fresh `bash -lc` entered into the init's namespaces with nsenter (same pid namespace, mounts,
  network, cgroups) in its own session; at the command's deadline the whole session is killed.
  Background processes a command starts survive until `verify`/`close` (as in a container) or the
  trial deadline. The holder is a child subreaper, so bwrap's namespace init never ends up a
  zombie of the host's pid 1.
- Interactive terminal. `send_keys` drives a tmux server started inside the sandbox (entered the
  same way as `exec`), so typed commands are isolated exactly like `exec`.
- Verification. `verify` SIGKILLs the sandbox's pid-namespace init and sweeps the cgroups (freeze,
  kill, thaw), so nothing the agent started survives; copies the task's tests into a fresh
  directory of the holder's staging tree (never mounted in the agent's view), checks them against
  the checksums taken at `create`, replaces /logs/verifier with a fresh directory, and runs the
  verifier as a new bwrap sandbox (new namespaces, same filesystem view, /tests read-only, the
  pinned pytest toolchain read-only) under its own deadline. `sandbox_service.verifier` says what
  it executes; `sandbox_service.reports` how its report is read.
- Reclamation. `close` kills the cgroups' members, ends the holder (its mount namespace, and with
  it every tmpfs and overlay of the sandbox, disappears), removes the cgroups and the state
  directory. If the service dies, each holder sees EOF on its stdin and kills its sandbox by
  itself; `reap` then removes the leftover cgroups and state (state records hold pids with start
  times, cgroup paths and the run id).

Invariants:
- `LocalBackend` is safe to use from many threads; each `LocalSandbox` serializes its lifecycle
  transitions (exec may run concurrently with exec, never with verify or close).
- After `close` (or `reap`) no process, cgroup, mount or state directory of the sandbox remains.
- `create` raises `UnsupportedEnvironment` before starting any process if the task's environment
  is outside the Dockerfile subset, and leaves nothing behind when it fails.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from enum import Enum
from pathlib import Path

from sandbox_service.backends import _proc
from sandbox_service.backends._cgroup import SandboxCgroups, remove_parents_if_empty
from sandbox_service.backends._proc import DEFAULT_PATH, HOLDER_SCRIPT, HolderProcess, require_tool
from sandbox_service.contracts import (
    ExecResult,
    FailureCause,
    SandboxDeadlineExpired,
    SandboxError,
    SandboxLifecycleError,
    Task,
    TerminalRead,
    VerifierReport,
)
from sandbox_service.envbuild import (
    PRIVATE_DIRS,
    BuiltEnvironment,
    EnvironmentBuilder,
    check_environment,
    host_masked_top_level,
)
from sandbox_service.reports import build_report
from sandbox_service.verifier import (
    TOOLCHAIN_MOUNT,
    VERIFIER_TMP,
    Toolchain,
    ToolchainMissing,
    diff_manifests,
    manifest_of_sources,
    plan_verifier,
    task_tests_sources,
    tests_manifest,
)

DEFAULT_CACHE_DIR = Path(".cache") / "sandbox_service"
DEFAULT_TOOLCHAIN_SUBDIR = "verifier-toolchain"
UID_BASE = 1_800_000_000
UID_SPAN = 100_000_000
STAGING = "/run/t1jax"
TMUX_SOCKET = "/run/t1jax-tmux.sock"
TMUX_SESSION = "main"
TERMINAL_COLUMNS, TERMINAL_ROWS = 160, 40
_TMUX_KEYS = frozenset(
    {"Enter", "Escape", "Tab", "BSpace", "Up", "Down", "Left", "Right", "Home", "End", "PageUp", "PageDown",
     "Space", "DC", "IC", "NPage", "PPage", "BTab"}
)  # fmt: skip


class _State(Enum):
    RUNNING = "running"
    VERIFYING = "verifying"
    VERIFIED = "verified"
    EXPIRED = "expired"
    CLOSED = "closed"


class LocalBackend:
    """`SandboxProvider` running bubblewrap sandboxes on this host (see the module docstring).

    `cache_dir` holds built environments (`envs/`), sandbox state (`sandboxes/`) and, by default,
    the verifier toolchain (`verifier-toolchain/`, created by `python -m sandbox_service.verifier
    --setup`). `allow_internet=False` keeps every sandbox off the network whatever its task says;
    `build_network` lets Dockerfile RUN steps reach package registries.

    Needs root on a host with cgroup v1 memory/pids/freezer/cpu controllers, bubblewrap >= 0.8 and
    util-linux (nsenter, setpriv, unshare); `send_keys` needs tmux in the environment.
    """

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
        run_tmpfs_mb: int = 64,
        watchdog_interval_sec: float = 0.5,
    ):
        self.cache_dir = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).resolve()
        self.toolchain_dir = Path(toolchain_dir or self.cache_dir / DEFAULT_TOOLCHAIN_SUBDIR).resolve()
        self.state_dir = self.cache_dir / "sandboxes"
        self.allow_internet = allow_internet
        self.pids_max = pids_max
        self.max_output_bytes = max_output_bytes
        self.terminal_read_bytes = terminal_read_bytes
        self.run_tmpfs_mb = run_tmpfs_mb
        self.builder = EnvironmentBuilder(
            self.cache_dir, network=build_network, build_timeout_sec=build_timeout_sec
        )
        self.tools = {name: require_tool(name) for name in ("bwrap", "nsenter", "setpriv", "unshare")}
        self.masked_top_level = host_masked_top_level()
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

    def create(self, task: Task, *, run_id: str = "default") -> LocalSandbox:
        """Build (or reuse) the task's environment and start a sandbox for one trial."""
        if self._closed.is_set():
            raise SandboxLifecycleError("this LocalBackend is closed")
        environment = self.builder.build(task)  # UnsupportedEnvironment before anything starts
        try:
            toolchain = Toolchain.at(self.toolchain_dir)
        except ToolchainMissing as error:
            raise SandboxError(str(error)) from error
        sandbox = LocalSandbox(self, task, environment, run_id, self._allocate_uid())
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
        remove_parents_if_empty()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._sandboxes.pop(sandbox_id, None)

    def _allocate_uid(self) -> int:
        with self._lock:
            used = {s.uid for s in (*self._sandboxes.values(), *self._creating.values())}
        while True:
            uid = UID_BASE + random.randrange(UID_SPAN)
            if uid not in used:
                return uid

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

    def __init__(
        self, backend: LocalBackend, task: Task, environment: BuiltEnvironment, run_id: str, uid: int
    ):
        self._backend = backend
        self._task = task
        self._environment = environment
        self.run_id = run_id
        self.uid = uid
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
        self._tests_manifest: dict[str, str] = {}
        self.created_at = time.monotonic()
        self.agent_deadline = self.created_at + task.limits.agent_timeout_sec
        self.total_deadline = self.created_at + task.limits.total_timeout_sec
        self.state_path = backend.state_dir / self._id
        self.env = _sandbox_env(task, environment)
        self._network_shared = task.environment.allow_internet and backend.allow_internet

    # -- Sandbox protocol -------------------------------------------------------------------------

    @property
    def sandbox_id(self) -> str:
        return self._id

    @property
    def task(self) -> Task:
        return self._task

    @property
    def holder_pid(self) -> int | None:
        return self._holder.pid if self._holder else None

    def exec(self, command: str, timeout_sec: float) -> ExecResult:
        timeout = self._begin_agent_call(timeout_sec)
        try:
            run = self._run_inside(["/bin/bash", "-lc", command], timeout)
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
                raise SandboxLifecycleError(f"sandbox {self._id}: verify() already ran")
            self._state = _State.VERIFYING
            while self._active_execs:  # a concurrent exec is being killed below; wait for it to return
                self._stop_agent_processes()
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
            self._tests_manifest = manifest_of_sources(task)
            self.state_path.mkdir(parents=True)
            self.cgroups = SandboxCgroups.planned(self._id)  # recorded before they exist
            self._write_meta()
            spec = task.environment
            self.cgroups = SandboxCgroups.create(
                self._id, memory_bytes=spec.memory_mb << 20, pids_max=backend.pids_max, cpus=spec.cpus
            )
            init_command = "echo ready >&{ready_fd}; exec {ready_fd}>&-; exec /bin/sleep infinity"
            spawn = {
                "argv": [
                    backend.tools["bwrap"],
                    *self._bwrap_args(verifier=False),
                    *("--info-fd", "{info_fd}", "--", "/bin/sh", "-c", init_command),
                ],
                "env": self.env,
                "uid": self.uid,
                "gid": self.uid,
                "cgroup_procs": self.cgroups.procs_files,
            }
            self._holder = HolderProcess.start(backend.tools["unshare"], self._holder_ops(toolchain), spawn)
            self.init_pid = self._holder.child["child-pid"]
            self._init_start = _proc.pid_start_time(self.init_pid)
            self._write_meta()
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
            "uid": self.uid,
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
        uid, spec, environment = self.uid, self._task.environment, self._environment
        disk = f"{STAGING}/disk"
        ops: list[dict] = [
            {"op": "mount", "source": f"t1jax-staging-{self._id}", "target": "/run", "fstype": "tmpfs",
             "options": "mode=0755,size=1024m"},
            {"op": "mkdir", "path": f"{STAGING}/empty", "mode": 0o555},
            {"op": "file", "path": f"{STAGING}/emptyfile", "mode": 0o444},
            {"op": "mkdir", "path": f"{STAGING}/host", "mode": 0o755},
            {"op": "mkdir", "path": f"{STAGING}/root", "mode": 0o755},
            {"op": "mkdir", "path": disk, "mode": 0o755},
            {"op": "mount", "source": "t1jax-host", "target": f"{STAGING}/host", "fstype": "overlay",
             "readonly": True, "nosuid": False, "options": f"lowerdir={STAGING}/empty:/"},
        ]  # fmt: skip
        if environment.upper is not None:
            ops.append(
                {"op": "mount", "source": f"t1jax-env-{environment.key}", "target": f"{STAGING}/root",
                 "fstype": "overlay", "readonly": True, "nosuid": False,
                 "options": f"lowerdir={environment.upper}:{STAGING}/host"}
            )  # fmt: skip
        else:
            ops.append(
                {"op": "bind", "source": f"{STAGING}/host", "target": f"{STAGING}/root", "readonly": True}
            )
        inodes = max(16384, spec.storage_mb * 64)
        ops.append(
            {"op": "mount", "source": f"t1jax-disk-{self._id}", "target": disk, "fstype": "tmpfs",
             "options": f"size={spec.storage_mb}m,nr_inodes={inodes},mode=0755,uid={uid},gid={uid}"}
        )  # fmt: skip
        modes = {"work": 0o755, "home": 0o700, "tmp": 0o1777, "vartmp": 0o1777, "logs": 0o755}
        for name, mode in modes.items():
            ops.append({"op": "mkdir", "path": f"{disk}/{name}", "mode": mode, "uid": uid, "gid": uid})
            seed = environment.seeds.get(name)
            if seed is not None and seed.is_dir() and any(seed.iterdir()):
                ops.append(
                    {"op": "copy", "source": str(seed), "target": f"{disk}/{name}", "uid": uid, "gid": uid}
                )
        for sub in ("agent", "artifacts", "verifier"):
            ops.append({"op": "mkdir", "path": f"{disk}/logs/{sub}", "mode": 0o755, "uid": uid, "gid": uid})
        for name, path in sorted(environment.masked_tops.items()):
            ops.append({"op": "mkdir", "path": f"{STAGING}/tops/{name}", "mode": 0o755})
            ops.append(
                {"op": "bind", "source": str(path), "target": f"{STAGING}/tops/{name}", "readonly": True}
            )
        ops.append({"op": "mkdir", "path": f"{STAGING}/toolchain", "mode": 0o755})
        ops.append(
            {
                "op": "bind",
                "source": str(toolchain.directory),
                "target": f"{STAGING}/toolchain",
                "readonly": True,
            }
        )
        ops.append({"op": "mkdir", "path": f"{STAGING}/verify", "mode": 0o755})
        return ops

    def _bwrap_args(self, *, verifier: bool) -> list[str]:
        """bwrap arguments for the agent's init or the verifier; paths are in the holder's staging tree."""
        spec = self._task.environment
        network = self._network_shared
        run_size = str(self._backend.run_tmpfs_mb << 20)
        args = [
            "--unshare-user", "--uid", "0", "--gid", "0",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox",
            *([] if network else ["--unshare-net"]),
            "--die-with-parent", "--new-session",
            "--ro-bind", f"{STAGING}/root", "/",
            "--proc", "/proc", "--dev", "/dev",
            "--size", run_size, "--tmpfs", "/dev/shm",
            "--size", run_size, "--tmpfs", "/run",
        ]  # fmt: skip
        private_tops = {path.strip("/").split("/")[0] for path in PRIVATE_DIRS.values()}
        for name, is_dir in sorted(self._backend.masked_top_level.items()):
            if name in private_tops:
                continue
            if name in self._environment.masked_tops:
                args += ["--ro-bind", f"{STAGING}/tops/{name}", f"/{name}"]
            else:
                args += ["--ro-bind", f"{STAGING}/{'empty' if is_dir else 'emptyfile'}", f"/{name}"]
        private = {"work": spec.workdir, **PRIVATE_DIRS}
        for name, path in sorted(private.items(), key=lambda item: (item[1].count("/"), item[1])):
            args += ["--bind", f"{STAGING}/disk/{name}", path]
        if verifier:
            args += [
                "--ro-bind", f"{STAGING}/verify/tests", "/tests",
                "--bind", f"{STAGING}/verify/logs", "/logs/verifier",
                "--ro-bind", f"{STAGING}/toolchain", TOOLCHAIN_MOUNT,
                "--bind", f"{STAGING}/verify/tmp", VERIFIER_TMP,
            ]  # fmt: skip
        return [*args, "--chdir", spec.workdir]

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
        """Run `argv` inside the running sandbox's namespaces and cgroups, as the sandbox's root
        with no capabilities; kill its session at the deadline."""
        tools = self._backend.tools
        # With a shared (host) network namespace there is nothing to enter, and nothing we may enter.
        net = [] if self._network_shared else ["-n"]
        command = [
            "/bin/sh", "-c", _JOIN_CGROUPS, "sh", *self.cgroups.procs_files, "--",
            tools["setpriv"], "--reuid", str(self.uid), "--regid", str(self.uid), "--clear-groups",
            tools["nsenter"], "-t", str(self.init_pid), "-U", "-m", "-p", *net, "-i", "-u", "-r",
            f"--wdns={self._task.environment.workdir}",
            "--preserve-credentials", "--",
            "/usr/bin/setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all",
            "--no-new-privs",
            "--", *argv,
        ]  # fmt: skip
        half = self._backend.max_output_bytes // 2
        return _proc.run_captured(
            command,
            env=dict(env or self.env),
            timeout_sec=timeout_sec,
            head_bytes=half,
            tail_bytes=half,
            on_timeout=lambda proc: _proc.kill_session(proc.pid),
        )

    def _stop_agent_processes(self) -> None:
        _proc.kill_if_same(self.init_pid, self._init_start)  # the pid namespace dies with its init
        if self.cgroups is not None:
            self.cgroups.kill_all()

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
                    self._task.environment.workdir,
                    "/bin/bash --login",
                ],
            ]  # fmt: skip
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
        task, limits = self._task, self._task.limits
        remaining_total = self.total_deadline - time.monotonic()
        timeout = min(limits.verifier_timeout_sec, remaining_total)
        self._stop_agent_processes()
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
        for sub, mode in (("logs", 0o755), ("tmp", 0o700)):
            (verify_dir / sub).mkdir(mode=mode)
            os.chown(verify_dir / sub, self.uid, self.uid)
        for source, name in task_tests_sources(task):
            if source.is_dir():
                shutil.copytree(source, tests, dirs_exist_ok=True)
            else:
                shutil.copy2(source, tests / name)
        _make_world_readable(tests)
        problems = diff_manifests(self._tests_manifest, tests_manifest(tests))
        if problems:
            detail = "tests differ from the task's at create time: " + ", ".join(problems[:10])
            return VerifierReport((), False, FailureCause.TESTS_TAMPERED, None, None, detail)
        agent_report_dir = staging / "disk" / "logs" / "verifier"  # whatever the agent left there goes
        _remove(agent_report_dir)
        agent_report_dir.mkdir()
        os.chown(agent_report_dir, self.uid, self.uid)

        plan = plan_verifier(task, self.env)
        tools = self._backend.tools
        command = [
            tools["nsenter"], f"--mount=/proc/{self._holder.pid}/ns/mnt", "--",
            sys.executable, "-I", str(HOLDER_SCRIPT), "--reap-exec", *self.cgroups.procs_files, "--",
            tools["setpriv"], "--reuid", str(self.uid), "--regid", str(self.uid), "--clear-groups",
            tools["bwrap"], *self._bwrap_args(verifier=True), "--", *plan.argv,
        ]  # fmt: skip
        run = _proc.run_captured(
            command,
            env=plan.env,
            timeout_sec=timeout,
            head_bytes=64 * 1024,
            tail_bytes=self._backend.max_output_bytes,
            on_timeout=lambda proc: self.cgroups.kill_all(),
        )
        self.cgroups.kill_all()  # anything the tests started
        return build_report(
            report_dir=verify_dir / "logs",
            output=run.stdout + "\n" + run.stderr,
            exit_code=run.exit_code,
            timed_out=run.timed_out,
            detail=plan.note,
        )


# Joins the cgroups named before "--" (as root), then execs the rest of its arguments.
_JOIN_CGROUPS = 'while [ "$1" != "--" ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def _sandbox_env(task: Task, environment: BuiltEnvironment) -> dict[str, str]:
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "SHELL": "/bin/bash",
        "TERM": "xterm-256color",
        "LANG": "C.UTF-8",
        "HOSTNAME": "sandbox",
    }
    env.update(dict(environment.env))
    env.update(task.environment.env)
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
        groups = SandboxCgroups({k: Path(v) for k, v in cgroups.items()})
        groups.kill_all()
        groups.remove()
    shutil.rmtree(state_path, ignore_errors=True)
