"""Verifier integrity: the pinned pytest toolchain, the interpreter it runs on, the test checksums,
and how a task's tests are run.

This module owns what the verifier of a trial executes and with what, independent of where it runs.

The toolchain is pytest==8.4.1 and pytest-json-ctrf==0.3.5 (plus the backports pytest needs on
Python < 3.11), installed once by the service with `python -m sandbox_service.verifier --setup
[--toolchain-dir DIR]` into a plain directory (`DIR/site`, pure-Python wheels), a launcher
`DIR/run_pytest.py` and a `DIR/bin/pytest` shim. Sandboxes mount it read-only at
`TOOLCHAIN_MOUNT`, a path only the verifier's mount namespace has; tasks never download it.

The interpreter (`VerifierRuntime`, found by `find_runtime`): the agent may have replaced any
file of its own root (a writable copy-on-write root, as in a container), so the verifier does not
run the root's `python3` or `bash` by name. It runs the image's *pristine* copies, from the task's
environment as built (mounted read-only at `IMAGE_MOUNT` in the verifier's namespace), through
that copy's own dynamic loader (`ld-linux ... --library-path`), so no file the agent could write
is executed before the tests start. Without a usable python3 (>= 3.9) in the image, the host's
`/usr` (mounted at `HOST_MOUNT`) supplies it. The launcher puts the toolchain first on sys.path,
then the pristine standard library and site-packages, then the live site-packages (what the agent
installed), taking only path lines from their `.pth` files (never `import` lines), with `site`,
user site, plugin autoload and bytecode writing off.

How a task's tests are run (`plan_verifier`):
- If the task's test script (Harbor `tests/test.sh`, TB 1.x `run-tests.sh`) downloads or installs
  nothing (no curl/wget/uv/uvx/pip install/apt/conda/npm/git clone), the script itself runs, on
  the pristine bash. In it `pytest`, `py.test` and `python3 -m pytest` / `python -m pytest` run
  the pinned toolchain on the pristine interpreter (bash functions handed to the script);
  `PYTEST_ADDOPTS` adds only options every pytest has (`-rA`, the JUnit report, `-c`, rootdir and
  confcutdir), so a script that runs the image's own pytest (without pytest-json-ctrf) still works.
- Otherwise, if the tests directory has pytest files, the pinned pytest runs them directly (the
  files the script names, else every `test_*.py` / `*_test.py`); the script is not executed,
  because its downloads could not work offline and would not be reproducible. The binary outcome
  is then pytest's exit status. The packages the script would have installed for its tests
  (`uvx --with numpy==2.1.3`, `pip install scipy`; pytest itself excepted: the pinned one runs)
  are the plan's `requirements`; `provide_test_packages` installs them on the service's host, from
  PyPI, once per requirement set and interpreter version, into the toolchain directory
  (`test-packages/`), and the launcher puts them after the toolchain on sys.path. Where PyPI cannot
  be reached the plan's note says so and the tests run without them.
- Otherwise the script runs as is (and will likely fail without network); the report says so.
The pinned pytest always runs with `-rA -p no:cacheprovider -c <ini> --rootdir=/tests
--confcutdir=/tests`, where `<ini>` is the tests directory's own pytest config or an empty one (so
no pytest.ini, tox.ini or setup.cfg the agent planted anywhere is read), JUnit XML and CTRF JSON
written to /logs/verifier, HOME=/root, a fresh TMPDIR, and an environment the agent never touched.

Invariants:
- `tests_manifest(dir)` is a sha256 per relative file path (plus symlink targets); the copy placed
  in a sandbox is accepted only if its manifest equals the one taken from the task when the
  sandbox was created.
- A plan built with a `VerifierRuntime` executes no program by a path the agent can write until
  the task's own test script or test code runs.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sandbox_service.argparsing import EXIT_BAD_INPUT, OneLineArgumentParser, one_line
from sandbox_service.contracts import Task, TaskLayout

PYTEST_VERSION = "8.4.1"
PYTEST_JSON_CTRF_VERSION = "0.3.5"
PINNED_REQUIREMENTS = (
    f"pytest=={PYTEST_VERSION}",
    f"pytest-json-ctrf=={PYTEST_JSON_CTRF_VERSION}",
    "exceptiongroup==1.3.0",  # pytest's backports for Python < 3.11 images, installed unconditionally
    "tomli==2.2.1",
)
TOOLCHAIN_LAYOUT = "3"  # bump when the launcher or the shim change
# Named by layout, so checkouts of different versions sharing one cache never rewrite each other's.
DEFAULT_TOOLCHAIN_SUBDIR = f"verifier-toolchain-v{TOOLCHAIN_LAYOUT}"
DEFAULT_TOOLCHAIN_DIR = Path(".cache") / "sandbox_service" / DEFAULT_TOOLCHAIN_SUBDIR

VERIFIER_ROOT = "/run/t1jax-verifier"  # inside the verifier's namespace only
TOOLCHAIN_MOUNT = f"{VERIFIER_ROOT}/toolchain"
IMAGE_MOUNT = f"{VERIFIER_ROOT}/image"  # the task's environment as built, read-only
HOST_MOUNT = f"{VERIFIER_ROOT}/host"  # the host's /usr, read-only: the fallback interpreter
VERIFIER_TMP = f"{VERIFIER_ROOT}/tmp"
TESTS_DIR = "/tests"
REPORT_DIR = "/logs/verifier"
CTRF_PLUGIN = "ctrf.main"  # pytest-json-ctrf's pytest11 entry point (autoload is off)
EMPTY_INI = "empty-pytest.ini"
MIN_PYTHON = (3, 9)  # pytest 8.4

_NETWORK_COMMAND = re.compile(
    r"(?<![\w.-])(curl|wget|uvx?|apt-get|apt|conda|mamba|micromamba|npm|npx|yarn|pipx)(?![\w.-])"
    r"|\bpip3?\s+install\b|\bpython3?\s+-m\s+pip\s+install\b|\bgit\s+clone\b"
)
_NAMED_TEST_FILE = re.compile(r"(?:\$\{?TEST_DIR\}?|/tests)/([\w./-]+\.py)\b")
# Variables of the image's or task's environment the verifier never inherits (they would change what
# pytest loads or what the interpreter and the test script's shell run first).
_AGENT_ONLY_VARIABLES = (
    "PYTEST_PLUGINS",
    "PYTEST_ADDOPTS",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "BASH_ENV",
    "ENV",
)
_INI_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")

_LAUNCHER = '''"""Runs the pinned pytest of this toolchain directory (written by sandbox_service.verifier).

