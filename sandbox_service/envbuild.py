"""Environment builder: a task's Dockerfile, interpreted without Docker over the host's root.

This module owns parsing the Dockerfile subset a Debian host can stand in for, building it into an
environment layer, and the content-hash cache of built layers.

The subset:
- `FROM` a Debian, Ubuntu or python base (`debian`, `ubuntu`, `python`, `buildpack-deps`, or a
  Terminal-Bench `ubuntu-*`/`debian-*`/`python-*` image); the host's own root stands in for it.
  One stage only. Anything else (alpine, node, cuda, scratch...) is rejected.
- `ARG` (defaults only), `ENV`, `WORKDIR`, `COPY`/`ADD` of files inside the build context (`ADD`
  of a local tar archive extracts it; `--chmod` is applied, `--chown` is ignored because sandbox
  files are owned by the sandbox's root anyway), `RUN` (shell or exec form).
- `CMD`, `ENTRYPOINT`, `EXPOSE`, `LABEL`, `MAINTAINER` are accepted and ignored: both harnesses
  replace the container's command with `sleep infinity`.
- Everything else (`USER`, `VOLUME`, `SHELL`, `HEALTHCHECK`, `ONBUILD`, `STOPSIGNAL`, `COPY --from`,
  `RUN --mount`, heredocs, `ADD <url>`) rejects the task with the instruction and line named.

How a build runs: a holder process (see `backends/_holder.py`) opens a private mount namespace and
mounts a writable overlay whose lower layer is the host root (stacked over a read-only overlay of
`/`, so the layer directory never overlaps its own lower layer) and whose upper directory becomes
the environment layer. `COPY` writes through that overlay; `RUN` executes in a bubblewrap sandbox
whose `/` is the overlay, as root with Docker's default capability set minus `CAP_MKNOD`, in its
own pid/ipc/uts namespaces, with the network only when the builder allows it. Paths every sandbox
gets privately (the workdir, `/root`, `/tmp`, `/var/tmp`, `/logs`) and host top-level directories
that sandboxes never see (`/home`, `/srv`, the repository...) are bound to fresh directories during
the build; their contents become per-sandbox seeds and read-only overlays.

Invariants:
- A built environment is identified by the sha256 of the builder version, the host's os-release,
  the parsed instructions, the content of every file they copy, and the build-network flag; the
  same key always means the same layer, and a layer is published (renamed into place) only after
  its build succeeded, so readers never see half a build.
- Builds of one key are serialized across threads and processes (a lock file); a second caller
  waits and reuses the first's result.
- Built layers are never written after publication; sandboxes mount them read-only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import tarfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_service.backends import _proc
from sandbox_service.backends._proc import DEFAULT_PATH, HolderProcess, require_tool
from sandbox_service.contracts import SandboxError, Task, UnsupportedEnvironment

BUILDER_VERSION = "1"

# Host top-level entries a sandbox sees (read-only); every other top-level entry of the host root
# is masked (replaced by an empty directory, or by what the task's build put there).
VISIBLE_TOP_LEVEL = frozenset(
    {
        "bin",
        "sbin",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "usr",
        "etc",
        "opt",
        "var",
        "proc",
        "dev",
        "sys",
        "run",
        "tmp",
    }
)
# Container paths every sandbox gets privately writable, seeded from the build.
PRIVATE_DIRS = {"home": "/root", "tmp": "/tmp", "vartmp": "/var/tmp", "logs": "/logs"}
IGNORED_INSTRUCTIONS = frozenset({"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER"})
_BASE_REPOSITORIES = frozenset({"debian", "ubuntu", "python", "buildpack-deps"})
_BASE_PREFIXES = ("debian-", "ubuntu-", "python-")
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
# Docker's default capability set, minus CAP_MKNOD (a device node is a way out of any sandbox).
BUILD_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE", "CAP_SETFCAP",
)  # fmt: skip
# How the host stands in for a base image: pip may install into the system Python as it can in the
# official python images (Debian marks its Python externally managed), and python bases get the
# `python` command those images have.
STAND_IN_ENV = (("PIP_BREAK_SYSTEM_PACKAGES", "1"),)
PYTHON_BASE_COMMANDS = (("python", "/usr/bin/python3"), ("pip", "/usr/bin/pip3"))


class EnvironmentBuildError(SandboxError):
    """A supported Dockerfile failed to build (a RUN step exited non-zero, timed out...)."""


# ------------------------------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class CopyStep:
    line: int
    sources: tuple[Path, ...]  # resolved host paths inside the context
    destination: str  # absolute container path; a trailing '/' means "into this directory"
    chmod: int | None = None
    extract_archives: bool = False  # ADD semantics


@dataclass(frozen=True)
class RunStep:
    line: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    workdir: str


@dataclass(frozen=True)
class WorkdirStep:
    line: int
    path: str


Step = CopyStep | RunStep | WorkdirStep


@dataclass(frozen=True)
class BuildPlan:
    """What a Dockerfile asks for, validated against the subset. `env` and `workdir` are final."""

    base_image: str
    steps: tuple[Step, ...]
    env: tuple[tuple[str, str], ...]
    workdir: str
    dockerfile: Path | None = None

    def describe(self) -> list:
        """A JSON-able description; hashed (with copied file contents) into the cache key."""
        out: list = [["FROM", self.base_image], ["ENV", list(self.env)], ["WORKDIR", self.workdir]]
        for step in self.steps:
            if isinstance(step, CopyStep):
                out.append(
                    [
                        "COPY",
                        [str(s) for s in step.sources],
                        step.destination,
                        step.chmod,
                        step.extract_archives,
                    ]
                )
            elif isinstance(step, RunStep):
                out.append(["RUN", list(step.argv), list(step.env), step.workdir])
            else:
                out.append(["WORKDIR", step.path])
        return out


def check_environment(task: Task) -> BuildPlan:
    """Raise `UnsupportedEnvironment` if the local backend cannot build `task`; else its plan."""
    spec = task.environment
    compose_dir = spec.context_dir or task.source_dir
    for directory in {task.source_dir, compose_dir}:
        for name in ("docker-compose.yaml", "docker-compose.yml"):
            if (directory / name).is_file():
                _check_compose(task, directory / name)
    if spec.dockerfile is not None:
        plan = parse_dockerfile(
            spec.dockerfile.read_text(encoding="utf-8"),
            context_dir=spec.context_dir or spec.dockerfile.parent,
            task_id=task.task_id,
            dockerfile=spec.dockerfile,
        )
    elif spec.docker_image is not None:
        reason = _base_image_problem(spec.docker_image)
        if reason:
            raise UnsupportedEnvironment(task.task_id, f"[environment].docker_image: {reason}")
        plan = BuildPlan(base_image=spec.docker_image, steps=(), env=STAND_IN_ENV, workdir="/")
    else:
        raise UnsupportedEnvironment(task.task_id, "no Dockerfile and no docker_image")
    workdir = spec.workdir
    if not workdir.startswith("/") or workdir.rstrip("/") == "" or _first_component(workdir) in {
        "proc", "dev", "sys", "run",
    }:  # fmt: skip
        raise UnsupportedEnvironment(
            task.task_id, f"workdir {workdir!r} cannot be a private sandbox directory"
        )
    if any(_is_within(workdir, path) or _is_within(path, workdir) for path in PRIVATE_DIRS.values()):
        raise UnsupportedEnvironment(
            task.task_id, f"workdir {workdir!r} overlaps a sandbox-private directory"
        )
    return plan


def _check_compose(task: Task, compose: Path) -> None:
    import yaml

    try:
        config = yaml.safe_load(compose.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise UnsupportedEnvironment(task.task_id, f"{compose.name}: invalid YAML: {error}") from error
    services = config.get("services") if isinstance(config, Mapping) else None
    if isinstance(services, Mapping) and len(services) > 1:
        raise UnsupportedEnvironment(
            task.task_id,
            f"{compose.name}: {len(services)} services ({', '.join(services)}); the local backend runs one",
        )


def parse_dockerfile(
    text: str, *, context_dir: Path, task_id: str = "?", dockerfile: Path | None = None
) -> BuildPlan:
    """Validate and interpret a Dockerfile against the subset; raise `UnsupportedEnvironment`."""
    context_dir = Path(context_dir).resolve()
    where = dockerfile.name if dockerfile else "Dockerfile"

    def reject(line: int, reason: str) -> UnsupportedEnvironment:
        return UnsupportedEnvironment(task_id, f"{where} line {line}: {reason}")

    args: dict[str, str] = {}
    env: dict[str, str] = {}
    workdir = "/"
    base: str | None = None
    steps: list[Step] = []
    for line, instruction, rest in _logical_lines(text, reject):
        if instruction in IGNORED_INSTRUCTIONS:
            continue
        if instruction == "ARG":
            name, _, default = rest.strip().partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
                raise reject(line, f"ARG {rest.strip()!r} is not NAME[=default]")
            args[name.strip()] = _unquote(default.strip())
            continue
        if instruction == "FROM":
            if base is not None:
                raise reject(line, "multi-stage builds (a second FROM) are not supported")
            words = [w for w in rest.split() if not w.startswith("--platform")]
            if not words:
                raise reject(line, "FROM without an image")
            image = _substitute(words[0], {**args, **env})
            problem = _base_image_problem(image)
            if problem:
                raise reject(line, problem)
            base = image
            continue
        if base is None:
            raise reject(line, f"{instruction} before FROM")
        variables = {"PATH": DEFAULT_PATH, **args, **env}  # the base image defines PATH
        if instruction == "ENV":
            env.update(_parse_env(rest, variables, lambda reason, at=line: reject(at, reason)))
        elif instruction == "WORKDIR":
            path = _substitute(_unquote(rest.strip()), variables)
            workdir = os.path.normpath(path if path.startswith("/") else os.path.join(workdir, path))
            steps.append(WorkdirStep(line=line, path=workdir))
        elif instruction in ("COPY", "ADD"):
            steps.append(_parse_copy(instruction, rest, line, variables, workdir, context_dir, reject))
        elif instruction == "RUN":
            steps.append(_parse_run(rest, line, env, workdir, reject))
        else:
            raise reject(line, f"instruction {instruction} is outside the supported subset")
    if base is None:
        raise UnsupportedEnvironment(task_id, f"{where}: no FROM instruction")
    return BuildPlan(
        base_image=base,
        steps=tuple(steps),
        env=(*STAND_IN_ENV, *((k, v) for k, v in env.items() if k not in dict(STAND_IN_ENV))),
        workdir=workdir,
        dockerfile=dockerfile,
    )


def _logical_lines(text: str, reject):
    """(first line number, INSTRUCTION, arguments) with continuations joined and comments dropped."""
    escape = "\\"
    lines = text.splitlines()
    for raw in lines[:5]:  # parser directives come first
        directive = re.match(r"^#\s*escape\s*=\s*(\S)\s*$", raw.strip(), re.IGNORECASE)
        if directive:
            escape = directive.group(1)
    index = 0
    while index < len(lines):
        raw = lines[index]
        start = index + 1
        index += 1
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = []
        current = raw.rstrip()
        while current.endswith(escape):  # Docker joins continued lines verbatim, minus the escape
            parts.append(current[: -len(escape)])
            while index < len(lines) and (not lines[index].strip() or lines[index].lstrip().startswith("#")):
                index += 1
            if index >= len(lines):
                current = ""
                break
            current = lines[index].rstrip()
            index += 1
        parts.append(current)
        logical = "".join(parts).strip()
        instruction, _, rest = logical.partition(" ")
        if re.search(r"<<-?\s*[\"']?[A-Za-z_]", rest) and instruction.upper() in ("RUN", "COPY", "ADD"):
            raise reject(start, f"{instruction.upper()} heredocs are not supported")
        yield start, instruction.upper(), rest


def _base_image_problem(image: str) -> str | None:
    name = image.split("@", 1)[0]
    repository, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "")
    last = repository.rsplit("/", 1)[-1].lower()
    if any(bad in tag.lower() for bad in ("alpine", "windows", "nanoserver")):
        return f"base image {image!r} is not Debian/Ubuntu-based (tag {tag!r})"
    if last in _BASE_REPOSITORIES or last.startswith(_BASE_PREFIXES):
        return None
    return f"base image {image!r} is not a Debian, Ubuntu or python image the host can stand in for"


def _parse_env(rest: str, variables: Mapping[str, str], reject) -> dict[str, str]:
    rest = rest.strip()
    first = rest.split(None, 1)[0] if rest else ""
    if "=" not in first:  # legacy `ENV KEY value with spaces`
        key, _, value = rest.partition(" ")
        if not key:
            raise reject("ENV without a name")
        return {key: _substitute(value.strip(), variables)}
    result: dict[str, str] = {}
    try:
        words = shlex.split(rest, posix=True)
    except ValueError as error:
        raise reject(f"ENV {rest!r}: {error}") from error
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise reject(f"ENV entry {word!r} is not KEY=value")
        result[key] = _substitute(value, {**variables, **result})
    return result


def _parse_copy(instruction, rest, line, variables, workdir, context_dir, reject) -> CopyStep:
    try:
        words = json.loads(rest) if rest.strip().startswith("[") else shlex.split(rest)
    except (json.JSONDecodeError, ValueError) as error:
        raise reject(line, f"{instruction} {rest!r}: {error}") from error
    chmod = None
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0)[2:].partition("=")
        if flag == "chmod":
            try:
                chmod = int(value, 8)
            except ValueError:
                raise reject(line, f"{instruction} --chmod={value!r} is not octal") from None
        elif flag in ("chown", "link"):
            continue
        else:
            raise reject(line, f"{instruction} --{flag} is not supported")
    if len(words) < 2:
        raise reject(line, f"{instruction} needs a source and a destination")
    *sources, destination = [_substitute(str(w), variables) for w in words]
    resolved: list[Path] = []
    for source in sources:
        if re.match(r"^[a-z][a-z0-9+.-]*://", source) or source.startswith("git@"):
            raise reject(line, f"{instruction} of a URL ({source}) needs the network at build time")
        matches = (
            sorted(context_dir.glob(source.lstrip("/")))
            if any(c in source for c in "*?[")
            else [context_dir / source.lstrip("/")]
        )
        if not matches or not all(m.exists() for m in matches):
            raise reject(
                line, f"{instruction} source {source!r} not found in the build context {context_dir}"
            )
        for match in matches:
            real = match.resolve()
            if real != context_dir and context_dir not in real.parents:
                raise reject(line, f"{instruction} source {source!r} is outside the build context")
            resolved.append(real)
    trailing = destination.endswith(("/", "/.")) or destination in (".", "..")
    destination = os.path.normpath(
        destination if destination.startswith("/") else os.path.join(workdir, destination)
    )
    if trailing or len(resolved) > 1:
        destination += "/"
    return CopyStep(
        line=line,
        sources=tuple(resolved),
        destination=destination,
        chmod=chmod,
        extract_archives=instruction == "ADD",
    )


def _parse_run(rest, line, env, workdir, reject) -> RunStep:
    rest = rest.strip()
    while rest.startswith("--"):
        flag = rest.split(None, 1)[0]
        raise reject(line, f"RUN {flag.split('=')[0]} is not supported")
    if rest.startswith("["):
        try:
            argv = json.loads(rest)
        except json.JSONDecodeError as error:
            raise reject(line, f"RUN exec form is not a JSON array: {error}") from error
        if not argv or not all(isinstance(a, str) for a in argv):
            raise reject(line, "RUN exec form must be a non-empty array of strings")
    else:
        if not rest:
            raise reject(line, "RUN without a command")
        argv = ["/bin/sh", "-c", rest]
    return RunStep(line=line, argv=tuple(argv), env=tuple(env.items()), workdir=workdir)


_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def _substitute(value: str, variables: Mapping[str, str]) -> str:
    """Docker's `$VAR`, `${VAR}`, `${VAR:-default}` and `${VAR:+alternative}` substitution."""

    def replace(match: re.Match) -> str:
        current = variables.get(match.group(1) or match.group(4), "")
        operator, word = match.group(2), match.group(3) or ""
        if operator == "-":
            return current or word
        if operator == "+":
            return word if current else ""
        return current

    return _VARIABLE.sub(replace, value)


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def _first_component(path: str) -> str:
    return path.strip("/").split("/", 1)[0]


