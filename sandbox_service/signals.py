"""Stopping a long-running command on SIGINT / SIGTERM by a flag, not by an exception.

This module owns `StopOnSignal`, the handler the long-running commands of both packages install
while they run: `python -m sandbox_service check-tasks`, `t1jax train`'s controller and `t1jax
eval` (the lower package holds it so that both can).

Invariants:
- The first SIGINT or SIGTERM only sets an Event and records which signal it was. A handler runs
  in the main thread between two bytecodes, wherever that thread was: raising there (the default
  handler's KeyboardInterrupt) is lost when the main thread was running a finaliser (`__del__`,
  a garbage collection: CPython prints "Exception ignored" and drops it), and work done there
  (cancelling trials) could wait for a lock the interrupted main thread holds, for ever. So the
  main thread polls the Event, and the work the first signal asks for (`on_stop`) runs in a fresh
  daemon thread.
- A second signal raises KeyboardInterrupt in the main thread: stop waiting for the clean stop.
- Only the main thread can install handlers: entered in another thread it installs nothing (the
  Event can still be set by the caller). Leaving restores the handlers it replaced.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable


class StopOnSignal:
    """While entered in the main thread: the first of `signals` sets `event` (a new one unless
    given), records `signum` and starts `on_stop(signum)` in a daemon thread; a second raises
    KeyboardInterrupt. An `event` set before any signal (a stop asked for by other means) makes
    the first signal the second."""

    def __init__(
        self,
        event: threading.Event | None = None,
        *,
        on_stop: Callable[[int], None] | None = None,
        signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM),
    ) -> None:
        self.event = threading.Event() if event is None else event
        self.signum = 0
        self._on_stop = on_stop
        self._signals = tuple(signals)
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt(f"signal {signum} again")
        self.signum = signum
        self.event.set()
        if self._on_stop is not None:
            threading.Thread(target=self._on_stop, args=(signum,), name="stop-on-signal", daemon=True).start()

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
