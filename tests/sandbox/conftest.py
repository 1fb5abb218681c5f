"""Fixtures for the sandbox tests: example tasks, the verifier toolchain, real local backends.

Tests that start sandboxes need root, bubblewrap, util-linux, cgroups (v1 or v2) and the stand-in
base roots (`make setup` builds them with mmdebstrap; built here on first use otherwise); they fail,
not skip, without them. Every backend fixture checks at teardown that nothing leaked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sandbox_service.backends.local import LocalBackend
from sandbox_service.base_images import DEFAULT_STAND_IN_DIR
from sandbox_service.tasks import load_task
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "tasks"
MALFORMED = REPO / "tests" / "data" / "malformed_tasks"
HARBOR_HELLO = TASKS / "harbor" / "hello-world"
HARBOR_SALES = TASKS / "harbor" / "sales-report"
HARBOR_BUILD = TASKS / "harbor" / "build-steps"
TB1_HELLO = TASKS / "terminal-bench-1" / "hello-world"
TB1_LOGS = TASKS / "terminal-bench-1" / "log-parsing"
STAND_IN_DIR = DEFAULT_STAND_IN_DIR  # the user's shared stand-ins: each takes a minute to build


@pytest.fixture(scope="session")
def toolchain_dir() -> Path:
    """The pinned verifier toolchain `make setup` creates (created here if missing; needs PyPI once)."""
    return setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory


def _make_backend(cache_dir: Path, toolchain_dir: Path, **options) -> LocalBackend:
    return LocalBackend(
        cache_dir=cache_dir, toolchain_dir=toolchain_dir, stand_in_dir=STAND_IN_DIR, **options
    )


@pytest.fixture(scope="module")
def backend_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sandbox-cache")


@pytest.fixture(scope="module")
def backend(backend_cache, toolchain_dir):
    """A local backend shared by a test module (environments built once per module)."""
    local = _make_backend(backend_cache, toolchain_dir)
    yield local
    leaked = local.live_sandboxes()
    local.close()
    assert not leaked, f"sandboxes left open by the tests: {leaked}"
    assert_nothing_left(local)


@pytest.fixture(scope="module")
def container_backend(tmp_path_factory, toolchain_dir):
    """A container (podman) backend shared by a test module; at teardown none of its containers is left."""
    from sandbox_service.backends.podman import PodmanBackend, PodmanConfig

    podman = PodmanBackend(
        PodmanConfig(cache_dir=tmp_path_factory.mktemp("container-cache"), toolchain_dir=toolchain_dir,
                     stand_in_dir=STAND_IN_DIR, pull="never")
    )  # fmt: skip
    yield podman
    podman.close()
    assert podman.own_containers() == [], "containers left behind"


@pytest.fixture(autouse=True)
def no_leaked_containers(request):
    """After every test that used the shared container backend: none of its containers is left
    (what `podman ps -a` shows with this backend's owner label)."""
    yield
    if "container_backend" in request.fixturenames:
        podman = request.getfixturevalue("container_backend")
        assert podman.own_containers() == [], f"{request.node.name} left containers behind"


@pytest.fixture(params=["local", "container"])
def any_backend(request):
    """Each of the two real backends in turn (for guarantees both must keep)."""
    return request.getfixturevalue("backend" if request.param == "local" else "container_backend")


@pytest.fixture
def make_backend(backend_cache, toolchain_dir):
    """Factory for backends with non-default options (closed and leak-checked at teardown)."""
    made: list[LocalBackend] = []

    def make(**options) -> LocalBackend:
        local = _make_backend(backend_cache, toolchain_dir, **options)
        made.append(local)
        return local

    yield make
    for local in made:
        local.close()
        assert_nothing_left(local)


@pytest.fixture
def hello_task():
    return load_task(HARBOR_HELLO)


def copy_task(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def count_processes(glob: str) -> str:
    """A shell command printing how many processes' command lines (arguments joined by spaces) match
    `glob`, an unquoted shell pattern anchored at the start, e.g. `sleep?300?*` (the stand-in images,
    like the official ones, have no procps)."""
    return (
        "n=0; for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); "
        f'case "$c" in {glob}) n=$((n+1));; esac; done; echo $n'
    )


def sandbox_processes(sandbox) -> list[int]:
    """Host pids of every live process of a local sandbox: the members of its cgroups (every process
    of a sandbox joins them, and nothing inside can leave)."""
    if sandbox.cgroups is None:
        return []
    return sorted(pid for pid in sandbox.cgroups.members() if Path(f"/proc/{pid}").exists())


def mounts_mentioning(text: str) -> list[str]:
    """Mount lines containing `text` in any mount namespace of any process on the host."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/mountinfo") as handle:
                found += [f"pid {entry}: {line.strip()}" for line in handle if text in line]
        except OSError:
            continue
    return found


def assert_sandbox_gone(sandbox) -> None:
    """No process, cgroup, mount, holder or state directory of `sandbox` remains."""
    assert sandbox_processes(sandbox) == [], "processes of the sandbox survive"
    assert sandbox.cgroups is None or not sandbox.cgroups.exists(), "cgroups survive"
    assert mounts_mentioning(f"t1jax-disk-{sandbox.sandbox_id}") == [], "its disk tmpfs is still mounted"
    assert not sandbox.state_path.exists(), "state directory survives"
    if sandbox.holder_pid is not None:
        assert not Path(f"/proc/{sandbox.holder_pid}").exists() or _is_zombie(sandbox.holder_pid)


def assert_nothing_left(local: LocalBackend) -> None:
    assert local.live_sandboxes() == []
    state = local.state_dir
    assert not state.exists() or list(state.iterdir()) == []


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
