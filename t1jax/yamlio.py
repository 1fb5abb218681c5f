"""How every t1jax config file and `--set KEY=VALUE` value is read: `load_yaml`.

PyYAML implements YAML 1.1, whose float pattern needs a dot and a signed exponent, so the way
people write learning rates (`1e-4`, `3e-3`, `2.5e4`) reads as a *string*, and the config then
failed with a type error on a value that looks like a number. This loader is PyYAML's safe loader
plus YAML 1.2's float forms with an exponent (`6e-4`, `1E5`, `2.5e4`); everything else (ints,
`.inf`, booleans, strings) reads as before. Invariant: a scalar that reads as a float here is one
Python's `float()` parses, and no scalar PyYAML reads as an int or float changes type.

It sits at the bottom of the package (no t1jax imports), so `model`, `rl`, `controller`, `sft` and
`demo` can all use it.
"""

from __future__ import annotations

import re
from typing import IO, Any

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 exponent floats (the class-level resolver table is copied on the
    first `add_implicit_resolver`, so yaml.SafeLoader itself is untouched)."""


# Only forms with an exponent are added: the rest of YAML 1.2's floats (`1.5`, `.5`) PyYAML
# already reads, and a plain digit string must stay an int.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def load_yaml(source: str | bytes | IO[str]) -> Any:
    """`yaml.safe_load` with exponent floats read as floats (`1e-4` -> 0.0001)."""
    return yaml.load(source, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
