"""Local environment builder: a task's Dockerfile, interpreted without a container engine, as cached
overlay layers over a stand-in base root.

This module owns parsing the Dockerfile subset the local backend builds, building it into layers,
and the content-addressed cache of layers and environments.

The base: every `FROM` image is replaced by its stand-in root (`base_images.stand_in_for`; built
once with mmdebstrap), extracted with its uids shifted into the sandboxes' uid range
(`SANDBOX_UID_BASE` + 0..65535), so that inside a sandbox's user namespace (uid k <-> host
`SANDBOX_UID_BASE` + k) every file has its normal owner. The local backend always substitutes:
its `EnvironmentAudit` names the stand-in and how it differs from the requested image.

The subset (one stage):
- `FROM`, `ARG` (defaults), `ENV`, `WORKDIR` (any absolute path, `/` included), `USER`, `SHELL`,
  `COPY`/`ADD` of files inside the build context (`--chown` and `--chmod` applied; `ADD` of a
  local tar archive extracts it, keeping its owners), `RUN` in shell form, exec form (a JSON array;
  text that is not valid JSON is shell form, as in Docker) or heredoc form (`RUN <<EOF`).
- `ENTRYPOINT` is run as the sandbox's first process with `sh -c 'sleep infinity'` as its command
  (what Harbor does); `CMD`, `EXPOSE`, `LABEL`, `MAINTAINER`, `VOLUME`, `HEALTHCHECK`,
  `STOPSIGNAL` are accepted and have no effect.
- Rejected, with the line named (the container backend builds them): multi-stage builds and
  `COPY --from`, `ONBUILD`, `RUN --mount`/`--network`, heredocs in `COPY`/`ADD`, `ADD <url>`.

How a build runs: each `RUN`, `COPY`/`ADD` and directory-creating `WORKDIR` is one layer. A step's
layer is the upper directory of an overlay whose lower layers are the steps before it and the base
root, mounted by a holder process (`backends/_holder.py`) in a private mount namespace. `COPY`
writes through that overlay from the host (then owners are set in the shifted range); `RUN`
executes in a bubblewrap sandbox whose `/` is the overlay, in a user namespace mapping the shifted
range (root inside, Docker's default capability set), in its own pid/ipc/uts namespaces, with the
network only when the builder allows it.

Invariants:
- A layer is identified by the sha256 of the builder version, the base recipe, and every step up
  to and including it (with the content of the files it copies); the same key always means the
  same layer, so identical leading steps of different tasks share their layers. A layer and an
  environment are published (renamed into place) only after their build succeeded.
- Builds of one key are serialized across threads and processes (a lock file).
- Built layers and base roots are never written after publication; sandboxes mount them read-only
  as overlay lower layers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import tarfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sandbox_service import dockerfile as lexer
from sandbox_service.backends import _proc
from sandbox_service.backends._proc import DEFAULT_PATH, HolderProcess, require_tool
from sandbox_service.base_images import (
    StandInRecipe,
    StandInStore,
    Substitution,
    UnsupportedImage,
    pinned_python_requirements,
    stand_in_for,
)
from sandbox_service.contracts import SandboxError, Task, UnsupportedEnvironment
from sandbox_service.fidelity import earlier_steps_note, unresolved_hosts
from sandbox_service.host_trust import CA_MOUNT, host_ca_bundle, trust_env
from sandbox_service.locks import file_lock

BUILDER_VERSION = "2"
SANDBOX_UID_BASE = 1_700_000_000  # host uid of uid 0 in every local sandbox's user namespace
SANDBOX_UID_COUNT = 65536
IGNORED_INSTRUCTIONS = frozenset(
    {"CMD", "EXPOSE", "LABEL", "MAINTAINER", "VOLUME", "HEALTHCHECK", "STOPSIGNAL"}
)
DEFAULT_SHELL = ("/bin/sh", "-c")
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
# Docker's default capability set (what root in a container has).
DOCKER_CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_SYS_CHROOT",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
)
MAX_LOWER_CHARS = 3800  # overlayfs options must fit in one page


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
    chown: str | None = None  # "user[:group]" as written (resolved in the layer's /etc/passwd)


@dataclass(frozen=True)
class RunStep:
    line: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    workdir: str
    user: str = ""


@dataclass(frozen=True)
class WorkdirStep:
    line: int
    path: str


Step = CopyStep | RunStep | WorkdirStep


@dataclass(frozen=True)
class BuildPlan:
    """What a Dockerfile asks for, validated against the subset. `env`, `workdir`, `user` and
    `entrypoint` are the final image config (`env` includes the base image's)."""

    base_image: str
    steps: tuple[Step, ...]
    env: tuple[tuple[str, str], ...]
    workdir: str
    dockerfile: Path | None = None
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    python_pins: tuple[str, ...] = ()  # `name==version` its RUN lines pip-install (picks the stand-in)

    def describe_step(self, step: Step) -> list:
        """A JSON-able description of one step; hashed (with copied file contents) into its layer key."""
        if isinstance(step, CopyStep):
            return [
                "COPY",
                [s.name for s in step.sources],
                step.destination,
                step.chmod,
                step.extract_archives,
                step.chown,
            ]
        if isinstance(step, RunStep):
            return ["RUN", list(step.argv), list(step.env), step.workdir, step.user]
        return ["WORKDIR", step.path]


def check_environment(task: Task) -> BuildPlan:
    """Raise `UnsupportedEnvironment` if the local backend cannot build `task`; else its plan."""
    spec = task.environment
    if spec.dockerfile is not None:
        return parse_dockerfile(
            spec.dockerfile.read_text(encoding="utf-8"),
            context_dir=spec.context_dir or spec.dockerfile.parent,
            task_id=task.task_id,
            dockerfile=spec.dockerfile,
        )
    if spec.docker_image is None:
        raise UnsupportedEnvironment(task.task_id, "no Dockerfile and no docker_image")
    recipe = _recipe(task.task_id, spec.docker_image, "[environment].docker_image")[0]
    return BuildPlan(base_image=spec.docker_image, steps=(), env=recipe.env, workdir=spec.workdir)


def _recipe(
    task_id: str, image: str, where: str, python_pins: tuple[str, ...] = ()
) -> tuple[StandInRecipe, Substitution]:
    try:
        return stand_in_for(image, python_pins=python_pins)
    except UnsupportedImage as error:
        raise UnsupportedEnvironment(task_id, f"{where}: base image {image!r}: {error.reason}") from error


def parse_dockerfile(
    text: str, *, context_dir: Path, task_id: str = "?", dockerfile: Path | None = None
) -> BuildPlan:
    """Validate and interpret a Dockerfile against the subset; raise `UnsupportedEnvironment`."""
    context_dir = Path(context_dir).resolve()
    where = dockerfile.name if dockerfile else "Dockerfile"
    pins = pinned_python_requirements(text)

    def reject(line: int, reason: str) -> UnsupportedEnvironment:
        return UnsupportedEnvironment(task_id, f"{where} line {line}: {reason}")

    args: dict[str, str] = {}
    env: dict[str, str] = {}
    workdir, user, shell = "/", "", DEFAULT_SHELL
    entrypoint: tuple[str, ...] = ()
    base: str | None = None
    steps: list[Step] = []
    for instruction in lexer.logical_instructions(text):
        line, keyword, rest = instruction.line, instruction.keyword, instruction.arguments
        if keyword in IGNORED_INSTRUCTIONS:
            continue
        if keyword == "ARG":
            for word in rest.split():
                name, _, default = word.partition("=")
                if not name.replace("_", "a").isalnum() or name[0].isdigit():
                    raise reject(line, f"ARG {rest!r} is not NAME[=default]")
                args[name] = _unquote(lexer.substitute(default, {**args, **env}))
            continue
        if keyword == "FROM":
            if base is not None:
                raise reject(line, "multi-stage builds (a second FROM) need --backend container")
            words = [w for w in rest.split() if not w.startswith("--platform")]
            if not words:
                raise reject(line, "FROM without an image")
            image = lexer.substitute(words[0], args)
            recipe, _ = _recipe(task_id, image, f"{where} line {line}", pins)
            env.update(dict(recipe.env))
            base = image
            continue
        if base is None:
            raise reject(line, f"{keyword} before FROM")
        variables = {**args, **env}
        if keyword == "ENV":
            env.update(_parse_env(rest, variables, lambda reason, at=line: reject(at, reason)))
        elif keyword == "WORKDIR":
            path = lexer.substitute(_unquote(rest.strip()), variables)
            workdir = os.path.normpath(path if path.startswith("/") else os.path.join(workdir, path))
            steps.append(WorkdirStep(line=line, path=workdir))
        elif keyword == "USER":
            user = lexer.substitute(rest.strip(), variables)
        elif keyword == "SHELL":
            shell = _json_array(rest, lambda reason, at=line: reject(at, f"SHELL {reason}"))
        elif keyword == "ENTRYPOINT":
            try:
                entrypoint = _json_array(rest, lambda reason: ValueError(reason))
            except ValueError:
                entrypoint = (*shell, rest.strip())
        elif keyword in ("COPY", "ADD"):
            if instruction.heredocs:
                raise reject(line, f"{keyword} heredocs need --backend container")
            steps.append(_parse_copy(keyword, rest, line, variables, workdir, context_dir, reject))
        elif keyword == "RUN":
            run_env = {**args, **env}  # build arguments are visible to RUN, as in Docker
            steps.append(_parse_run(instruction, run_env, workdir, user, shell, reject))
        elif keyword == "ONBUILD":
            raise reject(line, "ONBUILD is not supported")
        else:
            raise reject(line, f"instruction {keyword} is outside the supported subset")
    if base is None:
        raise UnsupportedEnvironment(task_id, f"{where}: no FROM instruction")
    return BuildPlan(
        base_image=base,
        steps=tuple(steps),
        env=tuple(env.items()),
        workdir=workdir,
        dockerfile=dockerfile,
        python_pins=pins,
        user=user,
        entrypoint=entrypoint,
    )


def _json_array(text: str, reject) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise reject(f"is not a JSON array: {error}") from None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise reject("must be a non-empty JSON array of strings")
    return tuple(value)


def _parse_env(rest: str, variables: Mapping[str, str], reject) -> dict[str, str]:
    rest = rest.strip()
    first = rest.split(None, 1)[0] if rest else ""
    if "=" not in first:  # legacy `ENV KEY value with spaces`
        key, _, value = rest.partition(" ")
        if not key:
            raise reject("ENV without a name")
        return {key: lexer.substitute(value.strip(), variables)}
    result: dict[str, str] = {}
    try:
        words = shlex.split(rest, posix=True)
    except ValueError as error:
        raise reject(f"ENV {rest!r}: {error}") from error
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise reject(f"ENV entry {word!r} is not KEY=value")
        result[key] = lexer.substitute(value, {**variables, **result})
    return result


def _parse_copy(instruction, rest, line, variables, workdir, context_dir, reject) -> CopyStep:
    try:
        words = json.loads(rest) if rest.strip().startswith("[") else shlex.split(rest)
    except (json.JSONDecodeError, ValueError) as error:
        raise reject(line, f"{instruction} {rest!r}: {error}") from error
    chmod = chown = None
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0)[2:].partition("=")
        if flag == "chmod":
            try:
                chmod = int(value, 8)
            except ValueError:
                raise reject(line, f"{instruction} --chmod={value!r} is not octal") from None
        elif flag == "chown":
            chown = lexer.substitute(value, variables)
        elif flag == "link":
            continue
        elif flag == "from":
            raise reject(line, f"{instruction} --from (multi-stage) needs --backend container")
        else:
            raise reject(line, f"{instruction} --{flag} is not supported")
    if len(words) < 2:
        raise reject(line, f"{instruction} needs a source and a destination")
    *sources, destination = [lexer.substitute(str(w), variables) for w in words]
    resolved: list[Path] = []
    for source in sources:
        if "://" in source or source.startswith("git@"):
            raise reject(line, f"{instruction} of a URL ({source}) needs --backend container")
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
        destination = destination.rstrip("/") + "/"
    return CopyStep(
        line=line,
        sources=tuple(resolved),
        destination=destination,
        chmod=chmod,
        extract_archives=instruction == "ADD",
        chown=chown,
    )


