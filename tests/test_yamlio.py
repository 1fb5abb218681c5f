"""The config reader's YAML floats (t1jax.yamlio): YAML 1.2 exponent forms are floats, nothing
PyYAML already types changes type."""

from __future__ import annotations

import pytest
import yaml

from t1jax.yamlio import load_yaml

# YAML 1.2 core-schema floats that PyYAML (YAML 1.1) reads as strings; the expected value is
# Python's own float() of the text, not a number written here.
EXPONENT_FLOATS = ["6e-4", "1E5", "2.5e4", "-3e-3", "+1e2", ".5e1", "1.5e3"]


@pytest.mark.parametrize("text", EXPONENT_FLOATS)
def test_exponent_floats_read_as_the_number_float_parses(text):
    assert isinstance(yaml.safe_load(text), str)  # the premise: plain PyYAML gets these wrong
    value = load_yaml(text)
    assert isinstance(value, float) and value == float(text)
    assert load_yaml(f"learning_rate: {text}") == {"learning_rate": float(text)}


@pytest.mark.parametrize(
    "text", ["10", "0", "-7", "1_000", "0x1f", "0o17", "1.5", "6.0e-4", ".inf", "-.inf", "true", "null",
             "~", "abc", "1e", "e5", "1.2.3", "2026-12-01", "3:30", "'6e-4'", "v1e5", "1e5x"],
)  # fmt: skip
def test_every_other_scalar_reads_as_pyyaml_reads_it(text):
    assert load_yaml(text) == yaml.safe_load(text)
    assert type(load_yaml(text)) is type(yaml.safe_load(text))


def test_the_safe_loader_itself_is_untouched():
    assert isinstance(yaml.safe_load("6e-4"), str)
    with pytest.raises(yaml.constructor.ConstructorError):  # still a safe loader: no python tags
        load_yaml("!!python/object/apply:os.getcwd []")
