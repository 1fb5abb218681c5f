"""`sandbox_service.signals.StopOnSignal`: the flag, the second signal, the work outside the handler."""

from __future__ import annotations

import signal
import sys
import threading

import pytest

from sandbox_service.signals import StopOnSignal


def test_the_flag_survives_a_signal_handled_inside_a_finaliser():
    """The first SIGINT / SIGTERM sets a flag instead of raising: the default handler's
    KeyboardInterrupt, raised while the main thread runs a finaliser, is dropped by CPython (the
    way a Ctrl-C of check-tasks once went unnoticed in a full `make test`). Here the signal is
    handled inside a `__del__`: the flag is set all the same; a second signal raises; leaving
    restores the handlers."""

    class Finalised:
        def __del__(self):
            # raise_signal sends it to this thread and runs the Python handler before it returns:
            # here, inside the finaliser.
            signal.raise_signal(signal.SIGINT)

    dropped = []
    previous_hook = sys.unraisablehook
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous_term = signal.getsignal(signal.SIGTERM)
    sys.unraisablehook = lambda unraisable: dropped.append(unraisable.exc_type)
    try:
        # What the default handler does there: the KeyboardInterrupt is dropped.
        Finalised()
        assert dropped == [KeyboardInterrupt]
        with StopOnSignal() as stop:
            Finalised()
            assert stop.event.is_set() and stop.signum == signal.SIGINT
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGTERM)
        assert dropped == [KeyboardInterrupt]  # nothing more was dropped
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == previous_term
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGINT, previous_int)


def test_the_work_a_signal_asks_for_runs_outside_the_handler():
    """`on_stop` runs in its own thread: a handler that cancelled trials itself would wait for
    ever on a lock the interrupted main thread holds (here: the main thread holds it while the
    signal is handled; the work gets it once the main thread lets go)."""
    lock = threading.Lock()
    ran_in: list[tuple[str, bool]] = []
    done = threading.Event()

    def on_stop(signum: int) -> None:
        # Run inside the handler, this would wait for the main thread, which waits for it: the
        # timeout turns that deadlock into a failure.
        got = lock.acquire(timeout=10)
        ran_in.append((threading.current_thread().name, got))
        if got:
            lock.release()
        done.set()

    previous_term = signal.getsignal(signal.SIGTERM)
    with StopOnSignal(on_stop=on_stop) as stop:
        with lock:
            signal.raise_signal(signal.SIGTERM)  # handled here, inside the `with lock`
            assert stop.event.is_set() and stop.signum == signal.SIGTERM
            assert not done.is_set()
        assert done.wait(10)
    assert ran_in == [("stop-on-signal", True)]
    assert signal.getsignal(signal.SIGTERM) == previous_term


def test_a_stop_asked_for_before_makes_the_first_signal_the_second():
    event = threading.Event()
    event.set()  # e.g. the controller's request_stop()
    with StopOnSignal(event), pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)


def test_outside_the_main_thread_it_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def enter() -> None:
        with StopOnSignal():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [before]