def _parse_run(instruction: lexer.Instruction, env, workdir, user, shell, reject) -> RunStep:
    rest, line = instruction.arguments, instruction.line
    if rest.startswith("--"):
        raise reject(line, f"RUN {rest.split(None, 1)[0].split('=')[0]} needs --backend container")
    if instruction.heredocs:
        if len(instruction.heredocs) != 1 or not rest.lstrip().startswith("<<"):
            raise reject(
                line, "RUN with several heredocs, or a command before one, needs --backend container"
            )
        argv: tuple[str, ...] = (*shell, instruction.heredocs[0][1])
    elif rest.startswith("["):
        try:  # exec form; text that is not a JSON array is shell form, as in Docker (`RUN [ -e x ] ...`)
            value = json.loads(rest)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, list) and value and all(isinstance(a, str) for a in value):
            argv = tuple(value)
        else:
            argv = (*shell, rest)
    else:
        if not rest:
            raise reject(line, "RUN without a command")
        argv = (*shell, rest)
    return RunStep(line=line, argv=argv, env=tuple(env.items()), workdir=workdir, user=user)


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


# ------------------------------------------------------------------------------------------------
# Built environments and the cache


@dataclass(frozen=True)
class BuiltEnvironment:
    """A published environment: the base root plus layers (host paths, topmost first) and the image
    config. `substitution` says what stands in for the requested base image."""

    key: str
    base_image: str
    base_root: Path
    layers: tuple[Path, ...]
    env: tuple[tuple[str, str], ...]
    workdir: str
    user: str
    entrypoint: tuple[str, ...]
    substitution: Substitution
    recipe: str = ""

    @property
    def lower_stack(self) -> tuple[Path, ...]:
        """The overlay lower directories, topmost first (the layers, then the base root)."""
        return (*self.layers, self.base_root)

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "base_image": self.base_image,
            "base_root": str(self.base_root),
            "layers": [str(p) for p in self.layers],
            "env": [list(kv) for kv in self.env],
            "workdir": self.workdir,
            "user": self.user,
            "entrypoint": list(self.entrypoint),
            "substitution": self.substitution.to_json(),
            "recipe": self.recipe,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> BuiltEnvironment:
        sub = data["substitution"]
        return cls(
            key=data["key"],
            base_image=data["base_image"],
            base_root=Path(data["base_root"]),
            layers=tuple(Path(p) for p in data["layers"]),
            env=tuple((k, v) for k, v in data["env"]),
            workdir=data["workdir"],
            user=data["user"],
            entrypoint=tuple(data["entrypoint"]),
            substitution=Substitution(
                sub["requested"], sub["stand_in"], sub["recipe"], tuple(sub["differences"])
            ),
            recipe=data.get("recipe", ""),
        )