def _is_within(path: str, parent: str) -> bool:
    path, parent = os.path.normpath(path), os.path.normpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")


# ------------------------------------------------------------------------------------------------
# Built environments and the cache


@dataclass(frozen=True)
class BuiltEnvironment:
    """A published environment layer. All paths are host paths inside the cache directory.

    `upper` holds the system changes (an overlay upper layer over the host root; None when the
    build changed nothing there); `seeds[name]` the initial content of each sandbox-private
    directory (`work` for the workdir, and the keys of `PRIVATE_DIRS`); `masked_tops[name]` what the
    build put under a host top-level directory sandboxes otherwise see empty.
    """

    key: str
    directory: Path
    base_image: str
    env: tuple[tuple[str, str], ...]
    workdir: str
    upper: Path | None
    seeds: Mapping[str, Path] = field(default_factory=dict)
    masked_tops: Mapping[str, Path] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: Path) -> BuiltEnvironment:
        meta = json.loads((directory / "env.json").read_text())
        upper = directory / "upper"
        return cls(
            key=meta["key"],
            directory=directory,
            base_image=meta["base_image"],
            env=tuple((k, v) for k, v in meta["env"]),
            workdir=meta["workdir"],
            upper=upper if meta["has_upper"] else None,
            seeds={name: directory / "seeds" / name for name in meta["seeds"]},
            masked_tops={name: directory / "tops" / name for name in meta["masked_tops"]},
        )


