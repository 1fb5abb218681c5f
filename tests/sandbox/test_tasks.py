"""Task loaders: both layouts load into one Task model; malformed tasks are named and skipped."""

import shutil
from pathlib import Path

import pytest

from sandbox_service.contracts import Difficulty, SkipReason, TaskLayout
from sandbox_service.envbuild import check_environment
from sandbox_service.tasks import (
    TaskLoadError,
    UnsupportedTaskFormat,
    find_task_dirs,
    load_dataset,
    load_task,
)

from .conftest import HARBOR_BUILD, HARBOR_HELLO, HARBOR_SALES, MALFORMED, TASKS, TB1_HELLO, TB1_LOGS


def test_harbor_task_fields():
    task = load_task(HARBOR_HELLO)
    assert task.task_id == "t1jax/hello-world"
    assert task.layout == TaskLayout.HARBOR
    assert task.instruction == 'Create a file called /app/hello.txt. Write "Hello, world!" to it.'
    assert task.difficulty == Difficulty.EASY
    assert task.category == "file-operations"
    assert task.tags == ("file-operations", "hello")
    assert task.tests_dir == HARBOR_HELLO / "tests" and task.test_script == Path("test.sh")
    assert task.solution_script == HARBOR_HELLO / "solution" / "solve.sh"
    assert task.limits.agent_timeout_sec == 600 and task.limits.verifier_timeout_sec == 120
    env = task.environment
    assert env.dockerfile == HARBOR_HELLO / "environment" / "Dockerfile"
    assert env.context_dir == HARBOR_HELLO / "environment"
    assert (env.cpus, env.memory_mb, env.storage_mb, env.allow_internet, env.workdir) == (
        1.0,
        512,
        256,
        False,
        "/app",
    )


def test_harbor_legacy_sizes_and_defaults():
    task = load_task(HARBOR_SALES)
    assert task.task_id == "sales-report"  # no [task].name: the directory name
    assert task.environment.memory_mb == 1024 and task.environment.storage_mb == 512  # memory = "1G"
    assert task.environment.allow_internet is True  # Harbor's default
    assert task.difficulty == Difficulty.MEDIUM and task.category == "data-processing"
    assert task.limits.total_timeout_sec >= task.limits.agent_timeout_sec + task.limits.verifier_timeout_sec


def test_harbor_workdir_explicit():
    assert load_task(HARBOR_BUILD).environment.workdir == "/app"


def test_terminal_bench_1_task_fields():
    task = load_task(TB1_HELLO)
    assert task.task_id == "hello-world"
    assert task.layout == TaskLayout.TERMINAL_BENCH_1
    assert task.instruction.startswith("Create a file called /app/hello.txt")
    assert task.test_script == Path("run-tests.sh") and task.tests_dir == TB1_HELLO / "tests"
    assert task.solution_script == TB1_HELLO / "solution.sh"
    assert task.parser_name == "pytest"
    assert task.limits.agent_timeout_sec == 360 and task.limits.verifier_timeout_sec == 60
    assert task.environment.dockerfile == TB1_HELLO / "Dockerfile" and task.environment.workdir == "/app"


def test_terminal_bench_1_defaults(tmp_path):
    task_dir = tmp_path / "old-format"
    shutil.copytree(TB1_LOGS, task_dir)
    (task_dir / "task.yaml").write_text(
        "descriptions:\n  - key: base\n    description: Do the base thing.\n"
        "  - key: hard\n    description: x\n"
    )
    task = load_task(task_dir)
    assert task.instruction == "Do the base thing."  # early TB 1.x `descriptions` format
    assert task.difficulty == Difficulty.UNKNOWN
    assert task.limits.agent_timeout_sec == 360 and task.limits.verifier_timeout_sec == 60


def test_dataset_loads_both_layouts():
    dataset = load_dataset(TASKS)
    assert dataset.errors == ()
    assert sorted(t.task_id for t in dataset) == sorted(
        ["t1jax/hello-world", "sales-report", "t1jax/build-steps", "hello-world", "log-parsing"]
    )
    assert {t.layout for t in dataset} == {TaskLayout.HARBOR, TaskLayout.TERMINAL_BENCH_1}
    assert dataset.by_id("log-parsing").source_dir == TB1_LOGS


@pytest.mark.parametrize(
    "name,file_name,field",
    [
        ("missing-instruction", "instruction.md", "instruction"),
        ("empty-instruction", "instruction.md", "instruction"),
        ("bad-toml", "task.toml", "task.toml"),
        ("unknown-difficulty", "task.toml", "metadata.difficulty"),
        ("missing-tests", "tests", "tests"),
        ("missing-test-script", "tests/test.sh", "tests/test.sh"),
        ("bad-memory", "task.toml", "environment.memory"),
        ("negative-timeout", "task.toml", "agent.timeout_sec"),
        ("tb1-missing-instruction", "task.yaml", "instruction"),
        ("tb1-missing-run-tests", "run-tests.sh", "run-tests.sh"),
    ],
)
def test_malformed_task_names_path_and_field(name, file_name, field):
    with pytest.raises(TaskLoadError) as raised:
        load_task(MALFORMED / name)
    assert raised.value.path == MALFORMED / name / file_name
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{MALFORMED / name / file_name}: {field}: ")


def test_unknown_difficulty_message_lists_allowed_values():
    with pytest.raises(TaskLoadError, match="unknown difficulty 'impossible' \\(allowed: easy, medium, hard"):
        load_task(MALFORMED / "unknown-difficulty")


