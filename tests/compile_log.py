"""Which programs XLA compiles, and in which thread: a logging handler on jax's logger.

jax logs "Finished XLA compilation of <name> in ..." for each compilation (at WARNING while
`jax_log_compiles` is on). Tests use it to check that a program was compiled ahead of time and
not again where it runs (`Learner.precompile`, the controller's `trainer.precompile`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import jax

_PREFIX = "Finished XLA compilation of "


class CompileLog(logging.Handler):
    """(program name, thread name) of each compilation logged while attached."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.records]

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_PREFIX):
            self.records.append((message.removeprefix(_PREFIX).split(" in ")[0], record.threadName))


@contextlib.contextmanager
def compile_log() -> Iterator[CompileLog]:
    """Log every compilation, in every thread (the global `jax_log_compiles`: the
    `jax.log_compiles` context is per thread), into the yielded handler."""
    handler = CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
