"""Cross-process exclusive locks on lock files (builds of one cache key run once at a time).

Invariant: `file_lock(path)` holds an exclusive `flock` on `path` for the `with` block and releases
it on exit, also when the block raises; a process that dies releases it with its file descriptor.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
