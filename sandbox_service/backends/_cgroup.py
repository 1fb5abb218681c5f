"""Per-sandbox cgroups for the local backend, on cgroup v1 or cgroup v2 hosts.

Each sandbox gets its own group(s), named after the sandbox, nested under
`<this process's own group>/t1jax-sandboxes/`, so a sandbox can never exceed the limits its service
runs under. Every process of the sandbox (its init, each command's entry process, the verifier)
joins them before it execs, so children inherit them and nothing inside can leave (no cgroupfs is
mounted in a sandbox).

Layouts (`CgroupHierarchy.detect`): cgroup v1 with the memory, pids, freezer and cpu controllers
each mounted at `/sys/fs/cgroup/<controller>` (also what a hybrid host offers: v1 controllers plus an
empty v2 tree at `/sys/fs/cgroup/unified`), else cgroup v2 at `/sys/fs/cgroup` with the memory and
pids controllers (cpu when available). Anything else raises `CgroupUnavailable` with what is
missing. On v2 the service's own group must be the root or delegate those controllers (v2's
"no internal processes" rule: run the service in its own delegated group, e.g. `systemd-run
--scope -p Delegate=yes`).

Invariants:
- Limits are written before any process joins: memory (v1 `memory.limit_in_bytes` and the
  memory+swap limit where the kernel has one; v2 `memory.max`, `memory.swap.max` = 0), process count
  (`pids.max`), CPU quota (v1 `cpu.cfs_quota_us`; v2 `cpu.max`).
- `kill_all` leaves the group empty: v2 writes `cgroup.kill` (the kernel kills every member at once,
  forks included); v1 (and v2 kernels older than 5.14) freezes the group, SIGKILLs every member,
  thaws, and repeats until it is empty, so a fork bomb cannot outrun it. `remove` deletes the groups.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "freezer", "cpu")
V2_REQUIRED = ("memory", "pids")
V2_OPTIONAL = ("cpu",)
PARENT_NAME = "t1jax-sandboxes"
CPU_PERIOD_US = 100_000
UNIFIED = "unified"  # the key of a v2 group in `SandboxCgroups.paths`


class CgroupUnavailable(RuntimeError):
    """The host offers neither cgroup layout the local backend needs."""


def _own_groups(proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> dict[str, str]:
    """controller (or "" for v2) -> this process's group path, from /proc/self/cgroup."""
    groups = {}
    for line in proc_self_cgroup.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    return groups


class CgroupHierarchy:
    """This host's cgroup layout (`version` 1 or 2) and where sandbox groups go."""

    def __init__(self, version: int, root: Path, own_groups: dict[str, str], controllers: tuple[str, ...]):
        self.version = version
        self.root = Path(root)
        self.own_groups = own_groups
        self.controllers = controllers

    @classmethod
    def detect(
        cls, root: Path = CGROUP_ROOT, proc_self_cgroup: Path = Path("/proc/self/cgroup")
    ) -> CgroupHierarchy:
        root = Path(root)
        own = _own_groups(proc_self_cgroup)
        if all((root / c / "cgroup.procs").exists() and c in own for c in V1_CONTROLLERS):
            return cls(1, root, own, V1_CONTROLLERS)
        available = (
            set((root / "cgroup.controllers").read_text().split())
            if (root / "cgroup.controllers").is_file()
            else set()
        )
        if available and all(c in available for c in V2_REQUIRED) and "" in own:
            return cls(2, root, own, (*V2_REQUIRED, *(c for c in V2_OPTIONAL if c in available)))
        missing_v1 = [c for c in V1_CONTROLLERS if not (root / c / "cgroup.procs").exists()]
        missing_v2 = [c for c in V2_REQUIRED if c not in available]
        raise CgroupUnavailable(
            f"no usable cgroups under {root}: cgroup v1 lacks {', '.join(missing_v1) or 'nothing'} "
            f"(each mounted at {root}/<controller>), cgroup v2 lacks "
            f"{', '.join(missing_v2) if available else 'cgroup.controllers'}; the local backend needs "
            "memory and pids limits (v1 also freezer and cpu)"
        )

    def parent(self, controller: str = UNIFIED) -> Path:
        if self.version == 1:
            return self.root / controller / self.own_groups[controller].lstrip("/") / PARENT_NAME
        return self.root / self.own_groups[""].lstrip("/") / PARENT_NAME

    def planned(self, name: str) -> SandboxCgroups:
        """The groups `create(name, ...)` makes (not created yet), e.g. to record them first."""
        if self.version == 1:
            return SandboxCgroups({c: self.parent(c) / name for c in self.controllers}, version=1)
        return SandboxCgroups({UNIFIED: self.parent() / name}, version=2)

    def create(self, name: str, *, memory_bytes: int, pids_max: int, cpus: float) -> SandboxCgroups:
        groups = self.planned(name)
        try:
            if self.version == 2:
                self._delegate_v2()
            for path in groups.paths.values():
                path.mkdir(parents=True, exist_ok=False)
            groups.limit(
                memory_bytes=memory_bytes, pids_max=pids_max, cpus=cpus, controllers=self.controllers
            )
        except BaseException:
            groups.remove()
            raise
        return groups

    def _delegate_v2(self) -> None:
        """Enable the controllers for sandbox groups: in the service's own group (for the parent)
        and in the parent (for the sandboxes)."""
        parent = self.parent()
        wanted = " ".join(f"+{c}" for c in self.controllers)
        own = parent.parent
        enabled = set((_read(own / "cgroup.subtree_control") or "").split())
        if not all(c in enabled for c in self.controllers):
            try:
                (own / "cgroup.subtree_control").write_text(wanted)
            except OSError as error:
                raise CgroupUnavailable(
                    f"cgroup v2: cannot enable {', '.join(self.controllers)} for sandboxes under {own} "
                    f"({error.strerror}); the service's group must delegate them (it may hold no processes "
                    "itself: run the service in its own delegated group, e.g. systemd-run --scope "
                    "-p Delegate=yes)"
                ) from error
        parent.mkdir(exist_ok=True)
        (parent / "cgroup.subtree_control").write_text(wanted)

    def remove_parents_if_empty(self) -> None:
        """Remove this process's `t1jax-sandboxes` group(s) when no sandbox group is left in them."""
        for controller in self.controllers if self.version == 1 else (UNIFIED,):
            try:
                self.parent(controller).rmdir()
            except OSError:
                continue