def host_masked_top_level(root: Path = Path("/")) -> dict[str, bool]:
    """Host top-level entries sandboxes must not see: name -> is_directory."""
    masked = {}
    for entry in sorted(os.listdir(root)):
        path = root / entry
        if entry in VISIBLE_TOP_LEVEL or path.is_symlink():
            continue  # symlinks such as /bin -> usr/bin resolve inside the visible tree
        masked[entry] = path.is_dir()
    return masked


class EnvironmentBuilder:
    """Builds and caches environment layers under `cache_dir/envs/<key>/`. Thread- and process-safe."""

    def __init__(
        self,
        cache_dir: Path,
        *,
        network: bool = True,
        build_timeout_sec: float = 1800.0,
        log_bytes: int = 64 * 1024,
    ):
        self.envs_dir = Path(cache_dir).resolve() / "envs"
        self.network = network
        self.build_timeout_sec = build_timeout_sec
        self.log_bytes = log_bytes
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._masked = host_masked_top_level()
        self._bwrap = require_tool("bwrap")
        self._nsenter = require_tool("nsenter")
        self._unshare = require_tool("unshare")

    def cache_key(self, task: Task, plan: BuildPlan) -> str:
        digest = hashlib.sha256()
        os_release = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
        header = {
            "builder": BUILDER_VERSION,
            "os": os_release,
            "plan": plan.describe(),
            "workdir": task.environment.workdir,
            "network": self.network,
            "masked": sorted(self._masked),
        }
        digest.update(json.dumps(header, sort_keys=True).encode())
        for step in plan.steps:
            if isinstance(step, CopyStep):
                for source in step.sources:
                    _hash_tree(digest, source)
        return digest.hexdigest()[:32]

    def build(self, task: Task) -> BuiltEnvironment:
        """The task's built environment, from the cache or built now (raises `UnsupportedEnvironment`
        before doing anything for a Dockerfile outside the subset, `EnvironmentBuildError` on failure)."""
        plan = check_environment(task)
        key = self.cache_key(task, plan)
        final = self.envs_dir / key
        if (final / "env.json").is_file():
            return BuiltEnvironment.load(final)
        self.envs_dir.mkdir(parents=True, exist_ok=True)
        with self._key_lock(key), _file_lock(self.envs_dir / f"{key}.lock"):
            if (final / "env.json").is_file():
                return BuiltEnvironment.load(final)
            for stale in self.envs_dir.glob(f"{key}.building-*"):  # a build that died holding this lock
                shutil.rmtree(stale, ignore_errors=True)
            staging = self.envs_dir / f"{key}.building-{uuid.uuid4().hex[:8]}"
            try:
                self._build_into(staging, key, task, plan)
                os.rename(staging, final)
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
        return BuiltEnvironment.load(final)

    def _key_lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    # -- the build itself -------------------------------------------------------------------------

    def _build_into(self, staging: Path, key: str, task: Task, plan: BuildPlan) -> None:
        workdir = task.environment.workdir
        for sub in ("upper", "ovlwork", "seeds/work", *(f"seeds/{n}" for n in PRIVATE_DIRS), "tops"):
            (staging / sub).mkdir(parents=True, exist_ok=True)
        (staging / "seeds" / "tmp").chmod(0o1777)
        (staging / "seeds" / "vartmp").chmod(0o1777)
        (staging / "seeds" / "home").chmod(0o700)
        for name, is_dir in self._masked.items():
            if is_dir:
                (staging / "tops" / name).mkdir()
        private = {"work": workdir, **PRIVATE_DIRS}
        holder = HolderProcess.start(self._unshare, _build_mounts(staging))
        log = _proc.BoundedBuffer(self.log_bytes // 2, self.log_bytes // 2)
        deadline = time.monotonic() + self.build_timeout_sec
        try:
            merged = Path(f"/proc/{holder.pid}/root/run/t1jax/root")
            resolve = _PathMapper(merged, staging, private, self._masked)
            resolve.ensure_dir(workdir)
            for mount_point in (workdir, *PRIVATE_DIRS.values(), "/tests"):  # sandboxes bind onto these
                resolve.mount_point(mount_point).mkdir(parents=True, exist_ok=True)
            if _is_python_base(plan.base_image):
                _add_python_commands(merged)
            for step in plan.steps:
                if isinstance(step, WorkdirStep):
                    resolve.ensure_dir(step.path)
                elif isinstance(step, CopyStep):
                    _copy_step(step, resolve)
                else:
                    self._run_step(task, step, holder, staging, private, log, deadline)
        finally:
            holder.stop()
        shutil.rmtree(staging / "ovlwork", ignore_errors=True)
        has_upper = any((staging / "upper").iterdir())
        tops = sorted(n for n in os.listdir(staging / "tops") if any((staging / "tops" / n).iterdir()))
        (staging / "build.log").write_text(log.text())
        meta = {
            "key": key,
            "task_id": task.task_id,
            "base_image": plan.base_image,
            "env": [list(kv) for kv in plan.env],
            "workdir": workdir,
            "has_upper": has_upper,
            "seeds": sorted(private),
            "masked_tops": tops,
            "built_at": time.time(),
        }
        (staging / "env.json").write_text(json.dumps(meta, indent=1))

    def _run_step(self, task, step: RunStep, holder, staging, private, log, deadline) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EnvironmentBuildError(
                f"task {task.task_id!r}: build exceeded {self.build_timeout_sec:.0f} s"
            )
        args = [
            self._nsenter, f"--mount=/proc/{holder.pid}/ns/mnt", "--",
            self._bwrap, "--die-with-parent", "--new-session",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "build",
            *([] if self.network else ["--unshare-net"]),
            "--cap-drop", "ALL", *[arg for cap in BUILD_CAPABILITIES for arg in ("--cap-add", cap)],
            "--bind", "/run/t1jax/root", "/",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/run", "--tmpfs", "/dev/shm",
        ]  # fmt: skip
        for name, is_dir in sorted(self._masked.items()):
            if is_dir:
                args += ["--bind", str(staging / "tops" / name), f"/{name}"]
            else:
                args += ["--ro-bind", "/dev/null", f"/{name}"]
        for name, path in sorted(private.items(), key=lambda item: item[1].count("/")):
            args += ["--bind", str(staging / "seeds" / name), path]
        args += ["--chdir", step.workdir, "--", *step.argv]
        env = {
            "PATH": DEFAULT_PATH,
            "HOME": "/root",
            "HOSTNAME": "build",
            **dict(STAND_IN_ENV),
            **dict(step.env),
        }
        result = _proc.run_captured(
            args,
            env=env,
            timeout_sec=remaining,
            head_bytes=self.log_bytes // 2,
            tail_bytes=self.log_bytes // 2,
            on_timeout=lambda proc: _proc.kill_session(proc.pid),
        )
        log.feed(f"$ {shlex.join(step.argv)}\n{result.stdout}{result.stderr}".encode())
        if result.timed_out or result.exit_code != 0:
            why = "timed out" if result.timed_out else f"exited {result.exit_code}"
            tail = (result.stdout + result.stderr)[-2000:]
            raise EnvironmentBuildError(
                f"task {task.task_id!r}: Dockerfile line {step.line} "
                f"RUN {shlex.join(step.argv)[:200]} {why}:\n{tail}"
            )


class _PathMapper:
    """Maps a container path at build time to the host path where the build writes it."""

    def __init__(self, merged: Path, staging: Path, private: Mapping[str, str], masked: Mapping[str, bool]):
        self.merged, self.staging, self.private, self.masked = merged, staging, private, masked

    def host_path(self, container_path: str) -> Path:
        path = os.path.normpath(container_path)
        for name, private_path in sorted(self.private.items(), key=lambda item: -len(item[1])):
            if _is_within(path, private_path):
                return self.staging / "seeds" / name / os.path.relpath(path, private_path)
        top = _first_component(path)
        if top in self.masked:
            if not self.masked[top]:
                raise EnvironmentBuildError(f"cannot write {container_path}: /{top} is a masked host file")
            return self.staging / "tops" / top / os.path.relpath(path, f"/{top}")
        return self.merged / path.lstrip("/")

    def mount_point(self, container_path: str) -> Path:
        """Where the directory a private mount covers lives in the layer (it must exist there)."""
        path = os.path.normpath(container_path)
        top = _first_component(path)
        if top in self.masked and self.masked[top]:
            return self.staging / "tops" / top / os.path.relpath(path, f"/{top}")
        return self.merged / path.lstrip("/")

    def ensure_dir(self, container_path: str) -> Path:
        host = self.host_path(container_path)
        host.mkdir(parents=True, exist_ok=True)
        return host


def _is_python_base(image: str) -> bool:
    repository = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0].lower()
    return repository == "python" or repository.startswith("python-")


