"""The names `sandbox_service.verifier` imports from here, now `sandbox_service.cli_contract`'s
(the one error contract of every command line); kept until the verifier imports them from there."""

from sandbox_service.cli_contract import EXIT_USAGE as EXIT_BAD_INPUT
from sandbox_service.cli_contract import OneLineArgumentParser, one_line

__all__ = ["EXIT_BAD_INPUT", "OneLineArgumentParser", "one_line"]
