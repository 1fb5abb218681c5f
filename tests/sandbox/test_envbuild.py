"""Local environment builder: the Dockerfile subset, real builds over stand-in roots, layer caching."""

import json
import os
import shutil
import tarfile
import threading
from pathlib import Path

import pytest

from sandbox_service.contracts import UnsupportedEnvironment
from sandbox_service.envbuild import (
    SANDBOX_UID_BASE,
    CopyStep,
    EnvironmentBuilder,
    EnvironmentBuildError,
    RunStep,
    WorkdirStep,
    parse_dockerfile,
)
from sandbox_service.tasks import UnsupportedTaskFormat, load_task

from .conftest import HARBOR_BUILD, HARBOR_HELLO, STAND_IN_DIR, TB1_HELLO

BASE = SANDBOX_UID_BASE


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
RUN [ ! -e /usr/bin/python ] && echo no-python || true
SHELL ["/bin/bash", "-c"]
USER nobody
RUN <<EOF
echo from a heredoc
EOF
VOLUME /data
ENTRYPOINT ["/usr/local/bin/start"]
CMD ["bash"]
EXPOSE 80
""",
        tmp_path,
    )
    assert plan.base_image == "debian:bookworm"
    env = dict(plan.env)
    assert env["GREETING"] == "hello world" and env["EMPTY"] == "" and env["OTHER"] == "fallback"
    assert env["LEGACY"] == "value with spaces" and env["LANG"] == "C.UTF-8"  # the base image's ENV too
    assert env["PATH"] == "/opt/tool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert (
        plan.workdir == "/app/sub" and plan.user == "nobody" and plan.entrypoint == ("/usr/local/bin/start",)
    )
    steps = plan.steps
    assert steps[0] == WorkdirStep(line=9, path="/app") and steps[1] == WorkdirStep(line=10, path="/app/sub")
    assert steps[2] == CopyStep(line=11, sources=(tmp_path / "a.txt",), destination="/app/sub/")
    assert steps[3] == CopyStep(
        line=12, sources=(tmp_path / "dir",), destination="/opt/dir/", chmod=0o644, chown="1000:1000"
    )
    assert steps[4].destination == "/data/" and steps[4].extract_archives
    assert isinstance(steps[5], RunStep) and steps[5].argv == ("/bin/sh", "-c", "echo one &&     echo two")
    assert (
        steps[5].line == 14
        and steps[5].workdir == "/app/sub"
        and dict(steps[5].env)["GREETING"] == "hello world"
    )
    assert dict(steps[5].env)["WHO"] == "world"  # build arguments are visible to RUN
    assert steps[6].argv == ("/bin/true", "x")
    # `RUN [ ...` is not a JSON array, so it is shell form, as Docker reads it
    assert steps[7].argv == ("/bin/sh", "-c", "[ ! -e /usr/bin/python ] && echo no-python || true")
    assert steps[8].argv == ("/bin/bash", "-c", "echo from a heredoc\n") and steps[8].user == "nobody"


def test_workdir_root_is_accepted(tmp_path):
    plan = _parse("FROM python:3.11-slim\nWORKDIR /\nRUN true\n", tmp_path)
    assert plan.workdir == "/" and plan.steps[1].workdir == "/"


@pytest.mark.parametrize(
    "dockerfile,reason",
    [
        ("FROM alpine:3.19\n", "line 1: base image 'alpine:3.19': Alpine Linux"),
        ("FROM python:3.12-alpine\n", "line 1: base image 'python:3.12-alpine': Alpine Linux"),
        (
            "FROM nvidia/cuda:12.4.0-base-ubuntu22.04\n",
            "line 1: base image 'nvidia/cuda:12.4.0-base-ubuntu22.04': CUDA",
        ),
        ("FROM mcr.microsoft.com/dotnet/sdk:8.0\n", "no stand-in recipe for image family 'sdk'"),
        (
            "FROM ubuntu:22.04 AS a\nFROM ubuntu:22.04\n",
            "line 2: multi-stage builds (a second FROM) need --backend container",
        ),
        (
            "FROM ubuntu:22.04\nCOPY --from=a /x /y\n",
            "line 2: COPY --from (multi-stage) needs --backend container",
        ),
        ("FROM ubuntu:22.04\nADD https://example.com/x.tgz /x\n", "line 2: ADD of a URL"),
        (
            "FROM ubuntu:22.04\nRUN --mount=type=cache,target=/x true\n",
            "line 2: RUN --mount needs --backend container",
        ),
        ("FROM ubuntu:22.04\nCOPY <<EOF /x\nhi\nEOF\n", "line 2: COPY heredocs need --backend container"),
        ("FROM ubuntu:22.04\nCOPY missing.txt /x\n", "line 2: COPY source 'missing.txt' not found"),
        (
            "FROM ubuntu:22.04\nCOPY ../outside /x\n",
            "line 2: COPY source '../outside' is outside the build context",
        ),
        ("WORKDIR /app\n", "line 1: WORKDIR before FROM"),
        ("# nothing\n", "no FROM instruction"),
        ("FROM ubuntu:22.04\n\n# comment\nONBUILD RUN true\n", "line 4: ONBUILD is not supported"),
        ("FROM ubuntu:22.04\nSHELL bash -c\n", "line 2: SHELL is not a JSON array"),
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
        "python:3.13",
        "ubuntu:24.04",
        "debian:bookworm-slim",
        "golang:1.24-bookworm",
        "gcc:14",
        "node:20-slim",
        "eclipse-temurin:21-jdk",
        "buildpack-deps:bookworm",
        "ghcr.io/laude-institute/t-bench/python-3-13:2025",
    ],
)
def test_supported_bases(tmp_path, image):
    assert _parse(f"FROM {image}\n", tmp_path).base_image == image


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    return EnvironmentBuilder(tmp_path_factory.mktemp("envcache"), network=False, stand_ins=_stand_ins())


def _stand_ins():
    from sandbox_service.base_images import StandInStore

    return StandInStore(STAND_IN_DIR)


def _in_layers(built, relative: str) -> Path:
    """The topmost layer file for `relative` (what the mounted overlay shows)."""
    for layer in built.lower_stack:
        if (layer / relative).exists() or (layer / relative).is_symlink():
            return layer / relative
    raise FileNotFoundError(relative)


def test_build_produces_layers_over_a_shifted_stand_in_root(builder):
    built = builder.build(load_task(HARBOR_BUILD))
    assert built.base_root.is_dir() and (built.base_root / "etc" / "debian_version").read_text().startswith(
        "12"
    )
    assert built.base_root.stat().st_uid == BASE  # the stand-in's uids are in the sandbox range
    assert _in_layers(built, "app/config/app.ini").read_text().startswith("[server]")  # COPY into workdir
    assert _in_layers(built, "app/data/seed.txt").read_text() == "seeded by RUN\n"  # RUN into workdir
    greet = _in_layers(built, "opt/greeter/greet")
    assert greet.stat().st_mode & 0o777 == 0o755 and greet.stat().st_uid == BASE  # COPY --chmod, owner root
    assert _in_layers(built, "opt/greeter/VERSION").read_text() == "1.2.3\n"  # ADD extracted the tarball
    assert _in_layers(built, "usr/local/bin/greet").readlink() == Path("/opt/greeter/greet")  # RUN exec form
    assert _in_layers(built, "srv/shared/inventory.txt").read_text() == "apple\nbanana\n\ncherry\n"
    assert dict(built.env)["GREETING_WORD"] == "Hello" and built.workdir == "/app"
    assert built.substitution.requested == "debian:bookworm" and built.recipe == "debian-bookworm"
    assert not Path("/srv/shared").exists() and not Path("/opt/greeter").exists()  # the host is untouched
    logs = [(layer.parent / "build.log").read_text() for layer in built.layers]
    assert sum(log.startswith("RUN $ ") for log in logs) == 3  # three RUN steps
    assert sum(log.startswith(("COPY $ ", "ADD $ ")) for log in logs) == 3  # run inside the image too


def test_layer_cache_is_shared_by_identical_leading_steps_and_rebuilt_on_change(builder, tmp_path):
    first_dir = shutil.copytree(HARBOR_BUILD, tmp_path / "first")
    first = builder.build(load_task(first_dir))
    again = builder.build(load_task(first_dir))
    assert again == first and again.layers == first.layers  # from the cache, nothing rebuilt
    # Another task whose Dockerfile starts the same way reuses those layers (the apt-layer case).
    second_dir = shutil.copytree(HARBOR_BUILD, tmp_path / "second")
    dockerfile = second_dir / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "RUN echo extra > /opt/extra\n")
    second = builder.build(load_task(second_dir))
    assert second.layers[1:] == first.layers and len(second.layers) == len(first.layers) + 1
    # A changed COPY source changes that layer and every layer above it.
    (first_dir / "environment" / "config" / "app.ini").write_text("[server]\nport = 1\n")
    changed = builder.build(load_task(first_dir))
    assert changed.key != first.key and _in_layers(changed, "app/config/app.ini").read_text().endswith("1\n")
    assert changed.layers[-1] == first.layers[-1]  # the steps before that COPY are still shared
    (first_dir / "instruction.md").write_text("changed instruction: not part of the environment")
    assert builder.build(load_task(first_dir)).key == changed.key


def test_users_and_owners_as_in_docker(builder, tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    (task_dir / "environment" / "owned.txt").write_text("mine\n")
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nRUN useradd -m -u 1000 agent && chown agent /opt\n"
        "COPY --chown=agent:agent owned.txt /opt/owned.txt\nUSER agent\n"
        "RUN touch /opt/by-agent && id -u > /opt/id\n"
        "WORKDIR /home/agent\n"
    )
    built = builder.build(load_task(task_dir))
    assert _in_layers(built, "opt/owned.txt").stat().st_uid == BASE + 1000  # COPY --chown by name
    assert _in_layers(built, "opt/by-agent").stat().st_uid == BASE + 1000  # RUN after USER runs as the user
    assert _in_layers(built, "opt/id").read_text() == "1000\n" and built.user == "agent"
    assert _in_layers(built, "home/agent").stat().st_uid == BASE + 1000


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
    assert len({r.key for r in results}) == 1
    assert _in_layers(results[0], "opt/build-count").read_text() == "built\n"  # the RUN ran once
    assert not list(builder.layers_dir.glob("*.building-*"))


def test_failing_run_step_is_a_build_error_and_leaves_no_layer(builder, tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:22.04\nRUN echo about to fail; exit 3\n"
    )
    with pytest.raises(EnvironmentBuildError, match="line 2 RUN .* exited 3:\nabout to fail"):
        builder.build(load_task(task_dir))
    assert not [p for p in builder.layers_dir.iterdir() if "building" in p.name]


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
        '[environment]\ndocker_image = "python:3.11-slim"\nworkdir = "/srv/app"\n'
    )
    built = builder.build(load_task(task_dir))
    assert built.layers == () and built.workdir == "/srv/app"
    assert (built.base_root / "usr" / "local" / "bin" / "python").readlink() == Path("/usr/bin/python3")
    assert not list(built.base_root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"))  # pip works, as in python:*


@pytest.mark.slow
def test_pip_install_at_build_time_with_network(tmp_path):
    builder = EnvironmentBuilder(tmp_path / "cache", network=True, stand_ins=_stand_ins())
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nWORKDIR /app\nRUN pip install --no-cache-dir --no-deps tomli-w==1.0.0\n"
    )
    built = builder.build(load_task(task_dir))
    assert [
        p
        for layer in built.layers
        for p in layer.glob("usr/local/lib/python3*/dist-packages/tomli_w/__init__.py")
    ]


def test_multi_service_compose_is_rejected_at_load_time(tmp_path):
    task_dir = shutil.copytree(TB1_HELLO, tmp_path / "task")
    (task_dir / "docker-compose.yaml").write_text(
        "services:\n  client:\n    build:\n      dockerfile: Dockerfile\n"
        "  database:\n    image: postgres:16\n"
    )
    with pytest.raises(
        UnsupportedTaskFormat, match=r"multi-container compose environment \(2 services: client, database\)"
    ) as raised:
        load_task(task_dir)
    assert raised.value.skip_reason.value == "multi_container"


def test_layer_records_are_json(builder):
    built = builder.build(load_task(HARBOR_BUILD))
    for layer in built.layers:
        meta = json.loads((layer.parent / "layer.json").read_text())
        assert meta["changed"] is True and os.path.basename(layer.parent) == meta["key"]


def test_copy_through_a_planted_symlink_stays_inside_the_image(builder, tmp_path):
    """COPY and ADD run inside the build sandbox: a symlink an earlier layer planted resolves in the
    image's root, as in Docker, and can never point a write at the host."""
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "task")
    marker = f"t1jax-escape-{tmp_path.name}"
    (task_dir / "environment" / "note.txt").write_text("inside\n")
    with tarfile.open(task_dir / "environment" / "bundle.tar.gz", "w:gz") as archive:
        archive.add(task_dir / "environment" / "note.txt", arcname="from-archive.txt")
    (task_dir / "environment" / "Dockerfile").write_text(
        f"FROM python:3.11-slim\nRUN ln -s / /opt/escape\nCOPY note.txt /opt/escape/tmp/{marker}\n"
        f"ADD bundle.tar.gz /opt/escape/tmp/{marker}-dir/\n"
    )
    built = builder.build(load_task(task_dir))
    assert not Path(f"/tmp/{marker}").exists() and not Path(f"/tmp/{marker}-dir").exists()
    assert _in_layers(built, f"tmp/{marker}").read_text() == "inside\n"
    assert _in_layers(built, f"tmp/{marker}-dir/from-archive.txt").read_text() == "inside\n"
