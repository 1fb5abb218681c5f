"""The real-image path against a real registry: Debian's `docker-registry` (distribution) on
localhost, started here. The container backend pulls a pushed image (`--pull always` and `auto`)
and runs it instead of a stand-in; the Kubernetes backend's image path builds a Dockerfile-only
task, pushes it, and names the digest the registry stored in the Pod spec (checked as the
`kubernetes` client's own V1Pod)."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from fake_clusters import FakeKubeApiServer
from kubernetes import client
from task_factory import write_hello_task

from sandbox_service.backends.kubernetes import KubernetesBackend, KubernetesConfig
from sandbox_service.backends.podman import PodmanBackend, PodmanConfig, PodmanEngine
from sandbox_service.base_images import DEFAULT_STAND_IN_DIR, stand_in_for
from sandbox_service.check_tasks import check_tasks
from sandbox_service.registry import ImagePublisher

pytestmark = pytest.mark.sandbox

REGISTRY_BINARY = "/usr/bin/docker-registry"  # Debian's docker-registry package (make setup-system)
MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    )
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """host:port of a registry serving plain HTTP on loopback, storing under a temporary directory."""
    assert Path(REGISTRY_BINARY).exists(), "no docker-registry: apt-get install docker-registry (make setup)"
    root = tmp_path_factory.mktemp("registry")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
    )
    process = subprocess.Popen([REGISTRY_BINARY, "serve", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://{address}/v2/", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stderr.read().decode()
            time.sleep(0.1)
        else:
            raise AssertionError("the registry did not answer")
        yield address
    finally:
        process.terminate()
        process.wait(timeout=30)


def _registry_digest(address: str, repository: str, tag: str) -> str:
    reply = httpx.head(
        f"http://{address}/v2/{repository}/manifests/{tag}", headers={"Accept": MANIFEST_TYPES}
    )
    assert reply.status_code == 200, reply.text
    return reply.headers["Docker-Content-Digest"]


def test_pull_always_and_auto_use_the_pushed_image_not_a_stand_in(registry, tmp_path, toolchain_dir):
    engine = PodmanEngine()
    recipe, _ = stand_in_for("python:3.11-slim")  # a root we have, served as a real image would be
    pushed = f"{registry}/t1jax-test/python:3.11-slim"
    engine.call("tag", recipe.image_tag, pushed)
    engine.call("push", "--quiet", "--tls-verify=false", pushed, timeout_sec=600)
    engine.call("rmi", pushed)  # only the registry has it now
    pool = tmp_path / "pool"
    task = write_hello_task(pool, docker_image=None)
    (task.source_dir / "environment" / "Dockerfile").write_text(f"FROM {pushed}\nWORKDIR /app\n")
    for pull in ("always", "auto"):
        config = PodmanConfig(
            cache_dir=tmp_path / f"cache-{pull}", toolchain_dir=toolchain_dir,
            stand_in_dir=DEFAULT_STAND_IN_DIR, pull=pull, insecure_registries=(registry,),
        )  # fmt: skip
        backend = PodmanBackend(config)
        try:
            resolved = backend.resolve_base(pushed)
            assert (resolved.source, resolved.used) == ("pulled", pushed) and resolved.substitution is None
            engine.call("rmi", pushed)  # the next resolution must pull again
            (audit,) = check_tasks(pool, backend, run_id=f"registry-{pull}")
        finally:
            backend.close()
        assert audit.sound, audit.line()
        assert audit.environment.faithful and audit.environment.substitutions == ()
        assert audit.line() == "t1jax/hello sound solution 2/2 noop 0/2 on container"
        engine.call("rmi", "--force", pushed, check=False)


def test_the_kubernetes_image_path_builds_pushes_and_names_the_pushed_digest(
    registry, tmp_path, toolchain_dir
):
    task = write_hello_task(tmp_path, docker_image=None)  # Dockerfile-only: FROM ubuntu:24.04
    builder = PodmanBackend(PodmanConfig(cache_dir=tmp_path / "cache", toolchain_dir=toolchain_dir,
                                         stand_in_dir=DEFAULT_STAND_IN_DIR, pull="never"))  # fmt: skip
    server = FakeKubeApiServer()
    core, networking, stream = server.kube_clients()
    publisher = ImagePublisher(builder, f"{registry}/t1jax", tls_verify=False)
    config = KubernetesConfig(
        namespace="t1jax-test", image_registry=f"{registry}/t1jax", toolchain_dir=toolchain_dir
    )
    backend = KubernetesBackend(
        config,
        core_api=core, networking_api=networking, stream_fn=stream, image_publisher=publisher,
    )  # fmt: skip
    try:
        pod = backend.pod_manifest(task, sandbox_id="t1jax-sbx-0123", run_id="registry")
        again = publisher.image_for(task)  # pushed once: the same reference
    finally:
        builder.close()
        server.shutdown()
    body = client.ApiClient().sanitize_for_serialization(pod)
    assert client.V1Pod.from_dict(body) == pod
    (container,) = body["spec"]["containers"]
    repository_and_tag = backend.images.repository_and_tag(task)
    repository, tag = repository_and_tag.rsplit(":", 1)
    digest = _registry_digest(registry, f"t1jax/{repository}", tag)
    assert container["image"] == f"{registry}/t1jax/{repository}@{digest}" == again
    audit = backend.environment_audit(task)
    assert audit.runnable and audit.image == container["image"]
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_the_insecure_registry_flag_reaches_the_container_backend_and_its_pulls(
    registry, tmp_path, toolchain_dir
):
    """`--insecure-registry HOST:PORT` (the service's, eval's and check-tasks' backend flags) is
    what lets the container backend pull from a plain-HTTP registry: without it the same pull
    fails (podman speaks TLS) and a stand-in is used."""
    import argparse

    from sandbox_service.providers import ProviderSettings, add_backend_flags, open_provider

    engine = PodmanEngine()
    recipe, _ = stand_in_for("python:3.11-slim")
    pushed = f"{registry}/t1jax-flag/python:3.11-slim"
    engine.call("tag", recipe.image_tag, pushed)
    engine.call("push", "--quiet", "--tls-verify=false", pushed, timeout_sec=600)
    parser = argparse.ArgumentParser()
    add_backend_flags(parser)
    common = ["--backend", "container", "--toolchain-dir", str(toolchain_dir), "--pull", "always"]
    sources = {}
    for name, extra in (("with", ["--insecure-registry", registry]), ("without", [])):
        engine.call("rmi", "--force", pushed, check=False)  # only the registry has it
        args = parser.parse_args([*common, "--cache-dir", str(tmp_path / name), *extra])
        settings = ProviderSettings.from_args(args)
        backend = open_provider(dataclasses.replace(settings, stand_in_dir=DEFAULT_STAND_IN_DIR))
        try:
            assert backend.config.insecure_registries == ((registry,) if extra else ())
            sources[name] = backend.resolve_base(pushed).source
        finally:
            backend.close()
    assert sources["with"] == "pulled" and sources["without"] != "pulled", sources
    engine.call("rmi", "--force", pushed, check=False)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--insecure-registry", "http://localhost:5000"])
    assert exit_.value.code == 2
