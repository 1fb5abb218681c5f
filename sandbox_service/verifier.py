"""Verifier integrity: the pinned pytest toolchain, the test checksums, and how a task's tests run.

This module owns what the verifier of a trial executes and with what, independent of where it runs.

The toolchain is pytest==8.4.1 and pytest-json-ctrf==0.3.5 (and their dependencies), installed
once by the service with `python -m sandbox_service.verifier --setup [--toolchain-dir DIR]` into a
plain directory (`DIR/site`, pure-Python wheels) plus a launcher `DIR/run_pytest.py` and a
`DIR/bin/pytest` shim. Sandboxes mount it read-only at `TOOLCHAIN_MOUNT`, a path only the
verifier's mount namespace has; tasks never download it.

How a task's tests are run (`plan_verifier`):
- If the task's test script (Harbor `tests/test.sh`, TB 1.x `run-tests.sh`) downloads or installs
  nothing (no curl/wget/uv/uvx/pip install/apt/conda/npm/git clone), the script itself runs, with
  the toolchain's `pytest` first on PATH and `PYTEST_ADDOPTS` adding the per-assertion reports.
- Otherwise, if the tests directory has pytest files, the pinned pytest runs them directly (the
  files the script names, else every `test_*.py` / `*_test.py`); the script is not executed,
  because its downloads could not work offline and would not be reproducible. The binary outcome
  is then pytest's exit status.
- Otherwise the script runs as is (and will likely fail without network); the report says so.
Either way pytest runs with `-rA -p no:cacheprovider --rootdir=/tests --confcutdir=/tests`, JUnit
XML and CTRF JSON written to /logs/verifier, Python in `-P -s` mode (no script/cwd directory and no
user site on sys.path), HOME=/root, a fresh TMPDIR, and an environment the agent never touched.

Invariants:
- `tests_manifest(dir)` is a sha256 per relative file path (plus symlink targets); the copy placed
  in a sandbox is accepted only if its manifest equals the one taken from the task when the
  sandbox was created.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sandbox_service.contracts import Task, TaskLayout

PYTEST_VERSION = "8.4.1"
PYTEST_JSON_CTRF_VERSION = "0.3.5"
PINNED_REQUIREMENTS = (f"pytest=={PYTEST_VERSION}", f"pytest-json-ctrf=={PYTEST_JSON_CTRF_VERSION}")
DEFAULT_TOOLCHAIN_DIR = Path(".cache") / "sandbox_service" / "verifier-toolchain"

TOOLCHAIN_MOUNT = "/run/t1jax-verifier/toolchain"  # inside the verifier's namespace only
VERIFIER_TMP = "/run/t1jax-verifier/tmp"
TESTS_DIR = "/tests"
REPORT_DIR = "/logs/verifier"
SANDBOX_PYTHON = "/usr/bin/python3"

_NETWORK_COMMAND = re.compile(
    r"(?<![\w.-])(curl|wget|uvx?|apt-get|apt|conda|mamba|micromamba|npm|npx|yarn|pipx)(?![\w.-])"
    r"|\bpip3?\s+install\b|\bpython3?\s+-m\s+pip\s+install\b|\bgit\s+clone\b"
)
_NAMED_TEST_FILE = re.compile(r"(?:\$\{?TEST_DIR\}?|/tests)/([\w./-]+\.py)\b")

_LAUNCHER = '''"""Runs the pinned pytest of this toolchain directory (written by sandbox_service.verifier)."""
import os
import sys

sys.dont_write_bytecode = True  # the toolchain is mounted read-only
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "site"))
import pytest  # noqa: E402

raise SystemExit(pytest.console_main())
'''


class ToolchainMissing(RuntimeError):
    """The verifier toolchain directory has not been set up."""


@dataclass(frozen=True)
class Toolchain:
    """A set-up toolchain directory on the host."""

    directory: Path

    @classmethod
    def at(cls, directory: str | Path) -> Toolchain:
        directory = Path(directory).resolve()
        marker = directory / "toolchain.json"
        if not marker.is_file():
            raise ToolchainMissing(
                f"no verifier toolchain at {directory}; create it with "
                f"`python -m sandbox_service.verifier --setup --toolchain-dir {directory}`"
            )
        recorded = json.loads(marker.read_text()).get("requirements")
        if recorded != list(PINNED_REQUIREMENTS):
            raise ToolchainMissing(
                f"toolchain at {directory} pins {recorded}, expected {list(PINNED_REQUIREMENTS)}"
            )
        return cls(directory)


def setup_toolchain(directory: str | Path, *, python: str = sys.executable, quiet: bool = False) -> Toolchain:
    """Install the pinned verifier toolchain into `directory` (idempotent; needs PyPI once)."""
    directory = Path(directory).resolve()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent setups (e.g. pytest-xdist workers) wait for one
        try:
            return Toolchain.at(directory)
        except ToolchainMissing:
            pass
        return _install_toolchain(directory, python, quiet)


def _install_toolchain(directory: Path, python: str, quiet: bool) -> Toolchain:
    site = directory / "site"
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        python,
        "-m",
        "pip",
        "install",
        "--no-input",
        "--disable-pip-version-check",
        "--target",
        str(site),
    ]
    subprocess.run(
        [*command, *(["-q"] if quiet else []), "--upgrade", *PINNED_REQUIREMENTS],
        check=True,
    )
    # Precompile so a read-only mount still imports quickly; bytecode is never written at run time.
    subprocess.run([python, "-m", "compileall", "-q", str(site)], check=False, stdout=subprocess.DEVNULL)
    (directory / "run_pytest.py").write_text(_LAUNCHER)
    (directory / "bin").mkdir(exist_ok=True)
    shim = directory / "bin" / "pytest"
    shim.write_text(f'#!/bin/sh\nexec {SANDBOX_PYTHON} -P -s {TOOLCHAIN_MOUNT}/run_pytest.py "$@"\n')
    shim.chmod(0o755)
    for path in [directory, *directory.rglob("*")]:  # readable by the sandboxes' unprivileged uids
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
    (directory / "toolchain.json").write_text(json.dumps({"requirements": list(PINNED_REQUIREMENTS)}))
    return Toolchain(directory)


# ------------------------------------------------------------------------------------------------
# Tests checksums


def tests_manifest(directory: Path) -> dict[str, str]:
    """sha256 per file (symlinks by target) under `directory`, keyed by relative path."""
    manifest: dict[str, str] = {}
    for path in sorted(Path(directory).rglob("*")):
        relative = str(path.relative_to(directory))
        if path.is_symlink():
            manifest[relative] = "symlink:" + os.readlink(path)
        elif path.is_file():
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
            manifest[relative] = digest.hexdigest()
    return manifest


def task_tests_sources(task: Task) -> list[tuple[Path, str]]:
    """(host path, name under /tests) of everything the verifier gets: the tests directory, and for
    Terminal-Bench 1.x also `run-tests.sh` (the harness put both in /tests)."""
    sources = [(task.tests_dir, ".")]
    if task.layout == TaskLayout.TERMINAL_BENCH_1:
        sources.append((task.source_dir / task.test_script, task.test_script.name))
    return sources


def manifest_of_sources(task: Task) -> dict[str, str]:
    manifest: dict[str, str] = {}
    for source, name in task_tests_sources(task):
        if source.is_dir():
            manifest.update(tests_manifest(source))
        else:
            manifest[name] = hashlib.sha256(source.read_bytes()).hexdigest()
    return manifest


def diff_manifests(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    problems = [f"missing {name}" for name in sorted(set(expected) - set(actual))]
    problems += [f"unexpected {name}" for name in sorted(set(actual) - set(expected))]
    problems += [
        f"changed {name}" for name in sorted(set(expected) & set(actual)) if expected[name] != actual[name]
    ]
    return problems


# ------------------------------------------------------------------------------------------------
# What the verifier runs


@dataclass(frozen=True)
class VerifierPlan:
    """The verifier command inside the sandbox and why it was chosen."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    mode: str  # "script" or "pytest"
    note: str


