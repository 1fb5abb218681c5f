"""The container backend against the real podman engine: images, limits, isolation, reclamation."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox_service.backends import create_provider
from sandbox_service.backends.container import TRANSPORT_GRACE_SEC
from sandbox_service.backends.podman import LABEL_OWNER, LABEL_RUN, PodmanBackend, PodmanConfig, PodmanEngine
from sandbox_service.contracts import SkipReason, UnsupportedEnvironment
from sandbox_service.errors import BackendError, SandboxClosed
from sandbox_service.fidelity import environment_audit
from sandbox_service.tasks import load_task

from .conftest import HARBOR_BUILD, MALFORMED, REPO, STAND_IN_DIR, copy_task

pytestmark = pytest.mark.sandbox


def _podman(*args: str) -> str:
    """The podman CLI itself (with this host's flags), as a user would run it."""
    return PodmanEngine().text(*args)


def _containers_of_run(run_id: str) -> list[str]:
    return _podman("ps", "-a", "--filter", f"label={LABEL_RUN}={run_id}", "--format", "{{.Names}}").split()


def _resources(task, **environment):
    return dataclasses.replace(task, environment=dataclasses.replace(task.environment, **environment))


def test_real_dockerfile_build_with_stand_in_and_audit(container_backend):
    task = load_task(HARBOR_BUILD)
    audit = environment_audit(task, container_backend)
    assert audit.backend == "container" and audit.runnable and not audit.faithful
    (swap,) = audit.substitutions
    assert swap.requested == "debian:bookworm" and swap.used.startswith(
        "localhost/t1jax-stand-in/debian-bookworm:"
    )
    sandbox = container_backend.create(task, run_id="container-build")
    try:
        assert _containers_of_run("container-build") == [sandbox.name]
        out = sandbox.exec("pwd; echo $GREETING_WORD; greet you; cat /etc/debian_version", 30).stdout.split(
            "\n"
        )
        assert out[:3] == ["/app", "Hello", "Hello, you! (greeter 1.2.3)"] and out[3].startswith("12.")
        labels = json.loads(_podman("inspect", sandbox.name))[0]["Config"]["Labels"]
        assert labels[LABEL_RUN] == "container-build" and labels[LABEL_OWNER] == container_backend.owner
        assert (
            sandbox.exec("ls /tests 2>&1; ls /run/t1jax-verifier 2>&1", 30).exit_code != 0
        )  # nothing hidden here yet
    finally:
        sandbox.close()
    assert _containers_of_run("container-build") == []


def test_limits_network_and_timeouts(container_backend, hello_task):
    task = _resources(hello_task, memory_mb=128, cpus=0.5)
    sandbox = container_backend.create(task, run_id="container-limits")
    try:
        config = json.loads(_podman("inspect", sandbox.name))[0]["HostConfig"]
        assert config["Memory"] == 128 << 20 and config["MemorySwap"] == 128 << 20
        assert config["NanoCpus"] == 500_000_000 and config["PidsLimit"] == container_backend.config.pids_max
        assert config["NetworkMode"] == "none"
        bomb = sandbox.exec('python3 -c "b = []\nwhile True: b.append(bytearray(16 << 20))"', 60)
        assert bomb.exit_code == 137  # the container's memory limit, enforced by the kernel
        links = sandbox.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1", 30).stdout.split()
        assert links == ["lo"]
        started = time.monotonic()
        slow = sandbox.exec("echo started; sleep 300 & sleep 301; echo never", timeout_sec=1)
        assert slow.timed_out and slow.stdout == "started\n" and time.monotonic() - started < 30
    finally:
        sandbox.close()


def test_fork_bomb_hits_the_pids_limit(tmp_path, toolchain_dir, hello_task):
    backend = PodmanBackend(
        PodmanConfig(
            cache_dir=tmp_path,
            toolchain_dir=toolchain_dir,
            stand_in_dir=STAND_IN_DIR,
            pull="never",
            pids_max=64,
        )
    )
    try:
        sandbox = backend.create(hello_task, run_id="container-pids")
        result = sandbox.exec("bomb() { bomb | bomb & }; bomb", timeout_sec=3)
        # The bomb's top shell returns at once and its children go on in the background (as after
        # `docker exec`) until forks fail; on a loaded host the top shell may itself meet the limit
        # and retry its forks past the timeout, or the bomb may take every process before the
        # wrapper has printed the result (its own forks then retry until the transport gives up:
        # seen in CI). Whichever: the call returns, by the transport's deadline at the latest.
        assert (
            result.exit_code == 0
            or "wrapper ended without reporting" in result.stderr
            or (result.timed_out and "fork: retry" in result.stderr)
            or (result.timed_out and "did not answer before the deadline" in result.stderr)
        ), result
        assert result.duration_sec < 3 + TRANSPORT_GRACE_SEC + 10, result
        # The kernel's own account of the container's pids cgroup, read from the host.
        cgroup = json.loads(_podman("inspect", sandbox.name))[0]["State"]["CgroupPath"]
        pids = next(
            path
            for path in (Path(f"/sys/fs/cgroup/pids{cgroup}"), Path(f"/sys/fs/cgroup{cgroup}"))
            if (path / "pids.max").is_file()
        )
        assert (pids / "pids.max").read_text().strip() == "64"
        deadline = time.monotonic() + 60
        while "max 0" in (pids / "pids.events").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "max 0" not in (pids / "pids.events").read_text()  # forks were refused at the limit
        assert int((pids / "pids.current").read_text()) <= 64
        sandbox.close()
    finally:
        backend.close()
    assert backend.own_containers() == []


def test_a_command_holding_every_process_is_killed_at_its_deadline(tmp_path, toolchain_dir, hello_task):
    """A foreground loop that forks until the pids limit: the in-container watchdog (forked before
    the command, so the flood cannot starve it) kills the command's group at the deadline, and the
    sandbox answers the next command."""
    backend = PodmanBackend(
        PodmanConfig(
            cache_dir=tmp_path,
            toolchain_dir=toolchain_dir,
            stand_in_dir=STAND_IN_DIR,
            pull="never",
            pids_max=48,
        )
    )
    try:
        sandbox = backend.create(hello_task, run_id="container-flood")
        result = sandbox.exec("while :; do sleep 300 & done", timeout_sec=3)
        assert result.timed_out and result.exit_code is None, result
        assert "did not answer" not in result.stderr, result  # the watchdog answered, not the transport
        assert result.duration_sec < 3 + TRANSPORT_GRACE_SEC, result
        after = sandbox.exec("echo alive; ps -e --no-headers | wc -l", timeout_sec=10)
        assert after.exit_code == 0 and after.stdout.split()[0] == "alive", after
        assert int(after.stdout.split()[1]) < 24, after  # the flood's sleeps died with its group
        sandbox.close()
    finally:
        backend.close()
    assert backend.own_containers() == []


def test_disk_use_over_storage_mb_evicts_the_container(tmp_path, toolchain_dir, hello_task):
    backend = PodmanBackend(
        PodmanConfig(
            cache_dir=tmp_path,
            toolchain_dir=toolchain_dir,
            stand_in_dir=STAND_IN_DIR,
            pull="never",
            disk_check_interval_sec=0.5,
        )
    )
    try:
        sandbox = backend.create(_resources(hello_task, storage_mb=32), run_id="container-disk")
        # The watcher may evict the container while the write is still going (a loaded machine
        # writes 64 MiB slower than the 0.5-s check): then the command's output is cut, or the
        # exec reports the eviction, instead of "wrote".
        try:
            output = sandbox.exec("head -c 64M /dev/zero > /app/fill; echo wrote", 60).stdout
            assert output in ("wrote\n", ""), output  # done, or cut by the eviction
        except SandboxClosed as error:
            assert "evicted" in str(error)
        deadline = time.monotonic() + 30
        while not sandbox._evicted and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "over the task's 32 MiB" in sandbox._evicted
        report = sandbox.verify()
        assert report.failure_cause.value == "sandbox_error" and "evicted" in report.detail
        sandbox.close()
    finally:
        backend.close()
    assert backend.own_containers() == []


def test_unsupported_base_image_is_refused_and_skipped(container_backend):
    task = load_task(MALFORMED / "unsupported-base")
    audit = environment_audit(task, container_backend)
    assert audit.skip_reason == SkipReason.UNSUPPORTED_IMAGE and "Alpine" in audit.detail
    with pytest.raises(UnsupportedEnvironment, match="Alpine"):
        container_backend.create(task)


def test_task_allowing_internet_still_gets_none_unless_the_backend_grants_it(container_backend, hello_task):
    sandbox = container_backend.create(_resources(hello_task, allow_internet=True), run_id="container-net")
    try:
        assert json.loads(_podman("inspect", sandbox.name))[0]["HostConfig"]["NetworkMode"] == "none"
    finally:
        sandbox.close()


def test_create_provider_knows_the_container_backend(tmp_path, toolchain_dir):
    provider = create_provider(
        "container", cache_dir=tmp_path, toolchain_dir=toolchain_dir, stand_in_dir=STAND_IN_DIR
    )
    try:
        assert isinstance(provider, PodmanBackend) and provider.name == "container"
    finally:
        provider.close()


_OWNER_SCRIPT = """
import json, os, sys
sys.path.insert(0, {repo!r})
from sandbox_service.backends.podman import PodmanBackend, PodmanConfig
from sandbox_service.tasks import load_task
config = PodmanConfig(cache_dir={cache!r}, toolchain_dir={toolchain!r}, stand_in_dir={stand_ins!r},
                      pull="never")
backend = PodmanBackend(config)
sandboxes = [backend.create(load_task({task!r}), run_id={run!r}) for _ in range(2)]
sandboxes[0].exec("setsid sleep 300 > /dev/null 2>&1 &", 30)
print(json.dumps([s.name for s in sandboxes]), flush=True)
os.kill(os.getpid(), 9)
"""


def test_sigkill_of_the_owner_then_reap_leaves_no_container(
    tmp_path, toolchain_dir, hello_task, container_backend
):
    run_id = f"crashed-{os.getpid()}-{time.monotonic_ns()}"
    script = _OWNER_SCRIPT.format(
        repo=str(REPO),
        cache=str(tmp_path),
        toolchain=str(toolchain_dir),
        stand_ins=str(STAND_IN_DIR),
        task=str(copy_task(hello_task.source_dir, tmp_path / "task")),
        run=run_id,
    )
    owner = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert owner.returncode == -signal.SIGKILL, owner.stderr
    names = json.loads(owner.stdout)
    assert sorted(_containers_of_run(run_id)) == sorted(names)  # the engine keeps them running
    assert sorted(container_backend.live_sandboxes(run_id)) == sorted(n.removeprefix("t1jax-") for n in names)
    reaped = container_backend.reap(run_id)  # another process: the owner is dead, so they are garbage
    assert sorted(reaped) == sorted(n.removeprefix("t1jax-") for n in names)
    assert _containers_of_run(run_id) == []


def test_reap_leaves_containers_of_a_live_owner_alone(tmp_path, toolchain_dir, hello_task, container_backend):
    other = PodmanBackend(
        PodmanConfig(cache_dir=tmp_path, toolchain_dir=toolchain_dir, stand_in_dir=STAND_IN_DIR, pull="never")
    )
    try:
        theirs = other.create(hello_task, run_id="shared-container-run")
        assert container_backend.reap("shared-container-run") == []  # a live process owns it
        assert theirs.exec("echo untouched", 30).stdout == "untouched\n"
        assert other.reap("shared-container-run") == [theirs.sandbox_id]  # its own: closed
    finally:
        other.close()
    assert _containers_of_run("shared-container-run") == []


def test_multi_stage_dockerfile_builds_in_the_container_backend(container_backend, tmp_path):
    task_dir = copy_task(HARBOR_BUILD, tmp_path / "multi-stage")
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM debian:bookworm AS build\nRUN echo built-in-stage-one > /artifact\n"
        "FROM python:3.11-slim\nCOPY --from=build /artifact /opt/artifact\n"
        "RUN <<EOF\necho heredoc > /opt/heredoc\nEOF\n"
        "WORKDIR /app\n"
    )
    task = load_task(task_dir)
    audit = environment_audit(task, container_backend)
    assert [s.requested for s in audit.substitutions] == ["debian:bookworm", "python:3.11-slim"]
    sandbox = container_backend.create(task, run_id="container-multistage")
    try:
        assert sandbox.exec("cat /opt/artifact /opt/heredoc", 30).stdout == "built-in-stage-one\nheredoc\n"
    finally:
        sandbox.close()


def test_a_failing_build_is_a_clear_error_and_leaves_no_build_container(container_backend, tmp_path):
    task_dir = copy_task(HARBOR_BUILD, tmp_path / "failing-build")
    dockerfile = "FROM debian:bookworm\nRUN echo about to fail; exit 3\n"
    (task_dir / "environment" / "Dockerfile").write_text(dockerfile)
    def build_containers() -> set[str]:
        # Build (buildah "working") containers only: sandboxes that other tests or processes run at
        # the same time are not this build's business. Other builds' working containers are
        # transient (--force-rm), so a leftover is one that is still there after they have gone.
        listing = _podman("ps", "-a", "--external", "--format", "{{.ID}} {{.Names}}").splitlines()
        return {line.split()[0] for line in listing if "working-container" in line}

    before = build_containers()
    with pytest.raises(BackendError, match="building its Dockerfile failed.*exit"):
        container_backend.create(load_task(task_dir), run_id="container-failing-build")
    deadline = time.monotonic() + 60
    while build_containers() - before and time.monotonic() < deadline:
        time.sleep(1)
    assert build_containers() - before == set()
    assert _containers_of_run("container-failing-build") == []
