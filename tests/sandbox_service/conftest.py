"""Fixtures of the sandbox-service tests: real local bubblewrap backends and a small task.

Every sandbox these tests create is real. Each test gets its own backend cache directory (so a
teardown `reap` can never touch another test's, or another pytest worker's, sandboxes) and shares
the pinned verifier toolchain. At teardown the `backend` fixture reaps anything a test left behind
and fails the test if it had to.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from task_factory import write_hello_task

from sandbox_service.backends.local import LocalBackend
from sandbox_service.contracts import Task
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def toolchain_dir() -> Path:
    """The pinned verifier toolchain `make setup` creates (created here if missing; needs PyPI once)."""
    return setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory


@pytest.fixture
def backend(tmp_path, toolchain_dir) -> Iterator[LocalBackend]:
    local = LocalBackend(cache_dir=tmp_path / "backend-cache", toolchain_dir=toolchain_dir)
    yield local
    leftovers = local.reap(None)
    local.close()
    assert leftovers == [], f"the test left sandboxes behind: {leftovers}"


@pytest.fixture
def hello_task(tmp_path) -> Task:
    return write_hello_task(tmp_path)
