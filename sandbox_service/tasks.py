"""Task loaders: one `Task` model from Terminal-Bench 1.x and Harbor / Terminal-Bench 2.x directories.

This module owns turning a task directory (or a tree of them) into validated `Task` records.

Layouts (see shared/reference/terminal-bench-and-harness.md):
- Terminal-Bench 1.x: `task.yaml` (instruction, difficulty, category, tags, parser_name,
  max_agent_timeout_sec, max_test_timeout_sec, run_tests_in_same_shell), `run-tests.sh`, `tests/`,
  `solution.sh` (optional), `Dockerfile` and/or `docker-compose.yaml`.
- Harbor: `task.toml` (schema_version, [task], [metadata], [verifier], [agent], [environment]),
  `instruction.md`, `environment/` (Dockerfile, or only `[environment].docker_image`),
  `tests/test.sh`, `solution/solve.sh` (optional).

Harbor multi-step tasks (`[[steps]]` in task.toml, `steps/<name>/instruction.md`, optional
`steps/<name>/tests/`, `solution/solve.sh`, `workdir/`; `multi_step_reward_strategy`) load with
`Task.steps` (`sandbox_service.steps` owns what they mean); like Harbor, a `steps/` directory
without `[[steps]]` is ignored. Formats no backend here runs are rejected at load time with the
reason named, as `UnsupportedTaskFormat` (a `TaskLoadError` carrying a `SkipReason`):
docker-compose environments with more than one service (several containers per trial); its
`skip_reason` lets `check-tasks` and the eval report it as skipped.

Invariants:
- `load_task` returns a `Task` only if the directory is complete and well-formed; otherwise it raises
  `TaskLoadError` naming the offending file and field. Nothing about the environment is built here.
- `load_dataset` never raises for a bad task: it collects one `TaskLoadError` per malformed task
  (path + field), skips that task and keeps loading the rest. Task ids are unique in a dataset.
- Defaults follow each format's own defaults (TB 1.x: agent 360 s, tests 60 s; Harbor: internet
  allowed) except the verifier deadline, which defaults to 900 s (the paper's verifier wall).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sandbox_service.contracts import (
    Difficulty,
    EnvironmentSpec,
    SkipReason,
    Task,
    TaskLayout,
    TaskLimits,
    TaskStep,
    UnsupportedEnvironment,
)

TB1_DEFAULT_AGENT_TIMEOUT_SEC = 360.0
TB1_DEFAULT_TEST_TIMEOUT_SEC = 60.0
DEFAULT_AGENT_TIMEOUT_SEC = TaskLimits().agent_timeout_sec
DEFAULT_VERIFIER_TIMEOUT_SEC = TaskLimits().verifier_timeout_sec
DEFAULT_TOTAL_TIMEOUT_SEC = TaskLimits().total_timeout_sec
DEFAULT_WORKDIR = "/app"

_TASK_MARKERS = ("task.toml", "task.yaml", "instruction.md", "run-tests.sh")


class TaskLoadError(ValueError):
    """A task directory is malformed. `path` is the file (or directory) at fault, `field` the
    offending key or member (e.g. `metadata.difficulty`, `tests/test.sh`)."""

    def __init__(self, path: Path, field: str, message: str):
        super().__init__(f"{path}: {field}: {message}")
        self.path = Path(path)
        self.field = field
        self.message = message


class UnsupportedTaskFormat(TaskLoadError):
    """A well-formed task in a format no backend of this service runs (`skip_reason` says which)."""

    def __init__(self, path: Path, field: str, message: str, skip_reason: SkipReason):
        super().__init__(path, field, message)
        self.skip_reason = skip_reason


@dataclass(frozen=True)
class Dataset:
    """Tasks loaded from a directory tree, in sorted path order, plus the tasks that were skipped."""

    root: Path
    tasks: tuple[Task, ...]
    errors: tuple[TaskLoadError, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def by_id(self, task_id: str) -> Task:
        for task in self.tasks:
            if task.task_id == task_id:
                return task
        raise KeyError(f"no task {task_id!r} in dataset {self.root}")


def load_task(task_dir: str | Path) -> Task:
    """Load one task directory of either layout (Harbor if it has `task.toml` or `instruction.md`)."""
    task_dir = Path(task_dir).resolve()
    if not task_dir.is_dir():
        raise TaskLoadError(task_dir, "directory", "not a directory")
    if (task_dir / "task.toml").exists() or (task_dir / "instruction.md").exists():
        return _load_harbor(task_dir)
    if (task_dir / "task.yaml").exists() or (task_dir / "run-tests.sh").exists():
        return _load_terminal_bench_1(task_dir)
    raise TaskLoadError(task_dir, "layout", "neither task.toml (Harbor) nor task.yaml (Terminal-Bench 1.x)")


def find_task_dirs(root: str | Path) -> list[Path]:
    """Directories under `root` (or `root` itself) that look like tasks; task dirs are not descended."""
    root = Path(root).resolve()
    found: list[Path] = []

    def walk(directory: Path) -> None:
        if any((directory / marker).is_file() for marker in _TASK_MARKERS):
            found.append(directory)
            return
        for child in sorted(directory.iterdir()):
            if child.is_dir() and not child.name.startswith(".") and not child.is_symlink():
                walk(child)

    walk(root)
    return found


def load_dataset(root: str | Path, *, environment_check: Callable[[Task], None] | None = None) -> Dataset:
    """Load every task under `root`. A malformed task becomes a `TaskLoadError` and is skipped.

    `environment_check`, if given, is a backend's static check of the task's environment (e.g. the
    local backend's Dockerfile subset); an `UnsupportedEnvironment` it raises rejects the task too.
    """
    root = Path(root).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"task dataset directory not found: {root}")
    tasks: list[Task] = []
    errors: list[TaskLoadError] = []
    seen: dict[str, Path] = {}
    for task_dir in find_task_dirs(root):
        try:
            task = load_task(task_dir)
            if environment_check is not None:
                try:
                    environment_check(task)
                except UnsupportedEnvironment as rejected:
                    where = task.environment.dockerfile or task_dir
                    raise TaskLoadError(where, "environment", rejected.reason) from rejected
            if task.task_id in seen:
                raise TaskLoadError(
                    task_dir, "task id", f"{task.task_id!r} already used by {seen[task.task_id]}"
                )
        except TaskLoadError as error:
            errors.append(error)
            continue
        seen[task.task_id] = task_dir
        tasks.append(task)
    return Dataset(root=root, tasks=tuple(tasks), errors=tuple(errors))


# ------------------------------------------------------------------------------------------------
# Harbor / Terminal-Bench 2.x


def _load_harbor(task_dir: Path) -> Task:
    toml_path = task_dir / "task.toml"
    if not toml_path.is_file():
        raise TaskLoadError(toml_path, "task.toml", "missing")
    try:
        config = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise TaskLoadError(toml_path, "task.toml", f"invalid TOML: {error}") from error

    steps_config = config.get("steps")
    instruction = "" if steps_config else _read_instruction_md(task_dir / "instruction.md")
    task_table = _table(config, "task", toml_path)
    metadata = _table(config, "metadata", toml_path)
    verifier = _table(config, "verifier", toml_path)
    agent = _table(config, "agent", toml_path)
    environment = _table(config, "environment", toml_path)
    for key in ("schema_version", "version"):
        if key in config and not isinstance(config[key], str):
            raise TaskLoadError(toml_path, key, f"must be a string, got {config[key]!r}")

    name = task_table.get("name", task_dir.name)
    if not isinstance(name, str) or not name.strip():
        raise TaskLoadError(toml_path, "task.name", f"must be a non-empty string, got {name!r}")

    tests_dir = task_dir / "tests"
    if not steps_config and not tests_dir.is_dir():
        raise TaskLoadError(tests_dir, "tests", "missing tests directory")
    if not steps_config and not (tests_dir / "test.sh").is_file():
        raise TaskLoadError(tests_dir / "test.sh", "tests/test.sh", "missing verifier entry point")
    solution = task_dir / "solution" / "solve.sh"

    spec = _harbor_environment(task_dir, environment, toml_path)
    solution_table = _table(config, "solution", toml_path)
    agent_timeout = _positive(agent, "timeout_sec", DEFAULT_AGENT_TIMEOUT_SEC, toml_path, "agent.timeout_sec")
    verifier_timeout = _positive(
        verifier, "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_SEC, toml_path, "verifier.timeout_sec"
    )
    limits = _limits(agent_timeout, verifier_timeout)
    steps: tuple[TaskStep, ...] = ()
    if steps_config is not None:
        steps = _harbor_steps(task_dir, steps_config, toml_path, limits, verifier)
        first = steps[0]
        instruction, tests_dir, solution = first.instruction, first.tests_dir, first.solution_script
        total = sum(step.limits.agent_timeout_sec + step.limits.verifier_timeout_sec for step in steps)
        limits = dataclasses.replace(first.limits, total_timeout_sec=max(DEFAULT_TOTAL_TIMEOUT_SEC, total))
    strategy = config.get("multi_step_reward_strategy", "mean") or "mean"
    if strategy not in ("mean", "final"):
        raise TaskLoadError(
            toml_path, "multi_step_reward_strategy", f"must be 'mean' or 'final', got {strategy!r}"
        )
    return Task(
        task_id=name.strip(),
        instruction=instruction,
        source_dir=task_dir,
        layout=TaskLayout.HARBOR,
        environment=spec,
        tests_dir=tests_dir,
        test_script=Path("test.sh"),
        solution_script=solution if solution is not None and solution.is_file() else None,
        difficulty=_difficulty(metadata.get("difficulty"), toml_path, "metadata.difficulty"),
        category=_string(metadata, "category", Task.__dataclass_fields__["category"].default, toml_path),
        tags=_tags(metadata.get("tags", task_table.get("keywords", [])), toml_path, "metadata.tags"),
        family=_family(metadata.get("family"), toml_path),
        parser_name="pytest",
        limits=limits,
        solution_env=_env_table(solution_table, toml_path, "solution.env"),
        verifier_env=_env_table(verifier, toml_path, "verifier.env"),
        steps=steps,
        multi_step_reward=strategy,
        tests_layers=steps[0].tests_layers if steps else (),
    )


_STEP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _harbor_steps(
    task_dir: Path, steps: Any, toml_path: Path, task_limits: TaskLimits, task_verifier: Mapping[str, Any]
) -> tuple[TaskStep, ...]:
    """`[[steps]]` of task.toml with their `steps/<name>/` directories (Harbor's rules: a step's
    test script is its own `tests/test.sh`, else the task's; its tests are the task's `tests/`
    with its own over them; its deadlines default to the task's)."""
    if not isinstance(steps, list) or not steps:
        raise TaskLoadError(toml_path, "steps", "must be a non-empty array of tables ([[steps]])")
    shared_tests = task_dir / "tests"
    seen: set[str] = set()
    loaded = []
    for number, table in enumerate(steps, start=1):
        where = f"steps[{number}]"
        if not isinstance(table, Mapping):
            raise TaskLoadError(toml_path, where, "must be a table")
        name = table.get("name")
        if not isinstance(name, str) or not _STEP_NAME.match(name) or name in (".", ".."):
            raise TaskLoadError(
                toml_path, f"{where}.name", f"must be a portable directory name, got {name!r}"
            )
        if name.casefold() in seen:
            raise TaskLoadError(toml_path, f"{where}.name", f"step {name!r} appears twice")
        seen.add(name.casefold())
        step_dir = task_dir / "steps" / name
        own_tests = step_dir / "tests"
        layers = tuple(d for d in (shared_tests, own_tests) if d.is_dir())
        script_dir = next((d for d in (own_tests, shared_tests) if (d / "test.sh").is_file()), None)
        if script_dir is None:
            raise TaskLoadError(
                own_tests / "test.sh", f"{where} tests", "neither the step nor the task has tests/test.sh"
            )
        agent = _table(table, "agent", toml_path)
        verifier = _table(table, "verifier", toml_path)
        agent_timeout = _positive(
            agent, "timeout_sec", task_limits.agent_timeout_sec, toml_path, f"{where}.agent.timeout_sec"
        )
        verifier_timeout = _positive(
            verifier,
            "timeout_sec",
            task_limits.verifier_timeout_sec,
            toml_path,
            f"{where}.verifier.timeout_sec",
        )
        min_reward = table.get("min_reward")
        number = (int, float)
        if min_reward is not None and not (
            (isinstance(min_reward, number) and not isinstance(min_reward, bool))
            or (isinstance(min_reward, Mapping) and all(isinstance(v, number) for v in min_reward.values()))
        ):
            raise TaskLoadError(
                toml_path, f"{where}.min_reward", f"must be a number or a table, got {min_reward!r}"
            )
        instruction = _read_instruction_md(step_dir / "instruction.md")
        solution = step_dir / "solution" / "solve.sh"
        workdir = step_dir / "workdir"
        loaded.append(
            TaskStep(
                name=name,
                instruction=instruction,
                tests_layers=layers,
                tests_dir=script_dir,
                limits=_limits(agent_timeout, verifier_timeout),
                solution_script=solution if solution.is_file() else None,
                workdir_dir=workdir if workdir.is_dir() else None,
                verifier_env=_env_table(verifier, toml_path, f"{where}.verifier.env"),
                min_reward=dict(min_reward) if isinstance(min_reward, Mapping) else min_reward,
            )
        )
    return tuple(loaded)


def _env_table(table: Mapping[str, Any], path: Path, field_name: str) -> dict[str, str]:
    env = table.get("env", {})
    if not isinstance(env, Mapping) or not all(isinstance(v, str | int | float) for v in env.values()):
        raise TaskLoadError(path, field_name, "must be a table of strings")
    return {str(k): str(v) for k, v in env.items()}


def _harbor_environment(task_dir: Path, table: Mapping[str, Any], toml_path: Path) -> EnvironmentSpec:
    env_dir = task_dir / "environment"
    dockerfile = env_dir / "Dockerfile"
    image = table.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise TaskLoadError(
            toml_path, "environment.docker_image", f"must be a non-empty string, got {image!r}"
        )
    compose = next((env_dir / n for n in _COMPOSE_NAMES if (env_dir / n).is_file()), None)
    context = env_dir
    if compose is not None:
        compose_dockerfile, compose_context, compose_image = _single_compose_service(compose)
        if not dockerfile.is_file() and image is None:
            dockerfile, context, image = (
                compose_dockerfile or dockerfile,
                compose_context or env_dir,
                compose_image,
            )
    if not dockerfile.is_file() and image is None:
        raise TaskLoadError(
            env_dir, "environment", "no environment/Dockerfile and no [environment].docker_image"
        )
    defaults = EnvironmentSpec()
    memory_mb = _size_mb(table, "memory_mb", "memory", defaults.memory_mb, toml_path)
    storage_mb = _size_mb(table, "storage_mb", "storage", defaults.storage_mb, toml_path)
    cpus = _positive(table, "cpus", defaults.cpus, toml_path, "environment.cpus")
    allow_internet = table.get("allow_internet", True)  # Harbor's default
    if not isinstance(allow_internet, bool):
        raise TaskLoadError(
            toml_path, "environment.allow_internet", f"must be true/false, got {allow_internet!r}"
        )
    env = _env_table(table, toml_path, "environment.env")
    gpus = table.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise TaskLoadError(toml_path, "environment.gpus", f"must be a non-negative integer, got {gpus!r}")
    workdir, workdir_from, where, field_name = (
        table.get("workdir"),
        "task.toml",
        toml_path,
        "environment.workdir",
    )
    if workdir is None and dockerfile.is_file():
        workdir, workdir_from, where, field_name = (
            _dockerfile_workdir(dockerfile),
            "Dockerfile",
            dockerfile,
            "WORKDIR",
        )
    if workdir is None:
        workdir, workdir_from = DEFAULT_WORKDIR, "default"
    return EnvironmentSpec(
        dockerfile=dockerfile if dockerfile.is_file() else None,
        docker_image=None if dockerfile.is_file() else image,
        context_dir=context if context.is_dir() else None,
        workdir=_workdir(workdir, where, field_name),
        cpus=float(cpus),
        memory_mb=memory_mb,
        storage_mb=storage_mb,
        allow_internet=allow_internet,
        env=env,
        workdir_from=workdir_from,
        gpus=gpus,
    )


def _read_instruction_md(path: Path) -> str:
    if not path.is_file():
        raise TaskLoadError(path, "instruction", "missing instruction.md")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TaskLoadError(path, "instruction", f"not UTF-8: {error}") from error
    if not text.strip():
        raise TaskLoadError(path, "instruction", "instruction.md is empty")
    return text.strip()


# ------------------------------------------------------------------------------------------------
# Terminal-Bench 1.x


def _load_terminal_bench_1(task_dir: Path) -> Task:
    yaml_path = task_dir / "task.yaml"
    if not yaml_path.is_file():
        raise TaskLoadError(yaml_path, "task.yaml", "missing")
    try:
        config = yaml.safe_load(yaml_path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise TaskLoadError(yaml_path, "task.yaml", f"invalid YAML: {error}") from error
    if not isinstance(config, Mapping):
        raise TaskLoadError(yaml_path, "task.yaml", "top level must be a mapping")

    instruction = config.get("instruction")
    if instruction is None:  # early TB 1.x: descriptions: [{key: base, description: ...}]
        for entry in config.get("descriptions") or []:
            if isinstance(entry, Mapping) and entry.get("key") == "base":
                instruction = entry.get("description")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskLoadError(yaml_path, "instruction", "missing or empty")

    run_tests = task_dir / "run-tests.sh"
    if not run_tests.is_file():
        raise TaskLoadError(run_tests, "run-tests.sh", "missing verifier entry point")
    tests_dir = task_dir / "tests"
    if not tests_dir.is_dir():
        raise TaskLoadError(tests_dir, "tests", "missing tests directory")
    solution = task_dir / "solution.sh"

    parser_name = config.get("parser_name", "pytest")
    if not isinstance(parser_name, str):
        raise TaskLoadError(yaml_path, "parser_name", f"must be a string, got {parser_name!r}")
    for key in ("run_tests_in_same_shell", "disable_asciinema"):
        if key in config and not isinstance(config[key], bool):
            raise TaskLoadError(yaml_path, key, f"must be true/false, got {config[key]!r}")
    agent_timeout = _positive(config, "max_agent_timeout_sec", TB1_DEFAULT_AGENT_TIMEOUT_SEC, yaml_path)
    test_timeout = _positive(config, "max_test_timeout_sec", TB1_DEFAULT_TEST_TIMEOUT_SEC, yaml_path)
    return Task(
        task_id=task_dir.name,
        instruction=instruction.strip(),
        source_dir=task_dir,
        layout=TaskLayout.TERMINAL_BENCH_1,
        environment=_tb1_environment(task_dir),
        tests_dir=tests_dir,
        test_script=Path("run-tests.sh"),
        solution_script=solution if solution.is_file() else None,
        difficulty=_difficulty(config.get("difficulty"), yaml_path, "difficulty"),
        category=_string(config, "category", Task.__dataclass_fields__["category"].default, yaml_path),
        tags=_tags(config.get("tags", []), yaml_path, "tags"),
        parser_name=parser_name,
        limits=_limits(agent_timeout, test_timeout),
    )


def _tb1_environment(task_dir: Path) -> EnvironmentSpec:
    dockerfile = task_dir / "Dockerfile"
    context = task_dir
    image = None
    compose = next((task_dir / n for n in _COMPOSE_NAMES if (task_dir / n).is_file()), None)
    if compose is not None:
        compose_dockerfile, compose_context, image = _single_compose_service(compose)
        if compose_dockerfile is not None:
            dockerfile, context = compose_dockerfile, compose_context
    if not dockerfile.is_file() and image is None:
        raise TaskLoadError(task_dir / "Dockerfile", "environment", "no Dockerfile and no client image")
    workdir = _dockerfile_workdir(dockerfile)
    return EnvironmentSpec(
        dockerfile=dockerfile if dockerfile.is_file() else None,
        docker_image=None if dockerfile.is_file() else image,
        context_dir=context,
        workdir=_workdir(workdir or DEFAULT_WORKDIR, dockerfile, "WORKDIR"),
        allow_internet=True,  # Terminal-Bench 1.x containers had network access
        workdir_from="Dockerfile" if workdir else "default",
    )


_COMPOSE_NAMES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


def _single_compose_service(compose: Path) -> tuple[Path | None, Path | None, str | None]:
    """(Dockerfile, build context, image) of a compose file's one service; a compose file with
    several services is an `UnsupportedTaskFormat` (several containers per trial)."""
    try:
        config = yaml.safe_load(compose.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise TaskLoadError(compose, "docker-compose", f"invalid YAML: {error}") from error
    services = config.get("services") if isinstance(config, Mapping) else None
    if not isinstance(services, Mapping) or not services:
        raise TaskLoadError(compose, "services", "a compose file needs a services table")
    if len(services) > 1:
        raise UnsupportedTaskFormat(
            compose,
            "services",
            f"a multi-container compose environment "
            f"({len(services)} services: {', '.join(map(str, services))}); "
            "every backend here runs one container per trial",
            SkipReason.MULTI_CONTAINER,
        )
    service = next(iter(services.values()))
    if not isinstance(service, Mapping):
        raise TaskLoadError(compose, "services", "a service must be a mapping")
    build = service.get("build")
    if isinstance(build, str):
        context = (compose.parent / build).resolve()
        return context / "Dockerfile", context, None
    if isinstance(build, Mapping):
        context = (compose.parent / str(build.get("context", "."))).resolve()
        return context / str(build.get("dockerfile", "Dockerfile")), context, None
    image = service.get("image")
    if isinstance(image, str) and "$" not in image:
        return None, None, image
    return None, None, None


# ------------------------------------------------------------------------------------------------
# Field helpers: each raises TaskLoadError naming the file and field.


def _table(config: Mapping[str, Any], key: str, path: Path) -> Mapping[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, Mapping):
        raise TaskLoadError(path, key, f"must be a table, got {type(value).__name__}")
    return value


def _difficulty(value: Any, path: Path, field_name: str) -> Difficulty:
    if value is None:
        return Difficulty.UNKNOWN
    try:
        return Difficulty(str(value).strip().lower())
    except ValueError:
        allowed = ", ".join(d.value for d in Difficulty)
        raise TaskLoadError(path, field_name, f"unknown difficulty {value!r} (allowed: {allowed})") from None


def _string(config: Mapping[str, Any], key: str, default: str, path: Path) -> str:
    value = config.get(key, default)
    if not isinstance(value, str) or not value.strip():
        raise TaskLoadError(path, key, f"must be a non-empty string, got {value!r}")
    return value.strip()


def _family(value: Any, path: Path) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or not value.strip():
        raise TaskLoadError(path, "metadata.family", f"must be a non-empty string, got {value!r}")
    return value.strip()


def _tags(value: Any, path: Path, field_name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TaskLoadError(path, field_name, f"must be a list of strings, got {value!r}")
    return tuple(value)


def _positive(
    config: Mapping[str, Any], key: str, default: float, path: Path, field_name: str | None = None
) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise TaskLoadError(path, field_name or key, f"must be a positive number, got {value!r}")
    return float(value)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B?)\s*$", re.IGNORECASE)
_MB_PER_UNIT = {"": 1.0, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 * 1024}


def _size_mb(table: Mapping[str, Any], mb_key: str, legacy_key: str, default: int, path: Path) -> int:
    """`memory_mb = 2048` or legacy `memory = "2G"` (a bare number in the legacy key means MB)."""
    if mb_key in table:
        value = table[mb_key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise TaskLoadError(path, f"environment.{mb_key}", f"must be a positive number, got {value!r}")
        return int(value)
    if legacy_key in table:
        value = table[legacy_key]
        match = _SIZE.match(str(value))
        if isinstance(value, bool) or match is None or float(match.group(1)) <= 0:
            raise TaskLoadError(
                path, f"environment.{legacy_key}", f"not a size like '2G' or '512M': {value!r}"
            )
        return max(1, int(float(match.group(1)) * _MB_PER_UNIT[match.group(2).upper()]))
    return default


def _workdir(value: Any, path: Path, field_name: str) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise TaskLoadError(path, field_name, f"must be an absolute path, got {value!r}")
    return os.path.normpath(value) if value.strip("/") else "/"


def _dockerfile_workdir(dockerfile: Path) -> str | None:
    """The last literal absolute `WORKDIR` of a Dockerfile (what `docker exec` starts in), if any."""
    if not dockerfile.is_file():
        return None
    workdir = None
    try:
        lines = dockerfile.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        return None
    for line in lines:
        match = re.match(r"^\s*WORKDIR\s+(\S+)\s*$", line, re.IGNORECASE)
        if match:
            value = match.group(1).strip("\"'")
            if value.startswith("/") and "$" not in value:
                workdir = value
            elif "$" not in value:
                workdir = f"{(workdir or '').rstrip('/')}/{value}"
    return workdir


def _limits(agent_timeout: float, verifier_timeout: float) -> TaskLimits:
    # The total deadline must leave room for both phases; the paper's 5400 s is the floor.
    return TaskLimits(
        agent_timeout_sec=agent_timeout,
        verifier_timeout_sec=verifier_timeout,
        total_timeout_sec=max(DEFAULT_TOTAL_TIMEOUT_SEC, agent_timeout + verifier_timeout),
    )