class EnvironmentBuilder:
    """Builds and caches layers under `cache_dir/layers/<key>/` and environments under
    `cache_dir/envs/<key>.json`, over stand-in roots from `stand_ins`. Thread- and process-safe."""

    def __init__(
        self,
        cache_dir: Path,
        *,
        stand_ins: StandInStore | None = None,
        network: bool = True,
        build_timeout_sec: float = 1800.0,
        log_bytes: int = 64 * 1024,
    ):
        cache_dir = Path(cache_dir).resolve()
        self.layers_dir = cache_dir / "layers"
        self.envs_dir = cache_dir / "envs"
        self.stand_ins = stand_ins or StandInStore(cache_dir / "stand-ins")
        self.network = network
        self.build_timeout_sec = build_timeout_sec
        self.log_bytes = log_bytes
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._tools = {name: require_tool(name) for name in ("bwrap", "nsenter", "unshare", "setpriv")}

    def environment_key(self, plan: BuildPlan, recipe: StandInRecipe, task: Task) -> str:
        return (
            self._chain_keys(plan, recipe)[-1]
            if plan.steps
            else _digest([BUILDER_VERSION, recipe.key, "no steps"])
        )

    def _chain_keys(self, plan: BuildPlan, recipe: StandInRecipe) -> list[str]:
        keys, previous = [], _digest([BUILDER_VERSION, recipe.key, self.network])
        for step in plan.steps:
            digest = hashlib.sha256(json.dumps([previous, plan.describe_step(step)]).encode())
            if isinstance(step, CopyStep):
                for source in step.sources:
                    _hash_tree(digest, source)
            previous = digest.hexdigest()[:32]
            keys.append(previous)
        return keys

    def build(self, task: Task) -> BuiltEnvironment:
        """The task's built environment, from the cache or built now (raises `UnsupportedEnvironment`
        before doing anything for a Dockerfile outside the subset, `EnvironmentBuildError` on failure)."""
        plan = check_environment(task)
        recipe, substitution = _recipe(task.task_id, plan.base_image, "FROM", plan.python_pins)
        keys = self._chain_keys(plan, recipe)
        env_key = _digest([keys, plan.env, plan.workdir, plan.user, plan.entrypoint, recipe.key])
        record = self.envs_dir / f"{env_key}.json"
        if record.is_file():
            built = BuiltEnvironment.from_json(json.loads(record.read_text()))
            if all(path.is_dir() for path in built.lower_stack):  # else a stand-in dir moved: rebuild
                return built
        base_root = self.stand_ins.shifted_root(recipe, SANDBOX_UID_BASE)
        layers: list[Path] = []  # bottom first while building
        for number, (step, key) in enumerate(zip(plan.steps, keys, strict=True)):
            try:
                layer = self._layer(task, step, key, base_root, layers)
            except EnvironmentBuildError as error:
                raise EnvironmentBuildError(f"{error}{self._earlier_logs_note(keys[:number])}") from error
            if layer is not None:
                layers.append(layer)
        environment = BuiltEnvironment(
            key=env_key,
            base_image=plan.base_image,
            base_root=base_root,
            layers=tuple(reversed(layers)),
            env=plan.env,
            workdir=plan.workdir,
            user=plan.user,
            entrypoint=plan.entrypoint,
            substitution=substitution,
            recipe=recipe.name,
        )
        self.envs_dir.mkdir(parents=True, exist_ok=True)
        temporary = self.envs_dir / f".{env_key}.{uuid.uuid4().hex[:8]}.tmp"
        temporary.write_text(json.dumps(environment.to_json(), indent=1))
        os.replace(temporary, record)
        return environment

    def _layer(self, task: Task, step: Step, key: str, base_root: Path, below: list[Path]) -> Path | None:
        """The published layer of one step (None when the step changed nothing)."""
        final = self.layers_dir / key
        if (final / "layer.json").is_file():
            return final / "diff" if json.loads((final / "layer.json").read_text())["changed"] else None
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        with self._key_lock(key), file_lock(self.layers_dir / f".{key}.lock"):
            if (final / "layer.json").is_file():
                return final / "diff" if json.loads((final / "layer.json").read_text())["changed"] else None
            for stale in self.layers_dir.glob(f"{key}.building-*"):  # a build that died holding this lock
                shutil.rmtree(stale, ignore_errors=True)
            staging = self.layers_dir / f"{key}.building-{uuid.uuid4().hex[:8]}"
            try:
                log = self._build_step(task, step, staging, base_root, below)
                shutil.rmtree(staging / "work", ignore_errors=True)
                shutil.rmtree(staging / "copy", ignore_errors=True)
                changed = any((staging / "diff").iterdir())
                (staging / "build.log").write_text(log)
                (staging / "layer.json").write_text(
                    json.dumps(
                        {"key": key, "task_id": task.task_id, "changed": changed, "built_at": time.time()}
                    )
                )
                os.rename(staging, final)
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
        return final / "diff" if changed else None

    def _earlier_logs_note(self, keys: list[str]) -> str:
        """What earlier (succeeded) steps' logs say could not be resolved: `curl ... | sh` passes
        when the download fails, and only a later step notices that nothing was installed."""
        logs = [self.layers_dir / key / "build.log" for key in keys]
        return earlier_steps_note(
            unresolved_hosts("\n".join(log.read_text(errors="replace") for log in logs if log.is_file()))
        )

    def _key_lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def _build_step(self, task: Task, step: Step, staging: Path, base_root: Path, below: list[Path]) -> str:
        for sub in ("diff", "work"):
            (staging / sub).mkdir(parents=True)
            os.chown(staging / sub, SANDBOX_UID_BASE, SANDBOX_UID_BASE)
        lower = ":".join(str(p) for p in (*reversed(below), base_root))
        if len(lower) > MAX_LOWER_CHARS:
            raise EnvironmentBuildError(f"task {task.task_id!r}: too many layers for one overlay mount")
        ops = [
            {
                "op": "mount",
                "source": "t1jax-build",
                "target": "/run",
                "fstype": "tmpfs",
                "options": "mode=0755,size=16m",
            },
            {"op": "mkdir", "path": "/run/t1jax/root", "mode": 0o755},
            {
                "op": "mount",
                "source": "t1jax-build-layer",
                "target": "/run/t1jax/root",
                "fstype": "overlay",
                "nosuid": False,
                "options": f"lowerdir={lower},upperdir={staging / 'diff'},workdir={staging / 'work'}",
            },
            {"op": "userns", "name": "build", "base": SANDBOX_UID_BASE, "count": SANDBOX_UID_COUNT},
        ]
        copy_script = ""
        if isinstance(step, CopyStep):  # sources staged (owned by the sandbox's root), bound by the holder
            copy_script, staged = _stage_copy(step, staging / "copy")
            for index, directory in enumerate(staged):
                ops.append({"op": "mkdir", "path": f"{COPY_STAGING}/{index}", "mode": 0o755})
                ops.append(
                    {
                        "op": "bind",
                        "source": str(directory),
                        "target": f"{COPY_STAGING}/{index}",
                        "readonly": True,
                    }
                )
        holder = HolderProcess.start(self._tools["unshare"], ops)
        try:
            if isinstance(step, WorkdirStep):
                script = f"mkdir -p {shlex.quote(step.path)}"
                argv = ("/bin/sh", "-c", script)
                return self._run_in_build(task, holder, step.line, "WORKDIR", argv, network=False)
            if isinstance(step, CopyStep):
                user = resolve_user(self._merged(holder), step.chown) if step.chown else (0, 0)
                argv = ("/bin/sh", "-c", copy_script.replace("{owner}", f"{user[0]}:{user[1]}"))
                binds = tuple(
                    (f"{COPY_STAGING}/{i}", f"{COPY_SOURCE_MOUNT}/{i}") for i in range(len(step.sources))
                )
                keyword = "ADD" if step.extract_archives else "COPY"
                return self._run_in_build(task, holder, step.line, keyword, argv, network=False, binds=binds)
            named = bool(step.user) and not step.user.partition(":")[0].isdigit()
            uid, gid = resolve_user(self._merged(holder), step.user)
            # A RUN after USER: the image's own setpriv switches (bwrap cannot switch uids in a
            # joined user namespace; the build runs the task's own code anyway).
            switch_user = [] if uid == 0 else [
                "setpriv", "--reuid", str(uid), "--regid", str(gid),
                "--init-groups" if named else "--clear-groups", "--",
            ]  # fmt: skip
            env = {"HOME": user_home(self._merged(holder), uid), **dict(step.env)}
            return self._run_in_build(
                task,
                holder,
                step.line,
                "RUN",
                (*switch_user, *step.argv),
                env=env,
                workdir=step.workdir,
                network=self.network,
            )
        finally:
            holder.stop()

    @staticmethod
    def _merged(holder: HolderProcess) -> Path:
        return Path(f"/proc/{holder.pid}/root/run/t1jax/root")

    def _run_in_build(
        self,
        task: Task,
        holder: HolderProcess,
        line: int,
        keyword: str,
        argv: tuple[str, ...],
        *,
        network: bool,
        env: Mapping[str, str] | None = None,
        workdir: str = "/",
        binds: tuple[tuple[str, str], ...] = (),
    ) -> str:
        """Run one step's command in a build sandbox over the step's overlay (as the image's root,
        with Docker's capability set): RUN steps, and COPY/ADD/WORKDIR too, so that every path
        resolves inside the image (a symlink a layer planted can never point a write at the host).
        `binds` are (path in the holder's namespace, path under /dev) read-only inputs; /dev is a
        tmpfs of the sandbox, so nothing of them lands in the layer."""
        userns = os.open(f"/proc/{holder.userns['build']}/ns/user", os.O_RDONLY)
        environment = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": "build", **(env or {})}
        bundle = host_ca_bundle() if network else None
        extra = [arg for source, inside in binds for arg in ("--ro-bind", source, inside)]
        if bundle is not None:  # a TLS-inspecting proxy: trust the host's CAs for this step only
            extra += ["--ro-bind", str(bundle), CA_MOUNT]
            environment.update(trust_env())
        try:
            args = [
                self._tools["nsenter"], f"--mount=/proc/{holder.pid}/ns/mnt", "--",
                self._tools["setpriv"], "--reuid", str(SANDBOX_UID_BASE), "--regid", str(SANDBOX_UID_BASE),
                "--clear-groups", "--",
                self._tools["bwrap"], "--userns", str(userns), "--die-with-parent", "--new-session",
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "build",
                *([] if network else ["--unshare-net"]),
                "--cap-drop", "ALL", *[arg for cap in DOCKER_CAPABILITIES for arg in ("--cap-add", cap)],
                "--bind", "/run/t1jax/root", "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm",
                *(["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"] if network else []),
                *extra, "--chdir", workdir, "--", *argv,
            ]  # fmt: skip
            result = _proc.run_captured(
                args,
                env=environment,
                timeout_sec=self.build_timeout_sec,
                head_bytes=self.log_bytes // 2,
                tail_bytes=self.log_bytes // 2,
                on_timeout=lambda proc: _proc.kill_session(proc.pid),
                pass_fds=(userns,),
            )
        finally:
            os.close(userns)
        log = f"{keyword} $ {shlex.join(argv)}\n{result.stdout}{result.stderr}"
        if result.timed_out or result.exit_code != 0:
            why = "timed out" if result.timed_out else f"exited {result.exit_code}"
            tail = (result.stdout + result.stderr)[-2000:]
            raise EnvironmentBuildError(
                f"task {task.task_id!r}: Dockerfile line {line} {keyword} {shlex.join(argv)[:200]} "
                f"{why}:\n{tail}"
            )
        return log


