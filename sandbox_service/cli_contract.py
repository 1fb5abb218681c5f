"""The error contract of every command line in this repository (`t1jax ...`, `python -m
sandbox_service ...`, `python -m t1jax.launch ...`, `python -m sandbox_service.verifier`).

Invariants:
- Bad input is a `UsageError`, raised where the input is checked (or argparse's own error): one
  line on stderr, ``<prog>: error: <what>``, exit status 2. argparse never prints its usage block
  on an error (`OneLineArgumentParser`).
- Any other exception, whatever its type (a ValueError raised mid-training included), is one line,
  ``<prog>: failed: <Type>: <what> (--debug shows the traceback)``, exit status 1.
- Ctrl-C is ``<prog>: interrupted``, exit 130; a reader of stdout that went away (``| head``) is
  a quiet exit 141.
- ``--debug`` prints the traceback before that line; the status is the same.

Nothing is classified by exception type except `UsageError`. A command whose loaders raise
ValueError / OSError for a bad file says so explicitly around the loading: ``with
checking_input(): config = load(path)`` turns those, there only, into a `UsageError`.

It lives in `sandbox_service` because that is the lower of the two packages: `sandbox_service`
never imports `t1jax`, and `t1jax` may import `sandbox_service`, so both can share this module,
which imports only the standard library (a `t1jax --help` stays cheap).
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


class UsageError(ValueError):
    """Bad input to a command line (a flag, a file, an impossible combination): one line, exit 2.

    A ValueError so that library callers that validate with ``except ValueError`` still see it;
    the reverse does not hold: a plain ValueError is never taken for bad input."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line ``<prog>: error: <what>`` and exit status 2, never
    the usage block (subparsers made by `add_subparsers` inherit the class)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)}\n")


def one_line(error: BaseException | str, limit: int = 400) -> str:
    """An exception (its message) as one line of at most `limit` characters, whitespace collapsed."""
    text = " ".join(str(error).split()) or (type(error).__name__ if isinstance(error, BaseException) else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def checking_input(*also: type[BaseException]) -> Iterator[None]:
    """Mark a block as the checking of input: a ValueError or OSError raised in it (a loader's
    "no such file", "unknown key") is re-raised as a `UsageError` with the same message; `also`
    names further exception types that mean bad input there (e.g. a YAML parser's error)."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, OSError, *also) as error:
        raise UsageError(one_line(error)) from error


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on it); another
    BrokenPipeError (a socket, a subprocess's pipe) is a failure like any other."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def run_command(prog: str, body: Callable[[], int], *, debug: bool = False) -> int:
    """Run `body` (a command's work; returns its exit status) under the contract above."""
    try:
        status = body()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return status
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        if isinstance(error, BrokenPipeError) and stdout_reader_gone():
            # The reader went away: stop quietly, as a shell tool does. stdout now points at
            # /dev/null, so the interpreter's own flush at exit cannot raise again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE
        if debug:
            traceback.print_exc()
        if isinstance(error, UsageError):
            print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
            return EXIT_USAGE
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"{prog}: failed: {type(error).__name__}: {one_line(error)}{hint}", file=sys.stderr)
        return EXIT_FAILURE
