"""Command-line parsing shared by the package's entry points (`python -m sandbox_service ...`,
`python -m sandbox_service.verifier`).

Invariant: a usage error is reported as one line (`<prog>: error: <what>`) on stderr with exit
status 2, never argparse's usage block or a traceback.
"""

from __future__ import annotations

import argparse

EXIT_BAD_INPUT = 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2 (subparsers inherit it)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def one_line(error: BaseException, limit: int = 400) -> str:
    """An exception as one line of at most `limit` characters (its message, whitespace collapsed)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
