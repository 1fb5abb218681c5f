"""The Harbor suite runs only in the Python 3.12 environment `make setup-harbor` builds (a pinned
`harbor` from PyPI, t1jax installed without its dependencies), through `make test-harbor`:
Harbor's own models and readers check what t1jax writes and reads. Elsewhere (the default 3.11
suite, where `harbor` cannot be installed) only test_worker.py, which needs no `harbor`, is collected;
`T1JAX_HARBOR=1` (set by the make target) turns a missing package into a collection error.

The jobs Harbor reads are written by `t1jax eval` running in the project's own venv
(`T1JAX_PYTHON`, default .venv/bin/python), as a user's would be."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "tasks"

try:  # a real submodule: pytest puts tests/ on sys.path, where `harbor` is this directory
    import harbor.models.trial.result  # noqa: F401

    _INSTALLED = True
except ImportError:
    _INSTALLED = False
# The worker's tests need no `harbor` (its other end is played by the test): both suites run them.
_WITHOUT_HARBOR = ("test_worker.py",)
if not _INSTALLED:
    if os.environ.get("T1JAX_HARBOR") == "1":
        raise pytest.UsageError("the Harbor suite needs the `harbor` package: run `make setup-harbor`")
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name not in _WITHOUT_HARBOR]


def pytest_collection_modifyitems(config, items):
    here = str(Path(__file__).parent)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.harbor)


def t1jax_python() -> str:
    python = os.environ.get("T1JAX_PYTHON", str(REPO / ".venv" / "bin" / "python"))
    if not Path(python).exists():
        raise pytest.UsageError(f"T1JAX_PYTHON {python} does not exist: run `make setup` first")
    return python


def t1jax(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`t1jax ARGS` in the project's venv; fails the test with its stderr if it fails."""
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8")}
    done = subprocess.run(
        [t1jax_python(), "-m", "t1jax.cli", *args], cwd=REPO, capture_output=True, text=True, env=env,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"t1jax {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="session")
def jobs(tmp_path_factory) -> dict[str, Path]:
    """Job directories `t1jax eval` wrote: the oracle (2 attempts) and the no-op agent on the
    bundled tasks, a job with a task the backend cannot run (skipped, never started), and the
    oracle's job rescored (`--rescore`)."""
    root = tmp_path_factory.mktemp("jobs")
    out = {}
    for name, agent, attempts in (("oracle", "oracle", "2"), ("nop", "nop", "1")):
        t1jax("eval", "--tasks", str(TASKS), "--agent", agent, "--attempts", attempts, "--concurrency", "5",
              "--out", str(root / name), "--no-progress")  # fmt: skip
        out[name] = root / name
    tasks = tmp_path_factory.mktemp("skip-tasks")
    shutil.copytree(TASKS / "harbor" / "hello-world", tasks / "hello-world")
    shutil.copytree(TASKS / "harbor" / "hello-world", tasks / "needs-gpu")
    toml = tasks / "needs-gpu" / "task.toml"
    text = toml.read_text().replace('name = "t1jax/hello-world"', 'name = "t1jax/needs-gpu"')
    toml.write_text(text.replace("[environment]", "[environment]\ngpus = 1"))
    skipped = root / "skipped"
    t1jax("eval", "--tasks", str(tasks), "--agent", "oracle", "--attempts", "1", "--out", str(skipped),
          "--no-progress")  # fmt: skip
    out["skipped"] = skipped
    # the oracle's job rescored: its trials replayed (Harbor's regrade: `source_trial`)
    t1jax("eval", "--rescore", str(root / "oracle"), "--out", str(root / "rescored"), "--concurrency", "5",
          "--no-progress")  # fmt: skip
    out["rescored"] = root / "rescored"
    return out