def stack_file(stack: Path | tuple[Path, ...], relative: str) -> Path | None:
    """The host path of `relative` (e.g. "etc/passwd") in a root, or in an overlay's lower layers
    given topmost first (the first layer that has it wins, as in the mounted overlay)."""
    for layer in (stack,) if isinstance(stack, Path) else stack:
        path = layer / relative
        if path.is_symlink() or path.exists():
            return path if not (path.is_char_device() and os.stat(path).st_rdev == 0) else None  # a whiteout
    return None


def resolve_user(root: Path | tuple[Path, ...], user: str) -> tuple[int, int]:
    """(uid, gid) inside the image for a Docker `USER` value ("", "name", "uid", "name:group", ...),
    looked up in the /etc/passwd and /etc/group of `root` (a directory, or layers topmost first)."""
    if not user:
        return 0, 0
    name, _, group = user.partition(":")
    passwd = _table(stack_file(root, "etc/passwd"))
    groups = _table(stack_file(root, "etc/group"))
    if name.isdigit():
        uid = int(name)
        gid = next((int(e[3]) for e in passwd.values() if e[2] == name), uid)
    elif name in passwd:
        uid, gid = int(passwd[name][2]), int(passwd[name][3])
    else:
        raise EnvironmentBuildError(f"USER {user!r}: no user {name!r} in the image's /etc/passwd")
    if group:
        if group.isdigit():
            gid = int(group)
        elif group in groups:
            gid = int(groups[group][2])
        else:
            raise EnvironmentBuildError(f"USER {user!r}: no group {group!r} in the image's /etc/group")
    return uid, gid


