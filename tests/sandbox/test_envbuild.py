"""Environment builder: the Dockerfile subset, real builds without Docker, the content-hash cache."""

import shutil
import threading
from pathlib import Path

import pytest

from sandbox_service.contracts import UnsupportedEnvironment
from sandbox_service.envbuild import (
    CopyStep,
    EnvironmentBuilder,
    EnvironmentBuildError,
    RunStep,
    WorkdirStep,
    check_environment,
    parse_dockerfile,
)
from sandbox_service.tasks import load_task

from .conftest import HARBOR_BUILD, HARBOR_HELLO, TB1_HELLO


def _parse(text: str, context: Path) -> object:
    return parse_dockerfile(text, context_dir=context, task_id="t")


def test_parse_supported_subset(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "b.txt").write_text("b")
    plan = _parse(
        """\
# escape=\\
ARG BASE=bookworm
FROM debian:${BASE} AS base
ARG WHO=world
ENV GREETING="hello ${WHO}" \\
    EMPTY= OTHER=${MISSING:-fallback}
ENV LEGACY value with spaces
ENV PATH=/opt/tool/bin:$PATH
WORKDIR /app
WORKDIR sub
COPY a.txt .
COPY --chmod=0644 --chown=1000:1000 dir/ /opt/dir/
ADD ["a.txt", "dir/b.txt", "/data/"]
RUN echo one && \\
    echo two
RUN ["/bin/true", "x"]
CMD ["bash"]
EXPOSE 80
""",
        tmp_path,
    )
    assert plan.base_image == "debian:bookworm"
    env = dict(plan.env)
    assert env["GREETING"] == "hello world" and env["EMPTY"] == "" and env["OTHER"] == "fallback"
    assert env["LEGACY"] == "value with spaces"
    assert env["PATH"] == "/opt/tool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert plan.workdir == "/app/sub"
    steps = plan.steps
    assert steps[0] == WorkdirStep(line=9, path="/app") and steps[1] == WorkdirStep(line=10, path="/app/sub")
    assert steps[2] == CopyStep(line=11, sources=(tmp_path / "a.txt",), destination="/app/sub/")
    assert steps[3] == CopyStep(line=12, sources=(tmp_path / "dir",), destination="/opt/dir/", chmod=0o644)
    assert steps[4].destination == "/data/" and steps[4].extract_archives
    assert isinstance(steps[5], RunStep) and steps[5].argv == ("/bin/sh", "-c", "echo one &&     echo two")
    assert (
        steps[5].line == 14
        and steps[5].workdir == "/app/sub"
        and dict(steps[5].env)["GREETING"] == "hello world"
    )
    assert steps[6].argv == ("/bin/true", "x")


@pytest.mark.parametrize(
    "dockerfile,reason",
    [
        ("FROM alpine:3.19\n", "line 1: base image 'alpine:3.19' is not a Debian, Ubuntu or python image"),
        ("FROM python:3.12-alpine\n", "line 1: base image 'python:3.12-alpine' is not Debian/Ubuntu-based"),
        ("FROM node:20-bookworm\n", "line 1: base image 'node:20-bookworm'"),
        ("FROM nvidia/cuda:12.4.0-base-ubuntu22.04\n", "line 1: base image 'nvidia/cuda"),
        ("FROM ubuntu:22.04\nVOLUME /data\n", "line 2: instruction VOLUME is outside the supported subset"),
        ("FROM ubuntu:22.04\nUSER nobody\n", "line 2: instruction USER is outside"),
        ('FROM ubuntu:22.04\nSHELL ["/bin/bash", "-c"]\n', "line 2: instruction SHELL is outside"),
        ("FROM ubuntu:22.04\nHEALTHCHECK CMD true\n", "line 2: instruction HEALTHCHECK is outside"),
        ("FROM ubuntu:22.04 AS a\nFROM ubuntu:22.04\n", "line 2: multi-stage builds"),
        ("FROM ubuntu:22.04\nCOPY --from=a /x /y\n", "line 2: COPY --from is not supported"),
        ("FROM ubuntu:22.04\nADD https://example.com/x.tgz /x\n", "line 2: ADD of a URL"),
        (
            "FROM ubuntu:22.04\nRUN --mount=type=cache,target=/x true\n",
            "line 2: RUN --mount is not supported",
        ),
        ("FROM ubuntu:22.04\nRUN <<EOF\necho hi\nEOF\n", "line 2: RUN heredocs are not supported"),
        ("FROM ubuntu:22.04\nCOPY missing.txt /x\n", "line 2: COPY source 'missing.txt' not found"),
        (
            "FROM ubuntu:22.04\nCOPY ../outside /x\n",
            "line 2: COPY source '../outside' is outside the build context",
        ),
        ("WORKDIR /app\n", "line 1: WORKDIR before FROM"),
        ("# nothing\n", "no FROM instruction"),
        ("FROM ubuntu:22.04\n\n# comment\nONBUILD RUN true\n", "line 4: instruction ONBUILD is outside"),
    ],
)
def test_unsupported_dockerfiles_name_line_and_reason(tmp_path, dockerfile, reason):
    (tmp_path / "ctx").mkdir()
    (tmp_path / "outside").write_text("x")
    with pytest.raises(UnsupportedEnvironment) as raised:
        _parse(dockerfile, tmp_path / "ctx")
    assert reason in raised.value.reason
    assert raised.value.task_id == "t"


