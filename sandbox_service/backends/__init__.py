"""Sandbox backends, by name: each is a `SandboxProvider` (see `sandbox_service.contracts`).

`local` (bubblewrap on this host, `backends/local.py`) is the default; `container` (podman on this
host, `backends/podman.py`) runs each trial in a real OCI container built from the task's
Dockerfile; `kubernetes` and `modal` run them remotely. The test suite runs the first two for real.

This registry is the one list of backends: the service's `--backend` choices, a run config's
`sandboxes.backend` and `sandbox_service.open_provider` all read it. An entry names its class as
``"module:Class"`` (importing this package never imports a backend's heavy dependencies:
kubernetes, modal) and how `ProviderSettings` become that class's constructor keywords.
Another backend registers with `register_backend`; it is constructed with ``cache_dir`` and
``toolchain_dir``.

Invariant: `create_provider(name, **options)` and `open_provider(settings)` return an object
satisfying `SandboxProvider` (`create(task, run_id=...)`), plus `live_sandboxes(run_id=None)` and
`reap(run_id=None)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandbox_service.contracts import SandboxProvider

DEFAULT_BACKEND = "local"


def _local_options(settings) -> dict[str, Any]:
    return {"cache_dir": settings.cache_dir, "toolchain_dir": settings.toolchain(),
            "allow_internet": settings.allow_internet, "stand_in_dir": settings.stand_in_dir}  # fmt: skip


def _container_options(settings) -> dict[str, Any]:
    return {**_local_options(settings), "pull": settings.pull,  # PodmanBackend(**options): a PodmanConfig
            "insecure_registries": tuple(settings.insecure_registries)}  # fmt: skip


def _kubernetes_options(settings) -> dict[str, Any]:
    from sandbox_service.backends.kubernetes import KubernetesConfig

    config = KubernetesConfig(
        namespace=settings.namespace,
        image_registry=settings.image_registry,
        runtime_class_name=settings.runtime_class,
        toolchain_dir=settings.toolchain(),
    )
    return {"config": config}


def _modal_options(settings) -> dict[str, Any]:
    from sandbox_service.backends.modal import ModalConfig

    return {"config": ModalConfig(app_name=settings.modal_app, toolchain_dir=settings.toolchain())}


def _registered_options(settings) -> dict[str, Any]:
    return {"cache_dir": settings.cache_dir, "toolchain_dir": settings.toolchain()}


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: its class (``"module:Class"``) and the constructor keywords it takes
    from a `ProviderSettings`."""

    target: str
    options: Callable[[Any], dict[str, Any]] = _registered_options


_BACKENDS: dict[str, BackendEntry] = {
    "local": BackendEntry("sandbox_service.backends.local:LocalBackend", _local_options),
    "container": BackendEntry("sandbox_service.backends.podman:PodmanBackend", _container_options),
    "kubernetes": BackendEntry("sandbox_service.backends.kubernetes:KubernetesBackend", _kubernetes_options),
    "modal": BackendEntry("sandbox_service.backends.modal:ModalBackend", _modal_options),
}
BUILT_IN = tuple(_BACKENDS)


def register_backend(name: str, target: str) -> None:
    """Make `create_provider(name)` / `open_provider` instantiate `target` ("package.module:ClassName",
    constructed with ``cache_dir`` and ``toolchain_dir``)."""
    if ":" not in target:
        raise ValueError(f"backend target {target!r} must look like 'package.module:ClassName'")
    _BACKENDS[name] = BackendEntry(target)


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def backend_entry(name: str) -> BackendEntry:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {name!r}; known: {', '.join(backend_names())}") from None


def backend_class(name: str) -> type:
    module_name, class_name = backend_entry(name).target.split(":", 1)
    return getattr(importlib.import_module(module_name), class_name)


def create_provider(name: str = DEFAULT_BACKEND, **options: Any) -> SandboxProvider:
    """Instantiate the backend registered as `name` with `options` (its constructor's keywords)."""
    return backend_class(name)(**options)