def user_home(root: Path | tuple[Path, ...], uid: int) -> str:
    for entry in _table(stack_file(root, "etc/passwd")).values():
        if entry[2] == str(uid) and len(entry) > 5:
            return entry[5]
    return "/root" if uid == 0 else "/"


def _table(path: Path | None) -> dict[str, list[str]]:
    if path is None:
        return {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    return {fields[0]: fields for fields in (line.split(":") for line in lines) if len(fields) >= 4}


COPY_STAGING = "/run/t1jax/copy"  # in the build holder's namespace
COPY_SOURCE_MOUNT = "/dev/.t1jax-copy"  # in the build sandbox (a tmpfs: nothing lands in the layer)


def _stage_copy(step: CopyStep, staging: Path) -> tuple[str, list[Path]]:
    """Stage one COPY/ADD's sources under `staging` (one directory per source, owned by the
    sandbox's root so its root can read them whatever their host modes) and return the shell script
    (for the image's /bin/sh, as its root) that performs the copy, with `{owner}` standing for the
    --chown uid:gid. Docker's rules: a directory's contents are copied, not the directory; a
    destination ending in '/' (or several sources) is a directory; ADD extracts a local tar archive
    keeping its owners (decompressed here first); files get the --chmod mode; every copied entry,
    and nothing else, gets the --chown owner."""
    q = shlex.quote
    staged: list[Path] = []
    lines = ["set -e"]
    destination = step.destination.rstrip("/") or "/"
    into_directory = step.destination.endswith("/")
    for index, source in enumerate(step.sources):
        directory = staging / str(index)
        directory.mkdir(parents=True)
        staged.append(directory)
        inside = f"{COPY_SOURCE_MOUNT}/{index}"
        if step.extract_archives and source.is_file() and source.name.endswith(_ARCHIVE_SUFFIXES):
            with tarfile.open(source) as archive, tarfile.open(directory / "archive.tar", "w") as plain:
                for member in archive:
                    plain.addfile(member, archive.extractfile(member) if member.isfile() else None)
            lines.append(
                f"mkdir -p {q(destination)} && "
                f"tar -x -p --same-owner -f {inside}/archive.tar -C {q(destination)}"
            )
        elif source.is_dir():
            shutil.copytree(source, directory, symlinks=True, dirs_exist_ok=True)
            lines.append(
                f"mkdir -p {q(destination)} && "
                f"cp -R --preserve=mode,timestamps,links {inside}/. {q(destination)}/"
            )
            if step.chown:
                lines.append(f"(cd {inside} && find . -mindepth 1) | "
                             f'while IFS= read -r p; do chown -h {{owner}} {q(destination)}/"$p"; done; '
                             f"chown {{owner}} {q(destination)}")  # fmt: skip
            if step.chmod is not None:
                lines.append(f"(cd {inside} && find . -type f) | "
                             f"while IFS= read -r p; do "
                             f'chmod {step.chmod:o} {q(destination)}/"$p"; done')  # fmt: skip
        else:
            shutil.copy2(source, directory / source.name, follow_symlinks=False)
            target = f"{destination}/{source.name}" if into_directory else destination
            lines.append(f"mkdir -p {q(os.path.dirname(target) or '/')} && "
                         f"cp -P --preserve=mode,timestamps,links "
                         f"{inside}/{q(source.name)} {q(target)}")  # fmt: skip
            if step.chown:
                lines.append(f"chown -h {{owner}} {q(target)}")
            if step.chmod is not None:
                lines.append(f"chmod {step.chmod:o} {q(target)}")
        _chown_tree(directory, SANDBOX_UID_BASE, SANDBOX_UID_BASE)
    return "\n".join(lines) + "\n", staged


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    for path in [root, *root.rglob("*")]:
        os.lchown(path, uid, gid)


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


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