def pytest_report_options() -> list[str]:
    return [
        "-rA",
        "-p",
        "no:cacheprovider",
        f"--rootdir={TESTS_DIR}",
        f"--confcutdir={TESTS_DIR}",
        f"--junitxml={REPORT_DIR}/junit.xml",
        f"--ctrf={REPORT_DIR}/ctrf.json",
    ]


def plan_verifier(task: Task, base_env: Mapping[str, str]) -> VerifierPlan:
    """Decide how to run `task`'s tests (see the module docstring for the rule)."""
    script_name = task.test_script.name
    script_path = (task.tests_dir if task.layout == TaskLayout.HARBOR else task.source_dir) / task.test_script
    script_text = script_path.read_text(encoding="utf-8", errors="replace")
    env = {
        **base_env,
        "PATH": f"{TOOLCHAIN_MOUNT}/bin:{base_env.get('PATH', '/usr/local/bin:/usr/bin:/bin')}",
        "TEST_DIR": TESTS_DIR,
        "TMPDIR": VERIFIER_TMP,
        "PYTEST_DEBUG_TEMPROOT": VERIFIER_TMP,
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTEST_ADDOPTS": shlex.join(pytest_report_options()),
    }
    env.pop("PYTEST_PLUGINS", None)
    code = "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in script_text.splitlines())  # drop comments
    network_use = _NETWORK_COMMAND.search(code)
    if network_use is None:
        argv = ("/bin/bash", "--noprofile", "--norc", f"{TESTS_DIR}/{script_name}")
        return VerifierPlan(argv, env, "script", f"ran {script_name} (it needs no downloads)")
    test_files = _pytest_files(task, code)
    if not test_files:
        argv = ("/bin/bash", "--noprofile", "--norc", f"{TESTS_DIR}/{script_name}")
        tool = network_use.group(0).strip()
        note = f"ran {script_name} although it uses {tool!r}: no pytest files to run directly"
        return VerifierPlan(argv, env, "script", note)
    env.pop("PYTEST_ADDOPTS")
    argv = (
        SANDBOX_PYTHON,
        "-P",
        "-s",
        f"{TOOLCHAIN_MOUNT}/run_pytest.py",
        *pytest_report_options(),
        *(f"{TESTS_DIR}/{name}" for name in test_files),
    )
    note = (
        f"ran pinned pytest on {', '.join(test_files)} instead of {script_name}, "
        f"which uses {network_use.group(0).strip()!r}"
    )
    return VerifierPlan(argv, env, "pytest", note)


def _pytest_files(task: Task, script_text: str) -> list[str]:
    named = [name for name in _NAMED_TEST_FILE.findall(script_text) if (task.tests_dir / name).is_file()]
    if named:
        return sorted(dict.fromkeys(named))
    candidates = [
        path.relative_to(task.tests_dir).as_posix()
        for path in task.tests_dir.rglob("*.py")
        if path.name.startswith("test_") or path.name.endswith("_test.py")
    ]
    return sorted(candidates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox_service.verifier", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--setup", action="store_true", help="install the pinned verifier toolchain")
    parser.add_argument("--toolchain-dir", type=Path, default=DEFAULT_TOOLCHAIN_DIR)
    args = parser.parse_args(argv)
    if not args.setup:
        parser.print_help()
        return 2
    toolchain = setup_toolchain(args.toolchain_dir)
    print(f"verifier toolchain ready at {toolchain.directory} ({', '.join(PINNED_REQUIREMENTS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