sys.path: this toolchain, the interpreter's (pristine) standard library, the test packages
directory T1JAX_TEST_PACKAGES (what the task's test script would have installed), then for every
directory in T1JAX_SITE_DIRS its pristine copy under T1JAX_IMAGE_ROOT and then its live copy, each
with the path lines (never the import lines) of its .pth files.
"""
import os
import sys

sys.dont_write_bytecode = True  # the toolchain is mounted read-only
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "site"))


def _add(directory):
    if not os.path.isdir(directory) or directory in sys.path:
        return
    sys.path.append(directory)
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".pth"):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as handle:
                lines = handle.read().splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.strip()
            if line and not line.startswith(("#", "import ", "import\\t")):
                path = os.path.join(directory, line)
                if os.path.isdir(path) and path not in sys.path:
                    sys.path.append(path)


if os.environ.get("T1JAX_TEST_PACKAGES"):
    _add(os.environ["T1JAX_TEST_PACKAGES"])
_image = os.environ.get("T1JAX_IMAGE_ROOT", "")
for _directory in filter(None, os.environ.get("T1JAX_SITE_DIRS", "").split(":")):
    if _image:
        _add(_image + _directory)
    _add(_directory)

import pytest  # noqa: E402

raise SystemExit(pytest.console_main())
'''

# Runs the pinned pytest: on the pristine interpreter when the verifier set T1JAX_PYTHON, else (a
# remote container without one) on the python3 the container's PATH finds.
_SHIM = f"""#!/bin/sh
# The pinned pytest of the t1jax verifier (written by sandbox_service.verifier).
set -- {TOOLCHAIN_MOUNT}/run_pytest.py -p {CTRF_PLUGIN} "$@"
if [ -n "$T1JAX_PYTHON" ]; then
  if [ -n "$T1JAX_LOADER" ]; then
    set -- "$T1JAX_LOADER" --library-path "$T1JAX_LIBRARY_PATH" "$T1JAX_PYTHON" $T1JAX_PYTHON_FLAGS "$@"
  else
    set -- "$T1JAX_PYTHON" $T1JAX_PYTHON_FLAGS "$@"
  fi
  PYTHONHOME="$T1JAX_PYTHONHOME" PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 exec "$@"
fi
python=$(command -v python3 || echo /usr/bin/python3)
if "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 exec "$python" -P -s "$@"
fi
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 exec "$python" -s "$@"
"""

# The same as the shim, as a bash function the pristine bash defines for the test script, so
# `pytest` in a script never goes through a file the agent could have replaced (/bin/sh).
_PYTEST_FUNCTION = (
    '() { if [ -n "$T1JAX_LOADER" ]; then '
    'PYTHONHOME="$T1JAX_PYTHONHOME" PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 command "$T1JAX_LOADER" '
    '--library-path "$T1JAX_LIBRARY_PATH" "$T1JAX_PYTHON" $T1JAX_PYTHON_FLAGS '
    f'{TOOLCHAIN_MOUNT}/run_pytest.py -p {CTRF_PLUGIN} "$@"; '
    'else PYTHONHOME="$T1JAX_PYTHONHOME" PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 command "$T1JAX_PYTHON" '
    f'$T1JAX_PYTHON_FLAGS {TOOLCHAIN_MOUNT}/run_pytest.py -p {CTRF_PLUGIN} "$@"; fi; }}'
)
# `python3 -m pytest ...` in a test script: the pinned pytest; any other python3 call: the image's.
_PYTHON_FUNCTION = (
    '() {{ if [ "$1" = -m ] && {{ [ "$2" = pytest ] || [ "$2" = py.test ]; }}; then shift 2; '
    'pytest "$@"; else command {name} "$@"; fi; }}'
)


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
        setup = f"`python -m sandbox_service.verifier --setup --toolchain-dir {directory}`"
        if not marker.is_file():
            raise ToolchainMissing(f"no verifier toolchain at {directory}; create it with {setup}")
        recorded = json.loads(marker.read_text())
        if recorded.get("requirements") != list(PINNED_REQUIREMENTS):
            raise ToolchainMissing(
                f"toolchain at {directory} pins {recorded.get('requirements')}, expected "
                f"{list(PINNED_REQUIREMENTS)}; recreate it with {setup}"
            )
        if recorded.get("layout") != TOOLCHAIN_LAYOUT:
            raise ToolchainMissing(f"toolchain at {directory} is an older layout; recreate it with {setup}")
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
    (directory / "toolchain.json").unlink(missing_ok=True)
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
    subprocess.run([*command, *(["-q"] if quiet else []), "--upgrade", *PINNED_REQUIREMENTS], check=True)
    # Precompile so a read-only mount still imports quickly; bytecode is never written at run time.
    subprocess.run([python, "-m", "compileall", "-q", str(site)], check=False, stdout=subprocess.DEVNULL)
    (directory / "run_pytest.py").write_text(_LAUNCHER)
    (directory / EMPTY_INI).write_text("[pytest]\n")
    (directory / "bin").mkdir(exist_ok=True)
    shim = directory / "bin" / "pytest"
    shim.write_text(_SHIM)
    shim.chmod(0o755)
    for path in [directory, *directory.rglob("*")]:  # readable by the sandboxes' unprivileged uids
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
    (directory / "toolchain.json").write_text(
        json.dumps({"requirements": list(PINNED_REQUIREMENTS), "layout": TOOLCHAIN_LAYOUT})
    )
    return Toolchain(directory)


# ------------------------------------------------------------------------------------------------
# The verifier's interpreter


class RuntimeNotFound(RuntimeError):
    """Neither the image nor the host has a program the verifier can run from a pristine copy."""


@dataclass(frozen=True)
class PristineProgram:
    """A program of a read-only root, run through that root's own dynamic loader. Paths are as the
    verifier sees them (under `IMAGE_MOUNT` or `HOST_MOUNT`); `loader` is None for a static binary."""

    program: str
    loader: str | None
    library_path: str

    def argv(self, *args: str) -> tuple[str, ...]:
        if self.loader is None:
            return (self.program, *args)
        return (self.loader, "--library-path", self.library_path, self.program, *args)


@dataclass(frozen=True)
class VerifierRuntime:
    """The interpreters the verifier uses and where they came from.

    `python_home` is PYTHONHOME for `python` (in the verifier's view); `site_dirs` the container
    paths of that interpreter's site directories, which the launcher adds pristine-then-live;
    `image_root` the mount the pristine copies are under ('' for a remote container's own
    interpreter); `host_mounts` the (host path, mount point) pairs the fallback needs."""

    python: PristineProgram | None
    python_home: str
    python_version: tuple[int, int] | None
    site_dirs: tuple[str, ...]
    bash: PristineProgram | None
    image_root: str
    note: str
    host_mounts: tuple[tuple[str, str], ...] = ()

    def python_flags(self) -> tuple[str, ...]:
        flags = ["-S", "-s", "-B"]
        if self.python_version and self.python_version >= (3, 11):
            flags.append("-P")
        return tuple(flags)

    def env(self) -> dict[str, str]:
        if self.python is None:
            return {}
        return {
            "T1JAX_PYTHON": self.python.program,
            "T1JAX_LOADER": self.python.loader or "",
            "T1JAX_LIBRARY_PATH": self.python.library_path,
            "T1JAX_PYTHONHOME": self.python_home,
            "T1JAX_PYTHON_FLAGS": " ".join(self.python_flags()),
            "T1JAX_SITE_DIRS": ":".join(self.site_dirs),
            "T1JAX_IMAGE_ROOT": self.image_root,
        }


_LIBRARY_DIRS = (
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
    "/usr/local/lib",
)
_MAX_LINKS = 40


def resolve_in_root(root: Path, path: str) -> str | None:
    """`path` with every symlink followed as if `root` were `/` (absolute targets stay inside it);
    the result is a path inside the root ('/usr/bin/python3.13'), or None if it does not exist."""
    parts = [p for p in PurePosixPath(path).parts if p != "/"]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        host = root.joinpath(*resolved, part)
        if host.is_symlink():
            hops += 1
            if hops > _MAX_LINKS:
                return None
            target = os.readlink(host)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in PurePosixPath(target).parts if p != "/"] + parts
            continue
        if not host.exists() and not host.is_symlink():
            return None
        resolved.append(part)
    return "/" + "/".join(resolved)


def _elf_interpreter(binary: Path) -> str | None:
    """The PT_INTERP path of a 64-bit little-endian ELF file, None for a static binary; raises
    ValueError for anything else (a script, another architecture)."""
    with open(binary, "rb") as handle:
        header = handle.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise ValueError(f"{binary} is not a 64-bit little-endian ELF file")
        (phoff,) = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        for index in range(phnum):
            handle.seek(phoff + index * phentsize)
            (kind,) = struct.unpack("<I", handle.read(4))
            if kind == 3:  # PT_INTERP
                handle.seek(phoff + index * phentsize + 8)
                (offset,) = struct.unpack("<Q", handle.read(8))
                handle.seek(phoff + index * phentsize + 32)
                (size,) = struct.unpack("<Q", handle.read(8))
                handle.seek(offset)
                return handle.read(size).rstrip(b"\0").decode()
    return None


def _pristine_program(root: Path, mount: str, path: str) -> PristineProgram | None:
    real = resolve_in_root(root, path)
    if real is None or not root.joinpath(real.lstrip("/")).is_file():
        return None
    try:
        interpreter = _elf_interpreter(root / real.lstrip("/"))
    except (OSError, ValueError):
        return None
    libraries = []
    for directory in _LIBRARY_DIRS:
        resolved = resolve_in_root(root, directory)
        if resolved and root.joinpath(resolved.lstrip("/")).is_dir():
            libraries.append(mount + resolved)
    library_path = ":".join(dict.fromkeys(libraries))
    if interpreter is None:
        return PristineProgram(mount + real, None, library_path)
    loader = resolve_in_root(root, interpreter)
    if loader is None:
        return None
    return PristineProgram(mount + real, mount + loader, library_path)


def _find_python(root: Path, mount: str, search_path: str):
    """(program, PYTHONHOME, version, site dirs) of the first python3 on `search_path` in `root`."""
    for directory in [d for d in search_path.split(":") if d.startswith("/")]:
        for name in ("python3", "python"):
            candidate = f"{directory.rstrip('/')}/{name}"
            program = _pristine_program(root, mount, candidate)
            if program is None:
                continue
            real = program.program[len(mount) :]
            prefix = str(PurePosixPath(real).parent.parent)
            found = sorted(root.joinpath(prefix.lstrip("/"), "lib").glob("python3.*/os.py"))
            if not found:
                continue
            version = tuple(int(v) for v in found[-1].parent.name[len("python") :].split("."))[:2]
            if version < MIN_PYTHON:
                continue
            x_y = f"{version[0]}.{version[1]}"
            sites = [
                f"{prefix}/lib/python{x_y}/site-packages",
                f"{prefix}/local/lib/python{x_y}/dist-packages",
                f"{prefix}/lib/python3/dist-packages",
                f"/usr/local/lib/python{x_y}/dist-packages",
                f"/root/.local/lib/python{x_y}/site-packages",
            ]
            venv = PurePosixPath(candidate).parent.parent
            config = root / str(venv).lstrip("/") / "pyvenv.cfg"
            if config.is_file():  # a virtual environment on the image's PATH (e.g. /opt/venv)
                venv_site = f"{venv}/lib/python{x_y}/site-packages"
                system = re.search(
                    r"include-system-site-packages\s*=\s*true", config.read_text(errors="replace")
                )
                sites = [venv_site, *sites] if system else [venv_site]
            return program, mount + prefix, version, tuple(dict.fromkeys(sites))
    return None


def find_runtime(image_root: Path, *, search_path: str, host_root: Path = Path("/")) -> VerifierRuntime:
    """The verifier's interpreters for an image whose pristine root is the host directory
    `image_root` (mounted at `IMAGE_MOUNT` for the verifier): its python3 (found on the image's
    `search_path`) and bash, else the host's (from `host_root`/usr, mounted at `HOST_MOUNT`/usr)."""
    image_root = Path(image_root)
    bash = next(
        (
            p
            for p in (_pristine_program(image_root, IMAGE_MOUNT, b) for b in ("/bin/bash", "/usr/bin/bash"))
            if p is not None
        ),
        None,
    )
    found = _find_python(image_root, IMAGE_MOUNT, search_path)
    notes = []
    host_mounts: list[tuple[str, str]] = []
    if found is not None:
        python, home, version, sites = found
        notes.append(f"python {version[0]}.{version[1]} of the image ({python.program[len(IMAGE_MOUNT) :]})")
    else:
        host = _find_python(Path(host_root), HOST_MOUNT, "/usr/bin:/usr/local/bin")
        if host is None:
            raise RuntimeNotFound("no python3 >= 3.9 in the image or on the host for the pinned pytest")
        python, home, version, _ = host
        sites = ()
        host_mounts.append((str(Path(host_root) / "usr"), f"{HOST_MOUNT}/usr"))
        notes.append(f"the host's python {version[0]}.{version[1]} (the image has no python3 >= 3.9)")
    if bash is None:
        bash = _pristine_program(Path(host_root), HOST_MOUNT, "/usr/bin/bash")
        if bash is None:
            raise RuntimeNotFound("no bash in the image or on the host for the test script")
        if not host_mounts:
            host_mounts.append((str(Path(host_root) / "usr"), f"{HOST_MOUNT}/usr"))
        notes.append("the host's bash (the image has none)")
    return VerifierRuntime(
        python=python,
        python_home=home,
        python_version=version,
        site_dirs=sites,
        bash=bash,
        image_root=IMAGE_MOUNT,
        note="; ".join(notes),
        host_mounts=tuple(host_mounts),
    )


def ensure_directory(root: Path, relative: str, *, uid: int = 0, gid: int = 0) -> Path:
    """Make `relative` (e.g. "logs/verifier") a real directory inside the host directory `root` (a
    sandbox's live root), replacing any symlink or file the agent put on the way, so a bind mount
    onto it lands where it should. Components are checked with lstat: no agent symlink is followed."""
    current = Path(root)
    for part in PurePosixPath(relative).parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISDIR(mode):
            os.unlink(current)  # a symlink, file, fifo...: the agent's, replaced
            mode = None
        if mode is None:
            os.mkdir(current, 0o755)
            os.lchown(current, uid, gid)
    return current


def in_container_runtime() -> VerifierRuntime:
    """For a remote container without a pristine copy of its image (Kubernetes, Modal): the
    container's own bash and python3, found on its PATH (the agent could have replaced them)."""
    return VerifierRuntime(
        None, "", None, (), None, "", "the container's own python3 and bash (not pristine)"
    )


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
    """(host path, name under /tests) of everything the verifier gets, in copy order: the tests
    directory (or, for a step of a multi-step task, its `tests_layers`: a later layer's file
    replaces an earlier one's), and for Terminal-Bench 1.x also `run-tests.sh` (the harness put
    both in /tests)."""
    sources = [(layer, ".") for layer in task.tests_layers or (task.tests_dir,)]
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
    requirements: tuple[str, ...] = ()  # "pytest" mode: what the replaced script installs for its tests


def pytest_ini(task: Task) -> str:
    """The pytest config the verifier passes with `-c`: the tests directory's own, else an empty one."""
    for name in _INI_FILES:
        path = task.tests_dir / name
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if (
                name in ("pytest.ini", ".pytest.ini")
                or "[tool:pytest]" in text
                or "[pytest]" in text
                or ("[tool.pytest.ini_options]" in text)
            ):
                return f"{TESTS_DIR}/{name}"
    return f"{TOOLCHAIN_MOUNT}/{EMPTY_INI}"


def pytest_common_options(task: Task) -> list[str]:
    """Options every pytest version understands (what `PYTEST_ADDOPTS` may carry to any pytest)."""
    return [
        "-rA",
        "-p",
        "no:cacheprovider",
        "-c",
        pytest_ini(task),
        f"--rootdir={TESTS_DIR}",
        f"--confcutdir={TESTS_DIR}",
        f"--junitxml={REPORT_DIR}/junit.xml",
    ]


def pytest_report_options(task: Task) -> list[str]:
    """What the pinned pytest runs with (its shim adds `-p ctrf.main`)."""
    return [*pytest_common_options(task), f"--ctrf={REPORT_DIR}/ctrf.json"]


def plan_verifier(
    task: Task, base_env: Mapping[str, str], runtime: VerifierRuntime | None = None
) -> VerifierPlan:
    """Decide how to run `task`'s tests (see the module docstring for the rule). `runtime` None
    means the container's own interpreters (`in_container_runtime`)."""
    runtime = runtime or in_container_runtime()
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
        **runtime.env(),
    }
    for name in _AGENT_ONLY_VARIABLES:
        if name in base_env:
            env.pop(name, None)
    code = "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in script_text.splitlines())  # drop comments
    network_use = _NETWORK_COMMAND.search(code)
    test_files = _pytest_files(task, code) if network_use else []
    if network_use is None or not test_files:
        env["PYTEST_ADDOPTS"] = shlex.join(pytest_common_options(task))
        pytest_options = f"-p {CTRF_PLUGIN} --ctrf={REPORT_DIR}/ctrf.json"
        env["T1JAX_PYTEST_OPTIONS"] = pytest_options
        if runtime.python is not None:
            env["BASH_FUNC_pytest%%"] = env["BASH_FUNC_py.test%%"] = _PYTEST_FUNCTION.replace(
                f"-p {CTRF_PLUGIN} ", f"{pytest_options} "
            )
            for name in ("python3", "python"):
                env[f"BASH_FUNC_{name}%%"] = _PYTHON_FUNCTION.format(name=name)
        bash_args = ("--noprofile", "--norc", f"{TESTS_DIR}/{script_name}")
        argv = runtime.bash.argv(*bash_args) if runtime.bash else ("/bin/bash", *bash_args)
        if network_use is None:
            note = f"ran {script_name} (it needs no downloads)"
        else:
            note = (
                f"ran {script_name} although it uses {network_use.group(0).strip()!r}: "
                "no pytest files to run directly"
            )
        return VerifierPlan(argv, env, "script", f"{note}; verifier interpreter: {runtime.note}")
    options = (
        *pytest_report_options(task),
        "-p",
        CTRF_PLUGIN,
        *(f"{TESTS_DIR}/{name}" for name in test_files),
    )
    if runtime.python is not None:
        env["PYTHONHOME"] = runtime.python_home
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        argv = runtime.python.argv(*runtime.python_flags(), f"{TOOLCHAIN_MOUNT}/run_pytest.py", *options)
    else:
        argv = (f"{TOOLCHAIN_MOUNT}/bin/pytest", *options)
    note = (
        f"ran pinned pytest on {', '.join(test_files)} instead of {script_name}, "
        f"which uses {network_use.group(0).strip()!r}; verifier interpreter: {runtime.note}"
    )
    return VerifierPlan(argv, env, "pytest", note, script_test_requirements(code))


# What a test script installs for its tests: `uvx`/`uv run --with REQ` (or -w), `pip install`, `uv add`.
_INSTALL_COMMAND = re.compile(
    r"(?<![\w.-])(?:(uvx|uv\s+(?:tool\s+)?run)|(?:uv\s+)?(?:pip3?|python3?\s+-m\s+pip)\s+install|uv\s+add)"
    r"(?![\w.-])"
)
_SHELL_OPERATOR_CHARS = "();<>|&"  # shlex's punctuation: a token of only these ends the command
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[\w,.-]*\])?((===?|>=|<=|~=|!=|<|>)[\w.*+!-]+)?$")
_PIP_OPTIONS_WITH_VALUE = {
    "-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url",
    "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--python",
    "--platform", "--python-version", "--implementation", "--abi", "--retries", "--timeout",
    "--cache-dir", "--src", "--upgrade-strategy", "--progress-bar", "--log", "--proxy",
}  # fmt: skip
_PINNED_NAMES = {"pytest", "pytest-json-ctrf"}  # the toolchain has them (and its versions run)