class SandboxCgroups:
    """One sandbox's groups: v1 one directory per controller, v2 one directory (`paths[UNIFIED]`)."""

    def __init__(self, paths: dict[str, Path], *, version: int = 1):
        self.paths = {controller: Path(path) for controller, path in paths.items()}
        self.version = version

    @classmethod
    def from_json(cls, data: dict[str, str]) -> SandboxCgroups:
        return cls({k: Path(v) for k, v in data.items()}, version=2 if UNIFIED in data else 1)

    def to_json(self) -> dict[str, str]:
        return {controller: str(path) for controller, path in self.paths.items()}

    def limit(self, *, memory_bytes: int, pids_max: int, cpus: float, controllers: tuple[str, ...]) -> None:
        quota = max(1000, int(cpus * CPU_PERIOD_US))
        if self.version == 2:
            group = self.paths[UNIFIED]
            _write(group / "memory.max", memory_bytes)
            if (group / "memory.swap.max").exists():
                _write(group / "memory.swap.max", 0)
            _write(group / "pids.max", pids_max)
            if "cpu" in controllers:
                _write(group / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            return
        _write(self.paths["memory"] / "memory.limit_in_bytes", memory_bytes)
        swap_limit = self.paths["memory"] / "memory.memsw.limit_in_bytes"
        if swap_limit.exists():
            _write(swap_limit, memory_bytes)
        _write(self.paths["pids"] / "pids.max", pids_max)
        _write(self.paths["cpu"] / "cpu.cfs_period_us", CPU_PERIOD_US)
        _write(self.paths["cpu"] / "cpu.cfs_quota_us", quota)

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
        deadline = time.monotonic() + timeout_sec
        if self.version == 2 and _try_write(self.paths[UNIFIED] / "cgroup.kill", 1):
            while self.members():
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"cgroup {self.paths[UNIFIED]} still has members {sorted(self.members())}"
                    )
                time.sleep(0.01)
            return
        freeze = self._freezer()
        frozen = freeze is not None and _try_write(*freeze[0])
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
                    _try_write(*freeze[1])
                    frozen = False
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cgroup {self.paths} still has members {sorted(members)}")
                time.sleep(0.01)
        finally:
            if frozen:
                _try_write(*freeze[1])

    def _freezer(self) -> tuple[tuple[Path, str], tuple[Path, str]] | None:
        """((file, freeze value), (file, thaw value)) of this group's freezer, if it has one."""
        if self.version == 2:
            path = self.paths[UNIFIED] / "cgroup.freeze"
            return ((path, "1"), (path, "0")) if path.exists() else None
        freezer = self.paths.get("freezer")
        if freezer is None:
            return None
        return (freezer / "freezer.state", "FROZEN"), (freezer / "freezer.state", "THAWED")

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
        if self.version == 2:
            group = self.paths[UNIFIED]
            memory_events = _key_values(_read(group / "memory.events"))
            pids_events = _key_values(_read(group / "pids.events"))
            return {
                "oom_kill": memory_events.get("oom_kill", 0),
                "memory_failcnt": memory_events.get("max", 0),
                "memory_max_usage": int(_read(group / "memory.peak") or _read(group / "memory.current") or 0),
                "pids_max_events": pids_events.get("max", 0),
                "pids_current": int(_read(group / "pids.current") or 0),
            }
        result: dict[str, int] = {}
        memory, pids = self.paths.get("memory"), self.paths.get("pids")
        if memory is not None:
            result["memory_failcnt"] = int(_read(memory / "memory.failcnt") or 0)
            result["oom_kill"] = _key_values(_read(memory / "memory.oom_control")).get("oom_kill", 0)
            result["memory_max_usage"] = int(_read(memory / "memory.max_usage_in_bytes") or 0)
        if pids is not None:
            result["pids_max_events"] = _key_values(_read(pids / "pids.events")).get("max", 0)
            result["pids_current"] = int(_read(pids / "pids.current") or 0)
        return result


def _key_values(text: str | None) -> dict[str, int]:
    values = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            values[key] = int(value)
    return values


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
