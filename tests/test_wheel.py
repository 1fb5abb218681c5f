"""The wheel works installed, outside the repository: it is built from the source tree, installed
into a fresh virtual environment in a temporary directory, and `t1jax plan` (a named plan and the
stored calibration: package data) and `t1jax eval --agent oracle` (a bundled task, in a real
sandbox) run from a working directory that is not the checkout. Every file of the two packages
that is not Python or documentation must be in the wheel, so a data file the library reads but
pyproject.toml's package-data forgets fails here, not on a user's machine.

Dependencies without network: the fresh environment gets only the wheel (`pip install --no-deps
--no-index`, run before it can see anything else), then a `.pth` line naming the site-packages of
the interpreter running the tests. A `.pth` path line only appends that directory to `sys.path`; the
`.pth` files inside it are not processed, so the checkout's editable install (a meta-path finder
registered by such a file) stays inactive and `import t1jax` can only find the installed copy,
which the test checks.

Marked `wheel` (`make test-wheel`) and `slow`: a build, an install and two cold command starts
take about a minute on two busy cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain

pytestmark = [pytest.mark.wheel, pytest.mark.slow, pytest.mark.sandbox]

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("t1jax", "sandbox_service")
TASK = REPO / "tests" / "data" / "tasks" / "terminal-bench-1" / "hello-world"
NOT_SHIPPED = {".md"}  # documentation beside the code; everything else non-Python is data


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: int = 600):
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command[:3]} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def _package_files() -> set[str]:
    """The files a wheel of PACKAGES must hold, as wheel paths (sources and their data)."""
    files = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*"):
            relative = path.relative_to(REPO)
            if path.is_dir() or "__pycache__" in relative.parts or path.suffix in (".pyc", *NOT_SHIPPED):
                continue
            files.add(relative.as_posix())
    return files


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, wheel): the wheel built from a copy of the source tree, installed in a fresh venv."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy, so the build's build/ and egg-info stay out of the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for package in PACKAGES:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(REPO / package, source / package, ignore=ignore)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(root / "dist"),
          str(source)], cwd=root, env=env)  # fmt: skip
    (wheel,) = (root / "dist").glob("t1jax-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root, env=env)
    python = venv / "bin" / "python"
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         cwd=root, env=env)  # fmt: skip
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=root, env=env).stdout.strip())  # fmt: skip
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "t1jax-test-dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    return venv, wheel


@pytest.fixture
def elsewhere(tmp_path):
    """A working directory outside the checkout, and the environment the commands run in."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return work, env


def test_the_wheel_holds_every_source_and_data_file(installed):
    _, wheel = installed
    with zipfile.ZipFile(wheel) as archive:
        held = set(archive.namelist())
    missing = sorted(_package_files() - held)
    assert not missing, f"package files missing from the wheel (pyproject.toml package-data): {missing}"
    assert any(name.startswith("t1jax/parallel/plans/") for name in held)  # the check saw the data


def test_the_installed_package_is_the_one_imported(installed, elsewhere):
    venv, _ = installed
    work, env = elsewhere
    code = "import t1jax.parallel.plan as p, sandbox_service as s; print(p.__file__); print(s.__file__)"
    where = _run([str(venv / "bin" / "python"), "-c", code], cwd=work, env=env).stdout.split()
    assert all(Path(path).is_relative_to(venv) for path in where), where


def test_plan_runs_from_another_directory(installed, elsewhere):
    venv, _ = installed
    work, env = elsewhere
    shutil.copy2(REPO / "configs" / "tiny_cpu.yaml", work / "model.yaml")  # the user's own preset
    done = _run([str(venv / "bin" / "t1jax"), "plan", "--config", "model.yaml", "--plan", "cpu8_context8",
                 "--tokens", "1024", "--memory-gb", "4"], cwd=work, env=env)  # fmt: skip
    assert "calibration: stored cpu_tiny.json" in done.stdout  # the calibration shipped in the wheel
    assert "feasible plans: 1 " in done.stdout and " da1 fs1 ex1 cp8 te1 " in done.stdout  # the named plan
    unknown = subprocess.run([str(venv / "bin" / "t1jax"), "plan", "--config", "model.yaml", "--plan", "x"],
                             cwd=work, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert unknown.returncode == 2 and "cpu8_context8" in unknown.stderr  # the shipped names, listed


def test_oracle_eval_runs_from_another_directory(installed, elsewhere):
    venv, _ = installed
    work, env = elsewhere
    toolchain = setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory
    shutil.copytree(TASK, work / "tasks" / TASK.name)
    _run([str(venv / "bin" / "t1jax"), "eval", "--tasks", "tasks", "--agent", "oracle", "--attempts", "1",
          "--concurrency", "1", "--out", "job", "--no-progress", "--toolchain-dir", str(toolchain)],
         cwd=work, env=env)  # fmt: skip
    result = json.loads((work / "job" / "result.json").read_text())
    assert result["n_total_trials"] == 1 and result["n_errors"] == 0 and result["resolved_rate"] == 1.0