def test_bad_toml_message_has_the_parser_error():
    with pytest.raises(TaskLoadError, match="invalid TOML: .*line 2"):
        load_task(MALFORMED / "bad-toml")


def test_dataset_skips_malformed_tasks_and_keeps_loading(tmp_path):
    root = tmp_path / "pool"
    shutil.copytree(TASKS, root / "good")
    shutil.copytree(MALFORMED, root / "bad")
    dataset = load_dataset(root)
    good = {t.task_id for t in load_dataset(TASKS)}
    # The two unsupported-Dockerfile examples are well-formed tasks: only a backend check rejects them.
    assert {t.task_id for t in dataset} == good | {"unsupported-base", "unsupported-instruction"}
    failing = {error.path.relative_to(root / "bad").parts[0]: error.field for error in dataset.errors}
    assert failing == {
        "bad-memory": "environment.memory",
        "bad-toml": "task.toml",
        "empty-instruction": "instruction",
        "missing-instruction": "instruction",
        "missing-test-script": "tests/test.sh",
        "missing-tests": "tests",
        "negative-timeout": "agent.timeout_sec",
        "tb1-missing-instruction": "instruction",
        "tb1-missing-run-tests": "run-tests.sh",
        "unknown-difficulty": "metadata.difficulty",
    }
    assert len(find_task_dirs(root / "bad")) == 12


def test_environment_check_rejects_unsupported_dockerfiles(tmp_path):
    pool = shutil.copytree(MALFORMED, tmp_path / "pool")
    (pool / "unsupported-instruction" / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nWORKDIR /app\nONBUILD RUN true\n"
    )
    dataset = load_dataset(pool, environment_check=check_environment)
    by_dir = {
        error.path.parent.parent.name: error for error in dataset.errors if error.field == "environment"
    }
    assert set(by_dir) == {"unsupported-base", "unsupported-instruction"}
    assert by_dir["unsupported-base"].path.name == "Dockerfile"
    assert "line 1: base image 'alpine:3.19': Alpine Linux" in by_dir["unsupported-base"].message
    assert "line 3: ONBUILD is not supported" in by_dir["unsupported-instruction"].message
    assert dataset.tasks == ()  # every malformed example is rejected one way or the other


def test_duplicate_task_ids_are_reported(tmp_path):
    shutil.copytree(HARBOR_HELLO, tmp_path / "a")
    shutil.copytree(HARBOR_HELLO, tmp_path / "b")
    dataset = load_dataset(tmp_path)
    assert [t.source_dir.name for t in dataset] == ["a"]
    assert dataset.errors[0].field == "task id" and "already used" in dataset.errors[0].message


def test_a_task_names_its_template_family_or_none(tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "t")
    assert load_task(task_dir).family == ""
    toml = (task_dir / "task.toml").read_text()
    assert "[metadata]" in toml
    (task_dir / "task.toml").write_text(toml.replace("[metadata]", '[metadata]\nfamily = "s02"', 1))
    assert load_task(task_dir).family == "s02"


def test_bad_field_types(tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "t")
    cases = {
        '[metadata]\ntags = "notalist"\n': "metadata.tags",
        "[metadata]\nfamily = 3\n": "metadata.family",
        '[metadata]\nfamily = " "\n': "metadata.family",
        "[environment]\nallow_internet = 1\n": "environment.allow_internet",
        '[environment]\nworkdir = "relative"\n': "environment.workdir",
        "[environment]\ncpus = 0\n": "environment.cpus",
        'environment = "x"\n': "environment",
        "[task]\nname = 3\n": "task.name",
    }
    for text, field in cases.items():
        (task_dir / "task.toml").write_text(text)
        with pytest.raises(TaskLoadError) as raised:
            load_task(task_dir)
        assert raised.value.field == field, text


def test_not_a_task_directory(tmp_path):
    with pytest.raises(TaskLoadError, match="layout"):
        load_task(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_dataset(tmp_path / "missing")


def test_formats_no_backend_runs_are_rejected_at_load_time_with_the_reason(tmp_path):
    compose = shutil.copytree(HARBOR_HELLO, tmp_path / "compose")
    (compose / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main: {build: .}\n  db: {image: x}\n"
    )
    with pytest.raises(UnsupportedTaskFormat, match=r"2 services: main, db") as raised:
        load_task(compose)
    assert raised.value.skip_reason == SkipReason.MULTI_CONTAINER
    single = shutil.copytree(HARBOR_HELLO, tmp_path / "single")
    (single / "environment" / "docker-compose.yaml").write_text("services:\n  main:\n    build: .\n")
    assert load_task(single).environment.dockerfile == single / "environment" / "Dockerfile"


def test_workdir_root_and_where_the_workdir_came_from(tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "t")
    (task_dir / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /\n")
    task = load_task(task_dir)
    assert (task.environment.workdir, task.environment.workdir_from) == ("/", "Dockerfile")
    (task_dir / "task.toml").write_text('[environment]\nworkdir = "relative/path"\n')
    with pytest.raises(TaskLoadError) as raised:
        load_task(task_dir)
    assert raised.value.field == "environment.workdir" and raised.value.path.name == "task.toml"


def test_harbor_solution_verifier_env_and_gpus(tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "t")
    (task_dir / "task.toml").write_text(
        '[solution]\nenv = { MODE = "oracle" }\n[verifier]\nenv = { STRICT = 1 }\n[environment]\ngpus = 2\n'
    )
    task = load_task(task_dir)
    assert task.solution_env == {"MODE": "oracle"} and task.verifier_env == {"STRICT": "1"}
    assert task.environment.gpus == 2
