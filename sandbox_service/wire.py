"""JSON and tarball encodings of the contract types, shared by the server and the client.

This module owns how a `Task`, an `ExecResult`, a `TerminalRead` and a `VerifierReport` travel over
HTTP, and how a task directory is shipped to a service that may not share the caller's filesystem.

How a task reaches the service: the client packs the task's `source_dir` into a deterministic
gzip tarball and names it by `task_digest` (sha256 over every entry's relative path, kind, mode
and content). It uploads the tarball once (`PUT /tasks/{digest}`); every later `create` sends the
digest plus `task_to_json(task)`, whose paths are relative to the task directory, and the server
rebases them onto its unpacked copy. So the server runs exactly the `Task` the caller built
(including limits the caller overrode), and a remote service works the same as a local one.

Invariants:
- `task_digest(d)` depends only on the directory's contents (not mtimes, owners or walk order), and
  `task_digest(unpack(pack(d))) == task_digest(d)`.
- `task_from_json(task_to_json(t, root), root) == t` for every `Task` whose paths lie inside root.
- Decoding rejects bad input with `BadRequest` naming the field; it never returns a half-built object.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sandbox_service.contracts import (
    AssertionResult,
    Difficulty,
    EnvironmentSpec,
    ExecResult,
    FailureCause,
    Task,
    TaskLayout,
    TaskLimits,
    TaskStep,
    TerminalRead,
    VerifierReport,
)
from sandbox_service.errors import BadRequest

API_PREFIX = "/v1"  # every route of the HTTP API lives under this path

# --------------------------------------------------------------------------------------------------
# Task directory: digest, pack, unpack


def _entries(root: Path) -> Iterator[tuple[str, os.stat_result, Path]]:
    """Every entry below root (not root itself), sorted by relative POSIX path."""
    found: list[tuple[str, os.stat_result, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for name in dirnames + filenames:
            path = base / name
            found.append((path.relative_to(root).as_posix(), path.lstat(), path))
    found.sort(key=lambda item: item[0])
    return iter(found)


def task_digest(root: Path) -> str:
    """sha256 (hex) of a task directory's contents: relative paths, entry kinds, exec bits, bytes."""
    root = Path(root)
    if not root.is_dir():
        raise BadRequest(f"task directory {root} does not exist or is not a directory")
    digest = hashlib.sha256()
    for rel, st, path in _entries(root):
        if stat.S_ISDIR(st.st_mode):
            digest.update(b"D\0" + rel.encode() + b"\0")
        elif stat.S_ISLNK(st.st_mode):
            digest.update(b"L\0" + rel.encode() + b"\0" + os.readlink(path).encode() + b"\0")
        elif stat.S_ISREG(st.st_mode):
            executable = b"x" if st.st_mode & 0o111 else b"-"
            digest.update(b"F\0" + rel.encode() + b"\0" + executable + str(st.st_size).encode() + b"\0")
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
        # sockets, fifos and devices are not part of a task and are skipped by pack() too
    return digest.hexdigest()


def pack_task_dir(root: Path) -> bytes:
    """A gzip tarball of root's contents with normalized owners, times and modes."""
    root = Path(root)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for rel, st, path in _entries(root):
            info = tarfile.TarInfo(rel)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                archive.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
                info.mode = 0o777
                archive.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                info.size = st.st_size
                info.mode = 0o755 if st.st_mode & 0o111 else 0o644
                with open(path, "rb") as handle:
                    archive.addfile(info, handle)
    return gzip.compress(buffer.getvalue(), compresslevel=6, mtime=0)  # mtime=0: reproducible bytes


def unpack_task_dir(data: bytes, destination: Path) -> None:
    """Unpack a tarball made by `pack_task_dir` into destination (created), refusing entries that
    would escape it (absolute paths, `..`, links outside): tarfile's `data` filter."""
    destination.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            archive.extractall(destination, filter="data")
    except (tarfile.TarError, OSError, EOFError) as error:
        raise BadRequest(f"task upload is not a valid task tarball: {error}") from error


# --------------------------------------------------------------------------------------------------
# Task <-> JSON