@pytest.mark.parametrize(
    "image",
    [
        "python:3.11-slim",
        "ubuntu:24.04",
        "debian:bookworm-slim",
        "ghcr.io/laude-institute/t-bench/python-3-13:2025",
    ],
)
def test_supported_bases(tmp_path, image):
    assert _parse(f"FROM {image}\n", tmp_path).base_image == image


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    return EnvironmentBuilder(tmp_path_factory.mktemp("envcache"), network=False)


def test_build_produces_layer_seeds_and_masked_tops(builder):
    built = builder.build(load_task(HARBOR_BUILD))
    seeds = built.seeds
    assert (seeds["work"] / "config" / "app.ini").read_text().startswith("[server]")  # COPY into workdir
    assert (seeds["work"] / "data" / "seed.txt").read_text() == "seeded by RUN\n"  # RUN into workdir
    upper = built.upper
    assert (upper / "opt" / "greeter" / "greet").stat().st_mode & 0o777 == 0o755  # COPY --chmod
    assert (upper / "opt" / "greeter" / "VERSION").read_text() == "1.2.3\n"  # ADD extracted the tarball
    assert (upper / "usr" / "local" / "bin" / "greet").readlink() == Path(
        "/opt/greeter/greet"
    )  # RUN exec form
    assert (built.masked_tops["srv"] / "shared" / "inventory.txt").read_text() == "apple\nbanana\n\ncherry\n"
    assert dict(built.env)["GREETING_WORD"] == "Hello" and built.workdir == "/app"
    assert not Path("/srv/shared").exists() and not Path("/opt/greeter").exists()  # the host is untouched
    assert (built.directory / "build.log").read_text().count("$ ") == 3


def test_cache_reuses_and_rebuilds_on_content_change(builder, tmp_path):
    task_dir = shutil.copytree(HARBOR_BUILD, tmp_path / "task")
    first = builder.build(load_task(task_dir))
    marker = first.directory / "env.json"
    assert builder.build(load_task(task_dir)).directory == first.directory
    assert marker.stat().st_mtime_ns == (first.directory / "env.json").stat().st_mtime_ns  # not rebuilt
    (task_dir / "environment" / "config" / "app.ini").write_text("[server]\nport = 1\n")  # a COPY source
    second = builder.build(load_task(task_dir))
    assert second.key != first.key and (second.seeds["work"] / "config" / "app.ini").read_text().endswith(
        "1\n"
    )
    (task_dir / "instruction.md").write_text("changed instruction: not part of the environment")
    assert builder.build(load_task(task_dir)).key == second.key


def test_concurrent_builds_of_one_environment_build_once(builder, tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nWORKDIR /app\nRUN echo built >> /opt/build-count\n"
    )
    task = load_task(task_dir)
    results = []
    threads = [threading.Thread(target=lambda: results.append(builder.build(task))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({r.directory for r in results}) == 1
    assert (results[0].upper / "opt" / "build-count").read_text() == "built\n"  # the RUN ran once
    assert not list(builder.envs_dir.glob("*.building-*"))


def test_failing_run_step_is_a_build_error_and_leaves_no_layer(builder, tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:22.04\nRUN echo about to fail; exit 3\n"
    )
    with pytest.raises(EnvironmentBuildError, match="line 2 RUN .* exited 3:\nabout to fail"):
        builder.build(load_task(task_dir))
    assert not [p for p in builder.envs_dir.iterdir() if p.is_dir() and "building" in p.name]


def test_build_runs_without_network_unless_allowed(builder, tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM python:3.11\nRUN python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\"\n"
    )
    with pytest.raises(EnvironmentBuildError, match="Network is unreachable"):
        builder.build(load_task(task_dir))


def test_docker_image_only_task_builds(builder, tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    shutil.rmtree(task_dir / "environment")
    (task_dir / "task.toml").write_text(
        '[environment]\ndocker_image = "python:3.12-slim"\nworkdir = "/srv/app"\n'
    )
    built = builder.build(load_task(task_dir))
    assert built.workdir == "/srv/app"
    assert (built.masked_tops["srv"] / "app").is_dir()  # the mount point a sandbox binds its workdir on
    assert (built.upper / "usr" / "local" / "bin" / "python").readlink() == Path("/usr/bin/python3")


@pytest.mark.slow
def test_pip_install_at_build_time_with_network(tmp_path):
    builder = EnvironmentBuilder(tmp_path / "cache", network=True)
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nWORKDIR /app\nRUN pip install --no-cache-dir --no-deps tomli-w==1.0.0\n"
    )
    built = builder.build(load_task(task_dir))
    assert list(built.upper.glob("usr/local/lib/python3*/dist-packages/tomli_w/__init__.py"))


def test_multi_service_compose_is_rejected(tmp_path):
    task_dir = shutil.copytree(TB1_HELLO, tmp_path / "task")
    (task_dir / "docker-compose.yaml").write_text(
        "services:\n  client:\n    build:\n      dockerfile: Dockerfile\n"
        "  database:\n    image: postgres:16\n"
    )
    with pytest.raises(
        UnsupportedEnvironment, match="2 services \\(client, database\\); the local backend runs one"
    ):
        check_environment(load_task(task_dir))
