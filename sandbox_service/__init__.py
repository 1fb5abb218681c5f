"""Sandbox service: tasks, isolated sandboxes, verifier reports, admission control. Never imports t1jax.

`open_provider(ProviderSettings(...))` opens a backend (`sandbox_service.providers`); importing
the package itself imports nothing else (the command lines' error contract,
`sandbox_service.cli_contract`, is imported by every `t1jax` command).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox_service.providers import ProviderSettings, open_provider

__all__ = ["ProviderSettings", "open_provider"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from sandbox_service import providers

        return getattr(providers, name)
    raise AttributeError(f"module 'sandbox_service' has no attribute {name!r}")