def _path_to_json(value: Path | None, root: Path, field_name: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not value.is_absolute():
        return {"as_given": value.as_posix()}
    try:
        return {"task_relative": value.relative_to(root).as_posix()}
    except ValueError:
        raise BadRequest(
            f"Task.{field_name} = {value} lies outside the task directory {root}; the service "
            "receives only the task directory, so every task file must live inside it"
        ) from None


def _path_from_json(value: Any, root: Path, field_name: str) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) != 1:
        raise BadRequest(f"task.{field_name} must be {{'task_relative': ...}} or {{'as_given': ...}}")
    ((kind, text),) = value.items()
    if not isinstance(text, str):
        raise BadRequest(f"task.{field_name}.{kind} must be a string")
    if kind == "as_given":
        return Path(text)
    if kind == "task_relative":
        relative = Path(text)
        if relative.is_absolute() or ".." in relative.parts:
            raise BadRequest(f"task.{field_name} = {text!r} escapes the task directory")
        return root / relative
    raise BadRequest(f"task.{field_name} has unknown path kind {kind!r}")


def task_to_json(task: Task, root: Path | None = None) -> dict[str, Any]:
    """Encode task; absolute paths become relative to root (default: task.source_dir)."""
    root = Path(root or task.source_dir)
    env = task.environment
    return {
        "task_id": task.task_id,
        "instruction": task.instruction,
        "layout": task.layout.value,
        "environment": {
            "dockerfile": _path_to_json(env.dockerfile, root, "environment.dockerfile"),
            "docker_image": env.docker_image,
            "context_dir": _path_to_json(env.context_dir, root, "environment.context_dir"),
            "workdir": env.workdir,
            "cpus": env.cpus,
            "memory_mb": env.memory_mb,
            "storage_mb": env.storage_mb,
            "allow_internet": env.allow_internet,
            "env": dict(env.env),
            "workdir_from": env.workdir_from,
            "gpus": env.gpus,
        },
        "tests_dir": _path_to_json(task.tests_dir, root, "tests_dir"),
        "test_script": _path_to_json(task.test_script, root, "test_script"),
        "solution_script": _path_to_json(task.solution_script, root, "solution_script"),
        "difficulty": task.difficulty.value,
        "category": task.category,
        "tags": list(task.tags),
        "family": task.family,
        "parser_name": task.parser_name,
        "limits": limits_to_json(task.limits),
        "solution_env": dict(task.solution_env),
        "verifier_env": dict(task.verifier_env),
        "tests_layers": [_path_to_json(layer, root, "tests_layers") for layer in task.tests_layers],
        "multi_step_reward": task.multi_step_reward,
        "steps": [
            {
                "name": step.name,
                "instruction": step.instruction,
                "tests_layers": [
                    _path_to_json(layer, root, "steps.tests_layers") for layer in step.tests_layers
                ],
                "tests_dir": _path_to_json(step.tests_dir, root, "steps.tests_dir"),
                "limits": limits_to_json(step.limits),
                "solution_script": _path_to_json(step.solution_script, root, "steps.solution_script"),
                "workdir_dir": _path_to_json(step.workdir_dir, root, "steps.workdir_dir"),
                "verifier_env": dict(step.verifier_env),
                "min_reward": dict(step.min_reward)
                if isinstance(step.min_reward, Mapping)
                else step.min_reward,
            }
            for step in task.steps
        ],
    }


