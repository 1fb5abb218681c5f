"""The persistent XLA compilation cache every `t1jax` command shares.

This module owns where compiled programs are kept between processes and how a `t1jax` process is
told. A demo starts a dozen processes (pretraining, SFT, the warm-up, RL, seven evaluations) that
compile the same engine and learner programs for the same model; without a shared cache each
compiles them again (an evaluation of the demo's model: ~20 s of XLA compilation before its first
trial, on 2 cores).

`configure(environ)` runs in `t1jax.cli.main` before any subcommand imports jax, and only sets
environment variables, which jax reads when it is first imported, so the setting reaches the
command's own process and every process it starts (the demo's stages, a controller's helpers):
- `T1JAX_COMPILATION_CACHE`: a directory, or `off`. Unset: `$XDG_CACHE_HOME/t1jax/xla` (or
  `~/.cache/t1jax/xla`).
- An explicit `JAX_COMPILATION_CACHE_DIR` wins over both (the user chose jax's own setting).
- Every program is cached (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0`: the engine's small
  restore programs add up), unless the caller set that variable.
- `JAX_COMPILATION_CACHE_MAX_SIZE` (default `DEFAULT_MAX_BYTES`) is always set, because a size
  limit is what makes jax take a file lock around every cache read and write: without it a
  process can read an entry another process is still writing, and deserialising the partial
  XLA:CPU executable crashes (seen with jax 0.10.2 when two test workers shared a directory).

Invariant: a process whose jax was imported before `configure` ran is not changed (jax read its
settings already); `configure` never imports jax.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

ENV = "T1JAX_COMPILATION_CACHE"
OFF = "off"
DEFAULT_MAX_BYTES = 4 * 2**30  # least recently used entries are evicted past this


def default_directory(environ: MutableMapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "t1jax" / "xla"


def configure(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Point jax's persistent compilation cache at t1jax's directory (see the module docstring).
    Returns the directory in use, or None when the cache is off. A `T1JAX_COMPILATION_CACHE`
    that names an existing file raises ValueError naming it."""
    chosen = environ.get(ENV, "").strip()
    if chosen.lower() == OFF:
        return None
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        directory = Path(environ["JAX_COMPILATION_CACHE_DIR"])
    else:
        directory = Path(chosen).expanduser() if chosen else default_directory(environ)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"{ENV}={chosen or directory}: not a directory (give a directory, or `{OFF}`)")
        environ["JAX_COMPILATION_CACHE_DIR"] = str(directory)
    environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(DEFAULT_MAX_BYTES))
    return directory