def _add_python_commands(merged: Path) -> None:
    for name, target in PYTHON_BASE_COMMANDS:
        if Path(target).exists() and not any(Path(d, name).exists() for d in ("/usr/local/bin", "/usr/bin")):
            link = merged / "usr" / "local" / "bin" / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)


def _copy_step(step: CopyStep, resolve: _PathMapper) -> None:
    into_directory = step.destination.endswith("/")
    for source in step.sources:
        if step.extract_archives and source.is_file() and source.name.endswith(_ARCHIVE_SUFFIXES):
            target = resolve.ensure_dir(step.destination)
            with tarfile.open(source) as archive:
                archive.extractall(target, filter="data")
            continue
        if source.is_dir():
            target = resolve.ensure_dir(step.destination)
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
            if step.chmod is not None:
                for directory, _, files in os.walk(target):
                    for name in files:
                        os.chmod(os.path.join(directory, name), step.chmod)
            continue
        if into_directory:
            target = resolve.ensure_dir(step.destination) / source.name
        else:
            target = resolve.host_path(step.destination)
            target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
        if step.chmod is not None:
            os.chmod(target, step.chmod)


def _build_mounts(staging: Path) -> list[dict]:
    return [
        {"op": "mount", "source": "t1jax-build-staging", "target": "/run", "fstype": "tmpfs",
         "options": "mode=0755,size=16m"},
        {"op": "mkdir", "path": "/run/t1jax/empty", "mode": 0o555},
        {"op": "mkdir", "path": "/run/t1jax/host", "mode": 0o755},
        {"op": "mkdir", "path": "/run/t1jax/root", "mode": 0o755},
        # The host root as its own (overlay) filesystem, so the layer below never overlaps it.
        {"op": "mount", "source": "t1jax-host", "target": "/run/t1jax/host", "fstype": "overlay",
         "readonly": True,
         "nosuid": False, "options": "lowerdir=/run/t1jax/empty:/"},
        {"op": "mount", "source": "t1jax-build", "target": "/run/t1jax/root", "fstype": "overlay",
         "nosuid": False,
         "options": f"lowerdir=/run/t1jax/host,upperdir={staging / 'upper'},workdir={staging / 'ovlwork'}"},
    ]  # fmt: skip


def _hash_tree(digest, path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in sorted(path.rglob("*")):
            _hash_entry(digest, child, path)
    else:
        _hash_entry(digest, path, path.parent)


def _hash_entry(digest, path: Path, base: Path) -> None:
    digest.update(str(path.relative_to(base)).encode() + b"\0")
    if path.is_symlink():
        digest.update(b"L" + os.readlink(path).encode())
    elif path.is_file():
        digest.update(b"F" + oct(path.stat().st_mode & 0o7777).encode())
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    else:
        digest.update(b"D")


class _file_lock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.handle = open(self.path, "a")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