def _steps_from_json(data: Any, root: Path) -> tuple[TaskStep, ...]:
    if not isinstance(data, list):
        raise BadRequest("task.steps must be a list")
    steps = []
    for number, item in enumerate(data, start=1):
        where = f"task.steps[{number}]"
        if not isinstance(item, Mapping):
            raise BadRequest(f"{where} must be an object")
        min_reward = item.get("min_reward")
        if min_reward is not None and not (
            (isinstance(min_reward, int | float) and not isinstance(min_reward, bool))
            or (
                isinstance(min_reward, Mapping)
                and all(isinstance(v, int | float) for v in min_reward.values())
            )
        ):
            raise BadRequest(f"{where}.min_reward must be a number or an object of numbers")
        layers = item.get("tests_layers", [])
        if not isinstance(layers, list):
            raise BadRequest(f"{where}.tests_layers must be a list")
        step = TaskStep(
            name=_require(item, "name", str, where),
            instruction=_require(item, "instruction", str, where),
            tests_layers=tuple(_path_from_json(layer, root, "steps.tests_layers") for layer in layers),
            tests_dir=_path_from_json(_require(item, "tests_dir", Mapping, where), root, "steps.tests_dir"),
            limits=limits_from_json(_require(item, "limits", Mapping, where), f"{where}.limits"),
            solution_script=_path_from_json(item.get("solution_script"), root, "steps.solution_script"),
            workdir_dir=_path_from_json(item.get("workdir_dir"), root, "steps.workdir_dir"),
            verifier_env=_string_map(item.get("verifier_env", {}), f"{where}.verifier_env"),
            min_reward=dict(min_reward) if isinstance(min_reward, Mapping) else min_reward,
        )
        if not step.instruction.strip() or not (step.tests_dir / "test.sh").is_file():
            raise BadRequest(f"{where}: empty instruction, or no test.sh in its tests directory")
        steps.append(step)
    return tuple(steps)


def limits_to_json(limits: TaskLimits) -> dict[str, float]:
    return {
        "agent_timeout_sec": limits.agent_timeout_sec,
        "verifier_timeout_sec": limits.verifier_timeout_sec,
        "total_timeout_sec": limits.total_timeout_sec,
    }


