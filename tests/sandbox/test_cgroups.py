"""Sandbox cgroups on both layouts: v1 for real (this host), v2 against a v2-shaped directory for the
files it writes and against this host's real (controller-less) v2 hierarchy for cgroup.kill."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from sandbox_service.backends._cgroup import (
    PARENT_NAME,
    UNIFIED,
    CgroupHierarchy,
    CgroupUnavailable,
    SandboxCgroups,
)

pytestmark = pytest.mark.sandbox


def _fake_v2(tmp_path: Path, own: str = "/") -> tuple[Path, Path]:
    """A directory shaped like /sys/fs/cgroup on a v2-only host, and a /proc/self/cgroup for it."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


def test_v2_layout_is_detected_and_limits_are_written(tmp_path):
    root, proc = _fake_v2(tmp_path)
    hierarchy = CgroupHierarchy.detect(root, proc)
    assert hierarchy.version == 2 and hierarchy.controllers == ("memory", "pids", "cpu")
    groups = hierarchy.create("sbx-1", memory_bytes=512 << 20, pids_max=256, cpus=1.5)
    group = root / PARENT_NAME / "sbx-1"
    assert groups.paths == {UNIFIED: group} and groups.version == 2
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"  # delegated to the parent
    assert (
        root / PARENT_NAME / "cgroup.subtree_control"
    ).read_text() == "+memory +pids +cpu"  # and to sandboxes
    assert (group / "memory.max").read_text() == str(512 << 20)
    assert (group / "pids.max").read_text() == "256" and (group / "cpu.max").read_text() == "150000 100000"
    assert groups.procs_files == [str(group / "cgroup.procs")]
    # a v2 record survives the round trip through a sandbox's state file (what reap reads)
    assert SandboxCgroups.from_json(groups.to_json()).version == 2
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\n")
    (group / "pids.events").write_text("max 7\n")
    (group / "pids.current").write_text("5\n")
    (group / "memory.peak").write_text(str(100 << 20))
    assert groups.stat() == {
        "oom_kill": 2,
        "memory_failcnt": 12,
        "memory_max_usage": 100 << 20,
        "pids_max_events": 7,
        "pids_current": 5,
    }


def test_v2_service_group_that_cannot_delegate_is_a_clear_error(tmp_path):
    root, proc = _fake_v2(tmp_path, own="/user.slice/session.scope")
    own = root / "user.slice" / "session.scope"
    own.mkdir(parents=True)
    (own / "cgroup.subtree_control").mkdir()  # writing it fails, as EBUSY would on a busy group
    hierarchy = CgroupHierarchy.detect(root, proc)
    with pytest.raises(CgroupUnavailable, match="must delegate them"):
        hierarchy.create("sbx-2", memory_bytes=1 << 30, pids_max=64, cpus=1)


def test_neither_layout_is_a_clear_error(tmp_path):
    (tmp_path / "cgroup").mkdir()
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/\n")
    with pytest.raises(
        CgroupUnavailable, match="cgroup v1 lacks memory, pids, freezer, cpu .* cgroup v2 lacks"
    ):
        CgroupHierarchy.detect(tmp_path / "cgroup", proc)


def test_this_hosts_layout_is_v1_with_real_limits():
    hierarchy = CgroupHierarchy.detect()
    if not Path("/sys/fs/cgroup/memory/cgroup.procs").exists():
        pytest.fail("this test documents the CI host's hybrid (v1) layout; the host changed")
    assert hierarchy.version == 1
    groups = hierarchy.create("t1jax-cgroup-test", memory_bytes=64 << 20, pids_max=32, cpus=0.5)
    try:
        assert int((groups.paths["memory"] / "memory.limit_in_bytes").read_text()) == 64 << 20
        sleeper = subprocess.Popen(["sleep", "300"])
        for procs in groups.procs_files:
            Path(procs).write_text(str(sleeper.pid))
        assert groups.members() == {sleeper.pid}
        groups.kill_all()
        assert sleeper.wait(timeout=10) == -9 and groups.members() == set()
    finally:
        groups.remove()
    assert not groups.exists()


def test_cgroup_kill_on_this_hosts_real_v2_hierarchy():
    """The host's v2 tree (/sys/fs/cgroup/unified on this hybrid host) has no memory or pids
    controller, but cgroup.kill and membership are real: the v2 kill path runs against the kernel."""
    unified = Path("/sys/fs/cgroup/unified")
    if not (unified / "cgroup.procs").exists():
        unified = Path("/sys/fs/cgroup")  # a v2-only host
    group = unified / f"t1jax-cgroup-kill-test-{os.getpid()}"
    group.mkdir()
    groups = SandboxCgroups({UNIFIED: group}, version=2)
    try:
        assert (group / "cgroup.kill").exists(), "kernel without cgroup.kill (< 5.14)"
        join = lambda: (group / "cgroup.procs").write_text("0")  # noqa: E731 - the child joins before it execs
        children = [
            subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], preexec_fn=join) for _ in range(3)
        ]
        deadline = time.monotonic() + 5
        while len(groups.members()) < 9 and time.monotonic() < deadline:  # each sh and its two sleeps
            time.sleep(0.05)
        assert len(groups.members()) == 9
        groups.kill_all()
        assert groups.members() == set() and all(child.wait(timeout=10) == -9 for child in children)
    finally:
        groups.remove()
    assert not group.exists()