def script_test_requirements(script_code: str) -> tuple[str, ...]:
    """The packages (PEP 508 names with an optional version) a test script installs for its tests,
    in order, without pytest and pytest-json-ctrf; requirement files, URLs and paths are ignored."""
    found: list[str] = []
    text = re.sub(r"\\\n", " ", script_code)  # line continuations
    for line in text.splitlines():
        for match in _INSTALL_COMMAND.finditer(line):
            rest = re.sub(r"(^|\s)\d+(?=[<>])", r"\1", line[match.end() :])  # `2>/dev/null`
            lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True  # words split at blanks and operators only
            try:
                tokens = list(lexer)
            except ValueError:
                continue
            ends = [i for i, token in enumerate(tokens) if set(token) <= set(_SHELL_OPERATOR_CHARS)]
            words = tokens[: ends[0]] if ends else tokens
            found += _uv_with_values(words) if match.group(1) else _pip_arguments(words)
    names = []
    for requirement in dict.fromkeys(found):
        name = re.split(r"[\[=<>!~]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if _REQUIREMENT.match(requirement) and name not in _PINNED_NAMES:
            names.append(requirement)
    return tuple(names)


def _uv_with_values(words: list[str]) -> list[str]:
    values = []
    for index, word in enumerate(words):
        if word in ("--with", "-w") and index + 1 < len(words):
            values += words[index + 1].split(",")
        elif word.startswith("--with="):
            values += word.partition("=")[2].split(",")
    return values


def _pip_arguments(words: list[str]) -> list[str]:
    values, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in _PIP_OPTIONS_WITH_VALUE
        else:
            values.append(word)
    return values


class PackageInstallFailed(RuntimeError):
    """The packages a test script asks for could not be installed on the service's host."""


TEST_PACKAGES_SUBDIR = "test-packages"
# Wheels the stand-in and official images' glibc (>= 2.36) loads; pure-Python wheels always match.
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "manylinux2010_x86_64", "manylinux1_x86_64")  # fmt: skip


