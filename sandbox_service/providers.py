"""Opening a sandbox provider: `ProviderSettings` (which backend, with what) and `open_provider`.

Every caller opens its backend here: the service's command line (`python -m sandbox_service`),
`t1jax train` (a run config's `sandboxes` section), `t1jax eval` and `t1jax sft`. The backends
and what each takes from the settings are the registry's (`sandbox_service.backends`).

Invariant: a field means the same to every caller and every backend; a backend ignores the fields
it has no use for (`pull` means nothing to `local`).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from sandbox_service.contracts import SandboxProvider

DEFAULT_CACHE_DIR = Path(".cache") / "sandbox_service"  # the local backend's default, too


@dataclass(frozen=True)
class ProviderSettings:
    """Which sandbox backend to open and its options.

    `cache_dir`: built environments, stand-in images and sandbox state (`reap` finds leftovers
    there); `stand_in_dir`: the stand-in base roots (None: the user's shared store).
    `toolchain_dir`: the pinned verifier toolchain (`python -m sandbox_service.verifier --setup`);
    None is `<cache_dir>/<DEFAULT_TOOLCHAIN_SUBDIR>`. `allow_internet`: local and
    container let tasks that allow the network reach it. `pull`: the container backend's base
    images (auto / never / always); `insecure_registries` (host[:port]): registries it pulls from
    over plain HTTP (a registry on localhost or a private network without TLS).
    `namespace`, `image_registry`, `runtime_class`: kubernetes.
    `modal_app`: modal."""

    backend: str = "local"
    cache_dir: Path = DEFAULT_CACHE_DIR
    toolchain_dir: Path | None = None
    allow_internet: bool = False
    pull: str = "auto"
    namespace: str = "t1jax-sandboxes"
    image_registry: str | None = None
    runtime_class: str | None = None
    modal_app: str = "t1jax-sandboxes"
    stand_in_dir: Path | None = None
    insecure_registries: tuple[str, ...] = ()

    def toolchain(self) -> Path:
        from sandbox_service.verifier import DEFAULT_TOOLCHAIN_SUBDIR

        if self.toolchain_dir:
            return Path(self.toolchain_dir)
        return Path(self.cache_dir) / DEFAULT_TOOLCHAIN_SUBDIR

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProviderSettings:
        """The settings `add_backend_flags` parsed."""
        return cls(backend=args.backend, cache_dir=args.cache_dir, toolchain_dir=args.toolchain_dir,
                   allow_internet=args.allow_internet, pull=args.pull, namespace=args.namespace,
                   image_registry=args.image_registry, runtime_class=args.runtime_class,
                   modal_app=args.modal_app,
                   insecure_registries=tuple(args.insecure_registry or ()))  # fmt: skip


def open_provider(settings: ProviderSettings) -> SandboxProvider:
    """The backend `settings.backend` names, opened with `settings` (ValueError for a name the
    registry does not know)."""
    from sandbox_service.backends import backend_class, backend_entry

    entry = backend_entry(settings.backend)
    return backend_class(settings.backend)(**entry.options(settings))


def require_toolchain(settings: ProviderSettings) -> None:
    """Raise `ToolchainMissing` (naming the directory and how to build it) before any work if the
    verifier toolchain the backend will mount is not there."""
    from sandbox_service.verifier import Toolchain

    Toolchain.at(settings.toolchain())


_REGISTRY_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?")


def registry_host(value: str) -> str:
    """A registry's host[:port] as image references name it (no scheme, no path)."""
    if not _REGISTRY_HOST.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a registry host[:port] (e.g. localhost:5000; no scheme, no path)"
        )
    return value


def add_backend_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `ProviderSettings.from_args` reads; `--backend` choices are the registry's."""
    from sandbox_service.backends import backend_names
    from sandbox_service.verifier import DEFAULT_TOOLCHAIN_SUBDIR

    group = parser.add_argument_group("backend")
    group.add_argument("--backend", choices=backend_names(), default="local")
    group.add_argument(
        "--toolchain-dir", type=Path, default=None,
        help="the pinned verifier toolchain (python -m sandbox_service.verifier --setup); "
        f"default: <cache-dir>/{DEFAULT_TOOLCHAIN_SUBDIR}",
    )  # fmt: skip
    group.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
        help="built environments, stand-in base images and sandbox state (reap finds leftovers here)",
    )  # fmt: skip
    group.add_argument(
        "--allow-internet", action="store_true",
        help="local, container: let tasks that allow internet reach it (default: every sandbox is offline)",
    )  # fmt: skip
    group.add_argument(
        "--pull", choices=("auto", "never", "always"), default="auto",
        help="container: base images: a local copy, else a pull, else a stand-in (auto); "
        "never pull; pull first",
    )  # fmt: skip
    group.add_argument(
        "--insecure-registry", action="append", type=registry_host, metavar="HOST[:PORT]",
        help="container: pull base images from this registry over plain HTTP, no TLS (repeatable; "
        "e.g. localhost:5000)",
    )  # fmt: skip
    group.add_argument(
        "--namespace", default="t1jax-sandboxes", help="kubernetes: namespace of the sandbox Pods"
    )
    group.add_argument(
        "--image-registry", default=None,
        help="kubernetes: registry holding pre-built images of Dockerfile-only tasks",
    )  # fmt: skip
    group.add_argument(
        "--runtime-class", default=None, help="kubernetes: RuntimeClass of sandbox Pods (e.g. gvisor)"
    )
    group.add_argument("--modal-app", default="t1jax-sandboxes", help="modal: app the sandboxes belong to")
