"""Fixtures for the rollout-layer tests: real tasks, a real local backend behind admission control
(leak-checked at teardown), the project tokenizer, and a tiny random MoE policy."""

from __future__ import annotations

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
