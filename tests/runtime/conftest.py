"""Fixtures for the rollout-layer tests: real tasks, a real local backend behind admission control
(leak-checked at teardown), the project tokenizer, and a tiny random MoE policy."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from flax import nnx

from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.backends.local import LocalBackend
from sandbox_service.tasks import load_dataset
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain
from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.model import Qwen35MoeForCausalLM, load_config

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "tests" / "data" / "tasks"


@pytest.fixture(scope="session")
def toolchain_dir() -> Path:
    return setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory


@pytest.fixture(scope="module")
def local_backend(tmp_path_factory, toolchain_dir):
    backend = LocalBackend(cache_dir=tmp_path_factory.mktemp("sandbox-cache"), toolchain_dir=toolchain_dir)
    yield backend
    leaked = backend.live_sandboxes()
    backend.close()
    assert not leaked, f"sandboxes left alive by the tests: {leaked}"


@pytest.fixture
def sandboxes(local_backend):
    """Admission control over the module's backend; at teardown nothing of any run may be left."""
    admission = AdmissionController(
        local_backend, AdmissionConfig(max_live_sandboxes=32, create_rate_per_sec=None)
    )
    yield admission
    report = admission.leak_check()
    admission.shutdown()
    assert not report.leaked, report


@pytest.fixture(scope="session")
def tasks():
    dataset = load_dataset(TASKS_DIR)
    assert not dataset.errors, dataset.errors
    return sorted(dataset.tasks, key=lambda task: task.task_id)


@pytest.fixture(scope="session")
def tokenizer():
    return load_project_tokenizer()


@pytest.fixture(scope="session")
def tiny_policy():
    config = load_config(REPO / "configs" / "tiny_cpu.yaml")
    return Qwen35MoeForCausalLM(config, rngs=nnx.Rngs(3))


class FlakyBackend:
    """Fault injection around a real backend: `create`, and each `exec` / `send_keys` of the
    sandboxes it returns, raise with probability `rate` (seeded). Everything else is the real
    backend's, so what the scheduler must clean up is real."""

    def __init__(self, backend, rate: float, seed: int = 0):
        self.backend, self.rate = backend, rate
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.create_failures = 0
        self.call_failures = 0

    def _fails(self) -> bool:
        with self._lock:
            return self._random.random() < self.rate

    def create(self, task, *, run_id="default"):
        if self._fails():
            with self._lock:
                self.create_failures += 1
            raise ConnectionError("injected: the sandbox provider refused the create")
        return _FlakySandbox(self, self.backend.create(task, run_id=run_id))

    def live_sandboxes(self, run_id=None):
        return self.backend.live_sandboxes(run_id)

    def reap(self, run_id=None):
        return self.backend.reap(run_id)


class _FlakySandbox:
    def __init__(self, owner: FlakyBackend, inner):
        self._owner, self._inner = owner, inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _maybe_fail(self):
        if self._owner._fails():
            with self._owner._lock:
                self._owner.call_failures += 1
            raise ConnectionError("injected: the sandbox stopped answering")

    def exec(self, command, timeout_sec):
        self._maybe_fail()
        return self._inner.exec(command, timeout_sec)

    def send_keys(self, keys, wait_sec):
        self._maybe_fail()
        return self._inner.send_keys(keys, wait_sec)