def install_test_packages(
    toolchain: Toolchain,
    requirements: tuple[str, ...],
    python_version: tuple[int, int],
    *,
    python: str = sys.executable,
    timeout_sec: float = 900.0,
) -> Path:
    """The directory (under `toolchain.directory`, so every sandbox that mounts the toolchain sees
    it) holding `requirements` installed for CPython `python_version` on x86-64 Linux: wheels only,
    from PyPI, once per requirement set and version (later calls reuse it; concurrent ones wait).
    Raises `PackageInstallFailed` with pip's last line where they cannot be installed."""
    major, minor = python_version
    key = hashlib.sha256(
        json.dumps([sorted(requirements), [major, minor], WHEEL_PLATFORMS]).encode()
    ).hexdigest()[:16]
    parent = toolchain.directory / TEST_PACKAGES_SUBDIR
    target = parent / f"cp{major}{minor}-{key}"
    if (target / ".complete").is_file():
        return target
    parent.mkdir(mode=0o755, exist_ok=True)
    with open(parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").is_file():
            return target
        staging = parent / f".{target.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        command = [
            python, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
            "--no-cache-dir", "--target", str(staging), "--only-binary=:all:",
            "--python-version", f"{major}.{minor}", "--implementation", "cp",
            "--abi", f"cp{major}{minor}", "--abi", "abi3", "--abi", "none",
            *(arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)),
            *requirements,
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_sec)
        except (OSError, subprocess.TimeoutExpired) as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise PackageInstallFailed(one_line(error)) from error
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            raise PackageInstallFailed(lines[-1].strip() if lines else f"pip exited {done.returncode}")
        for path in [staging, *staging.rglob("*")]:  # readable by the sandboxes' unprivileged uids
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
        (staging / ".complete").write_text(json.dumps(list(requirements)))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def provide_test_packages(
    plan: VerifierPlan, toolchain: Toolchain, runtime: VerifierRuntime, **install_options
) -> VerifierPlan:
    """`plan` with its `requirements` installed (`install_test_packages`) and put on the pinned
    pytest's sys.path; unchanged but for a note where they cannot be had."""
    if plan.mode != "pytest" or not plan.requirements:
        return plan
    wanted = ", ".join(plan.requirements)
    if runtime.python_version is None:
        note = f"{plan.note}; without {wanted} (interpreter version unknown)"
        return dataclasses.replace(plan, note=note)
    try:
        directory = install_test_packages(
            toolchain, plan.requirements, runtime.python_version, **install_options
        )
    except PackageInstallFailed as error:
        note = f"{plan.note}; without {wanted}: installing them failed: {error}"
        return dataclasses.replace(plan, note=note)
    mounted = f"{TOOLCHAIN_MOUNT}/{directory.relative_to(toolchain.directory).as_posix()}"
    env = {**plan.env, "T1JAX_TEST_PACKAGES": mounted}
    note = f"{plan.note}; with {wanted} (installed from PyPI by the service)"
    return dataclasses.replace(plan, env=env, note=note)


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
    parser = OneLineArgumentParser(
        prog="python -m sandbox_service.verifier", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--setup", action="store_true", help="install the pinned verifier toolchain")
    parser.add_argument("--toolchain-dir", type=Path, default=DEFAULT_TOOLCHAIN_DIR)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    args = parser.parse_args(argv)
    if not args.setup:
        parser.error("nothing to do: pass --setup")
    try:
        toolchain = setup_toolchain(args.toolchain_dir)
    except (OSError, subprocess.CalledProcessError) as error:
        if args.debug:
            raise
        print(f"python -m sandbox_service.verifier: installing the toolchain failed: {one_line(error)}",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    print(f"verifier toolchain ready at {toolchain.directory} ({', '.join(PINNED_REQUIREMENTS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