def _require(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise BadRequest(f"{where}.{key} is missing")
    value = data[key]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise BadRequest(f"{where}.{key} must be a number, got {value!r}")
    if not isinstance(value, kind):
        raise BadRequest(f"{where}.{key} has type {type(value).__name__}, expected {kind}")
    return value


def limits_from_json(data: Any, where: str = "task.limits") -> TaskLimits:
    if not isinstance(data, Mapping):
        raise BadRequest(f"{where} must be an object")
    values = {
        key: float(_require(data, key, (int, float), where))
        for key in ("agent_timeout_sec", "verifier_timeout_sec", "total_timeout_sec")
    }
    for key, value in values.items():
        if not value > 0:
            raise BadRequest(f"{where}.{key} must be positive, got {value}")
    return TaskLimits(**values)


def _enum(cls: type, value: Any, where: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(member.value for member in cls)  # type: ignore[attr-defined]
        raise BadRequest(f"{where} = {value!r} is not one of: {allowed}") from None


def _enum_value(value: Any, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise BadRequest(f"{where}.multi_step_reward = {value!r} is not one of: {', '.join(allowed)}")
    return value


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise BadRequest("task.tests_layers must be a list")
    return value


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise BadRequest(f"{where} must map strings to strings")
    return dict(value)


def task_from_json(data: Any, root: Path) -> Task:
    """Decode a task whose directory lives at root; checks the `Task` invariants that concern files
    (tests directory and test script present) and values (non-empty instruction, positive limits)."""
    if not isinstance(data, Mapping):
        raise BadRequest("task must be a JSON object")
    root = Path(root)
    env_data = _require(data, "environment", Mapping, "task")
    env_vars = _string_map(env_data.get("env", {}), "task.environment.env")
    gpus = env_data.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise BadRequest(f"task.environment.gpus must be a non-negative integer, got {gpus!r}")
    environment = EnvironmentSpec(
        dockerfile=_path_from_json(env_data.get("dockerfile"), root, "environment.dockerfile"),
        docker_image=env_data.get("docker_image"),
        context_dir=_path_from_json(env_data.get("context_dir"), root, "environment.context_dir"),
        workdir=_require(env_data, "workdir", str, "task.environment"),
        cpus=float(_require(env_data, "cpus", (int, float), "task.environment")),
        memory_mb=int(_require(env_data, "memory_mb", int, "task.environment")),
        storage_mb=int(_require(env_data, "storage_mb", int, "task.environment")),
        allow_internet=bool(_require(env_data, "allow_internet", bool, "task.environment")),
        env=env_vars,
        workdir_from=str(env_data.get("workdir_from", "default")),
        gpus=gpus,
    )
    tags = data.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise BadRequest("task.tags must be a list of strings")
    family = data.get("family", "")
    if not isinstance(family, str):
        raise BadRequest("task.family must be a string")
    tests_dir = _path_from_json(_require(data, "tests_dir", Mapping, "task"), root, "tests_dir")
    test_script = _path_from_json(_require(data, "test_script", Mapping, "task"), root, "test_script")
    task = Task(
        task_id=_require(data, "task_id", str, "task"),
        instruction=_require(data, "instruction", str, "task"),
        source_dir=root,
        layout=_enum(TaskLayout, data.get("layout"), "task.layout"),
        environment=environment,
        tests_dir=tests_dir,  # type: ignore[arg-type]
        test_script=test_script,  # type: ignore[arg-type]
        solution_script=_path_from_json(data.get("solution_script"), root, "solution_script"),
        difficulty=_enum(Difficulty, data.get("difficulty", "unknown"), "task.difficulty"),
        category=str(data.get("category", "software_engineering")),
        tags=tuple(tags),
        family=family,
        parser_name=str(data.get("parser_name", "pytest")),
        limits=limits_from_json(_require(data, "limits", Mapping, "task"), "task.limits"),
        solution_env=_string_map(data.get("solution_env", {}), "task.solution_env"),
        verifier_env=_string_map(data.get("verifier_env", {}), "task.verifier_env"),
        steps=_steps_from_json(data.get("steps", []), root),
        multi_step_reward=_enum_value(data.get("multi_step_reward", "mean"), ("mean", "final"), "task"),
        tests_layers=tuple(
            _path_from_json(layer, root, "tests_layers") for layer in _list(data.get("tests_layers", []))
        ),
    )
    if not task.task_id.strip():
        raise BadRequest("task.task_id is empty")
    if not task.instruction.strip():
        raise BadRequest(f"task {task.task_id}: instruction is empty")
    if not task.tests_dir.is_dir():
        raise BadRequest(f"task {task.task_id}: tests directory {task.tests_dir} is missing in the upload")
    return task


# --------------------------------------------------------------------------------------------------
# Results <-> JSON


def exec_result_to_json(result: ExecResult) -> dict[str, Any]:
    return {
        "stdout": result.stdout,
        "stderr": result.stderr,
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "duration_sec": result.duration_sec,
        "stdout_omitted_bytes": result.stdout_omitted_bytes,
        "stderr_omitted_bytes": result.stderr_omitted_bytes,
    }


def exec_result_from_json(data: Mapping[str, Any]) -> ExecResult:
    return ExecResult(
        stdout=data["stdout"],
        stderr=data["stderr"],
        exit_code=data["exit_code"],
        timed_out=bool(data["timed_out"]),
        duration_sec=float(data["duration_sec"]),
        stdout_omitted_bytes=int(data.get("stdout_omitted_bytes", 0)),
        stderr_omitted_bytes=int(data.get("stderr_omitted_bytes", 0)),
    )


def terminal_read_to_json(read: TerminalRead) -> dict[str, Any]:
    return {"text": read.text, "omitted_bytes": read.omitted_bytes}


def terminal_read_from_json(data: Mapping[str, Any]) -> TerminalRead:
    return TerminalRead(text=data["text"], omitted_bytes=int(data.get("omitted_bytes", 0)))


def verifier_report_to_json(report: VerifierReport) -> dict[str, Any]:
    return {
        "assertions": [{"name": a.name, "passed": a.passed} for a in report.assertions],
        "parsed": report.parsed,
        "failure_cause": report.failure_cause.value,
        "binary_outcome": report.binary_outcome,
        "reward_value": report.reward_value,
        "detail": report.detail,
        "output_tail": report.output_tail,
    }


def verifier_report_from_json(data: Mapping[str, Any]) -> VerifierReport:
    return VerifierReport(
        assertions=tuple(
            AssertionResult(name=a["name"], passed=bool(a["passed"])) for a in data["assertions"]
        ),
        parsed=bool(data["parsed"]),
        failure_cause=FailureCause(data["failure_cause"]),
        binary_outcome=data["binary_outcome"],
        reward_value=data.get("reward_value"),
        detail=data.get("detail", ""),
        output_tail=data.get("output_tail", ""),
    )
