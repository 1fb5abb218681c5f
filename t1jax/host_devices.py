"""How many devices jax's CPU platform shows a t1jax process.

On a host without an accelerator jax shows one CPU device unless `XLA_FLAGS` carries
`--xla_force_host_platform_device_count=N`. A run config splits devices between the trainer and
the sampler (`devices.trainer + devices.sampler`), so a CPU run needs that many. This module owns
the flag: `host_device_flags` rewrites a flag string to a count (the demo gives each stage exactly
the devices its config splits) and `request_host_devices` asks for a count in this process when
nobody chose one.

Invariants: a count the user set in `XLA_FLAGS` is never changed by `request_host_devices`; the
flag only shapes the CPU platform, so asking changes nothing on an accelerator host; XLA reads it
when jax starts its backends, so once they have started nothing is set (it would not take effect).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

HOST_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def host_device_flags(xla_flags: str, count: int) -> str:
    """`xla_flags` with the fake host (CPU) device count set to `count`, every other flag kept."""
    kept = [flag for flag in xla_flags.split() if not flag.startswith(HOST_DEVICE_COUNT_FLAG + "=")]
    return " ".join([*kept, f"{HOST_DEVICE_COUNT_FLAG}={count}"])


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # another jax: assume the worst, set nothing
        return True


def request_host_devices(count: int, environ: MutableMapping[str, str] | None = None) -> bool:
    """Ask for `count` CPU devices unless `XLA_FLAGS` already names a count or jax's backends
    have started. Returns whether the flag was set."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if any(flag.startswith(HOST_DEVICE_COUNT_FLAG + "=") for flag in flags.split()) or _backends_started():
        return False
    environ["XLA_FLAGS"] = host_device_flags(flags, count)
    return True
