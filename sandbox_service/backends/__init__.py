"""Sandbox backends, by name: each is a `SandboxProvider` (see `sandbox_service.contracts`).

`local` (bubblewrap on this host, `backends/local.py`) is the default; `container` (podman on this
host, `backends/podman.py`) runs each trial in a real OCI container built from the task's
Dockerfile. The test suite runs both for real. Other backends register a `"module:Class"`
target with `register_backend`, so that
importing this package never imports a backend's heavy dependencies (kubernetes, modal).

Invariant: `create_provider(name, **options)` returns an object satisfying `SandboxProvider`
(`create(task, run_id=...)`), plus `live_sandboxes(run_id=None)` and `reap(run_id=None)`.
"""

from __future__ import annotations

import importlib
from typing import Any

from sandbox_service.contracts import SandboxProvider

DEFAULT_BACKEND = "local"
_BACKENDS: dict[str, str] = {
    "local": "sandbox_service.backends.local:LocalBackend",
    "container": "sandbox_service.backends.podman:PodmanBackend",
    "kubernetes": "sandbox_service.backends.kubernetes:KubernetesBackend",
    "modal": "sandbox_service.backends.modal:ModalBackend",
}


def register_backend(name: str, target: str) -> None:
    """Make `create_provider(name)` instantiate `target` ("package.module:ClassName")."""
    if ":" not in target:
        raise ValueError(f"backend target {target!r} must look like 'package.module:ClassName'")
    _BACKENDS[name] = target


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def create_provider(name: str = DEFAULT_BACKEND, **options: Any) -> SandboxProvider:
    """Instantiate the backend registered as `name` with `options` (its constructor's keywords)."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {name!r}; known: {', '.join(backend_names())}") from None
    module_name, class_name = target.split(":", 1)
    return getattr(importlib.import_module(module_name), class_name)(**options)
