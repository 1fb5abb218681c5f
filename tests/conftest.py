"""Test-wide setup: 8 fake CPU devices, requested before anything imports jax, and one persistent
XLA compilation cache for the session.

The cache (`t1jax.compilation_cache`) is a fresh directory per session, made by the first process
that imports this file (pytest's own, before xdist starts its workers, which inherit it), so the
workers and every `t1jax` subprocess a test starts share what any of them compiled, and no
session depends on what an earlier one left (the process that made it removes it at the end). It
is configured before jax is imported, so tests' in-process compilations use it too. Concurrent
readers and writers are safe because the cache has a size limit, which makes jax lock the
directory around each access (without it, a worker once crashed deserialising an entry another
process was still writing). `T1JAX_COMPILATION_CACHE=off` runs the suite without it."""

import os
import shutil
import tempfile
from pathlib import Path

from t1jax import compilation_cache

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_SESSION_CACHE = None  # the cache directory this process made (and removes when the session ends)
if compilation_cache.ENV not in os.environ:  # xdist workers inherit the first process's
    _SESSION_CACHE = os.environ[compilation_cache.ENV] = tempfile.mkdtemp(prefix="t1jax-tests-xla-")
compilation_cache.configure()
REPO = Path(__file__).resolve().parents[1]


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
