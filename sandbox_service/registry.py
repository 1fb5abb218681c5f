"""Pushing a task's built image to a registry, for backends that pull (Kubernetes).

This module owns `ImagePublisher`: a Dockerfile-only task's image is built by the container backend
(`PodmanBackend.prepare`: the task's own Dockerfile, real base images where they can be had, else
stand-ins, named in the returned audit), pushed with `podman push` to
`<registry>/<repository>:<tag>` (`kubernetes.RegistryImages.repository_and_tag`: the tag is the
build context's digest), and named by the digest the registry stored it under
(`<registry>/<repository>@sha256:...`), so a Pod runs exactly the bytes that were pushed.

Invariants:
- `image_for(task)` pushes a task's image at most once per publisher (by repository and tag) and
  returns a reference pinned by digest; `--digestfile` is the digest of the pushed manifest.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from sandbox_service.backends.kubernetes import RegistryImages
from sandbox_service.backends.podman import PodmanBackend
from sandbox_service.contracts import Task
from sandbox_service.errors import BackendError


class ImagePublisher:
    """Builds (with `builder`, a container backend) and pushes task images to `registry`
    (host[:port][/path]); `tls_verify` False pushes over plain HTTP (a registry on localhost)."""

    def __init__(self, builder: PodmanBackend, registry: str, *, tls_verify: bool = True):
        self.builder = builder
        self.registry = registry.rstrip("/")
        self.tls_verify = tls_verify
        self._pushed: dict[str, str] = {}
        self._lock = threading.Lock()

    def image_for(self, task: Task) -> str:
        """`<registry>/<repository>@sha256:<digest>` of the task's image, built and pushed if needed."""
        name = f"{self.registry}/{RegistryImages.repository_and_tag(task)}"
        with self._lock:
            if name in self._pushed:
                return self._pushed[name]
        prepared = self.builder.prepare(task)
        with tempfile.TemporaryDirectory(prefix="t1jax-push-") as scratch:
            digest_file = Path(scratch) / "digest"
            done = self.builder.engine.call(
                "push", "--quiet", f"--tls-verify={str(self.tls_verify).lower()}", "--digestfile",
                str(digest_file), prepared.tag, name, check=False, timeout_sec=1800,
            )  # fmt: skip
            digest = digest_file.read_text().strip() if digest_file.is_file() else ""
        if done.returncode != 0 or not digest.startswith("sha256:"):
            error = (done.stderr or b"").decode("utf-8", "replace").strip()[-500:]
            raise BackendError(f"pushing {prepared.tag} to {name} failed: {error}")
        reference = f"{name.rsplit(':', 1)[0]}@{digest}"
        with self._lock:
            self._pushed[name] = reference
        return reference
