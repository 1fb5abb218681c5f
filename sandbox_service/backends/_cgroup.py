"""Per-sandbox cgroup v1 groups (memory, pids, freezer, cpu) for the local backend.

Each sandbox gets one group per controller, named after the sandbox, nested under
`<this process's own group>/t1jax-sandboxes/` so a sandbox can never exceed the limits its service
runs under. Every process of the sandbox (its init, each command's entry process, the verifier)
joins all groups before it execs, so children inherit them and nothing inside can leave them (no
cgroupfs is mounted in a sandbox).

Invariants:
- Limits are written before any process joins: memory (`memory.limit_in_bytes`, and the memory+swap
  limit where the kernel has one), process count (`pids.max`), CPU quota (`cpu.cfs_quota_us`).
- `kill_all` freezes the group, SIGKILLs every member, thaws, and waits until the group is empty,
  so a fork bomb cannot outrun it. `remove` deletes the groups (after `kill_all`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "freezer", "cpu")
PARENT_NAME = "t1jax-sandboxes"
CPU_PERIOD_US = 100_000


class CgroupUnavailable(RuntimeError):
    """The host lacks the cgroup v1 controllers the local backend needs."""


def own_group(controller: str) -> str:
    """This process's group path in a v1 hierarchy, e.g. '/' or '/process_api/abc'."""
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return path
    raise CgroupUnavailable(f"this process is in no cgroup v1 '{controller}' hierarchy")


def parent_dir(controller: str) -> Path:
    mount = CGROUP_ROOT / controller
    if not (mount / "cgroup.procs").exists():
        raise CgroupUnavailable(f"cgroup v1 controller '{controller}' is not mounted at {mount}")
    return mount / own_group(controller).lstrip("/") / PARENT_NAME


class SandboxCgroups:
    """One sandbox's groups, one directory per controller."""

    def __init__(self, paths: dict[str, Path]):
        self.paths = {controller: Path(path) for controller, path in paths.items()}

    @classmethod
    def planned(cls, name: str) -> SandboxCgroups:
        """The groups `create(name, ...)` makes (not created yet), e.g. to record them first."""
        return cls({controller: parent_dir(controller) / name for controller in CONTROLLERS})

    @classmethod
    def create(cls, name: str, *, memory_bytes: int, pids_max: int, cpus: float) -> SandboxCgroups:
        groups = cls.planned(name)
        paths = groups.paths
        try:
            for path in paths.values():
                path.mkdir(parents=True, exist_ok=False)
            _write(paths["memory"] / "memory.limit_in_bytes", memory_bytes)
            swap_limit = paths["memory"] / "memory.memsw.limit_in_bytes"
            if swap_limit.exists():
                _write(swap_limit, memory_bytes)
            _write(paths["pids"] / "pids.max", pids_max)
            _write(paths["cpu"] / "cpu.cfs_period_us", CPU_PERIOD_US)
            _write(paths["cpu"] / "cpu.cfs_quota_us", max(1000, int(cpus * CPU_PERIOD_US)))
        except BaseException:
            groups.remove()
            raise
        return groups

    def to_json(self) -> dict[str, str]:
        return {controller: str(path) for controller, path in self.paths.items()}

    @property
    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in self.paths.values()]

    def members(self) -> set[int]:
        pids: set[int] = set()
        for path in self.paths.values():
            try:
                pids.update(int(line) for line in (path / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                continue
        return pids

    def kill_all(self, timeout_sec: float = 10.0) -> None:
        freezer = self.paths.get("freezer")
        frozen = freezer is not None and _try_write(freezer / "freezer.state", "FROZEN")
        deadline = time.monotonic() + timeout_sec
        try:
            while True:
                members = self.members()
                if not members:
                    return
                for pid in members:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if frozen:  # killed members of a frozen group only die once thawed
                    _try_write(freezer / "freezer.state", "THAWED")
                    frozen = False
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cgroup {self.paths} still has members {sorted(members)}")
                time.sleep(0.01)
        finally:
            if frozen:
                _try_write(freezer / "freezer.state", "THAWED")

    def remove(self) -> None:
        for path in self.paths.values():
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last members are still being reaped
                    time.sleep(0.01)

    def exists(self) -> bool:
        return any(path.exists() for path in self.paths.values())

    def stat(self) -> dict[str, int]:
        """Counters tests and logs use to show a limit was hit: OOM kills, fork refusals."""
        result: dict[str, int] = {}
        memory, pids = self.paths.get("memory"), self.paths.get("pids")
        if memory is not None:
            result["memory_failcnt"] = int(_read(memory / "memory.failcnt") or 0)
            for line in (_read(memory / "memory.oom_control") or "").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    result["oom_kill"] = int(value)
            result["memory_max_usage"] = int(_read(memory / "memory.max_usage_in_bytes") or 0)
        if pids is not None:
            events = (_read(pids / "pids.events") or "max 0").split()
            result["pids_max_events"] = int(events[1]) if len(events) > 1 else 0
            result["pids_current"] = int(_read(pids / "pids.current") or 0)
        return result


def remove_parents_if_empty() -> None:
    """Remove this process's `t1jax-sandboxes` groups when no sandbox group is left in them."""
    for controller in CONTROLLERS:
        try:
            parent_dir(controller).rmdir()
        except (OSError, CgroupUnavailable):
            continue


def _write(path: Path, value: object) -> None:
    path.write_text(str(value))


def _try_write(path: Path, value: object) -> bool:
    try:
        path.write_text(str(value))
        return True
    except OSError:
        return False


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
