"""Example and malformed task directories: data for the sandbox tests, not tests of this repository.

Their `tests/` hold the tasks' own verifiers, which run inside sandboxes; pytest must not collect them here.
"""

collect_ignore_glob = ["*"]
