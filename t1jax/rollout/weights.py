"""Weight publication into a sampler: check a parameter tree against the model, then place it.

Owns two steps of `publish(params, version)` that happen before the barrier, so a wrong tree is
rejected while the engine keeps serving the old version:

- `conform_params(params, reference)`: accept an `nnx.Module`, an `nnx.State` or a nested mapping
  of arrays (e.g. `nnx.to_pure_dict(state)`); check that it names exactly the reference's
  parameters, each with the reference's shape; cast floating-point values to the reference's
  dtype (a trainer may keep float32 masters for a bfloat16 sampler); return an `nnx.State` with
  the reference's structure. Every mismatch is listed in one `ValueError`.
- `place(tree, shardings)`: move arrays onto the sampler's devices with the sampler's shardings:
  Pathways' IFRT reshard when `pathwaysutils` is importable and reports it available, else
  `jax.device_put` (which copies across meshes of one process).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

_MAX_LISTED = 8


def _path_name(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _flat_arrays(params: Any) -> dict[str, Any]:
    """{dotted path: array} of an nnx.Module, nnx.State or nested mapping."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        out = {}
        for path, variable in nnx.to_flat_state(params):
            value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
            out[_path_name(path)] = value
        return out
    if isinstance(params, Mapping):
        out = {}

        def walk(node, prefix):
            for key, value in node.items():
                path = (*prefix, key)
                if isinstance(value, Mapping):
                    walk(value, path)
                elif isinstance(value, nnx.Variable):
                    out[_path_name(path)] = value.get_value()
                else:
                    out[_path_name(path)] = value

        walk(params, ())
        return out
    raise TypeError(
        "params must be an nnx.Module, an nnx.State or a nested mapping of arrays, "
        f"got {type(params).__name__}"
    )


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def conform_params(params: Any, reference: nnx.State) -> nnx.State:
    """`params` checked against `reference` (see the module docstring); raises ValueError."""
    given = _flat_arrays(params)
    reference_flat = list(nnx.to_flat_state(reference))
    expected = {_path_name(path): variable for path, variable in reference_flat}
    problems = []
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing:
        problems.append(f"missing parameters: {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected parameters: {_listed(unexpected)}")
    wrong = []
    for name in sorted(set(expected) & set(given)):
        want = expected[name].get_value()
        have = given[name]
        shape = tuple(getattr(have, "shape", np.shape(have)))
        dtype = np.dtype(getattr(have, "dtype", np.asarray(have).dtype))
        if shape != tuple(want.shape):
            wrong.append(f"{name} has shape {shape}, expected {tuple(want.shape)}")
        elif dtype != np.dtype(want.dtype) and not (
            np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"
        ):
            wrong.append(f"{name} has dtype {dtype}, expected {np.dtype(want.dtype)}")
    if wrong:
        problems.append(
            "; ".join(wrong[:_MAX_LISTED]) + (f" ({len(wrong)} in all)" if len(wrong) > _MAX_LISTED else "")
        )
    if problems:
        raise ValueError("published parameters do not match the sampler's model: " + " | ".join(problems))
    rebuilt = []
    for path, variable in reference_flat:
        value = given[_path_name(path)]
        want_dtype = variable.get_value().dtype
        if getattr(value, "dtype", None) != want_dtype:
            value = jax.numpy.asarray(value).astype(want_dtype)
        rebuilt.append((path, variable.replace(value)))
    return nnx.from_flat_state(rebuilt)


def _pathways_reshard():
    """`pathwaysutils.reshard.reshard` when it can run here, else None."""
    try:
        import pathwaysutils
        import pathwaysutils.jax
        from pathwaysutils import reshard as pathways_reshard
    except ImportError:
        return None
    available = getattr(pathwaysutils.jax, "ifrt_reshard_available", None)
    if available is None or not available():
        return None
    return pathways_reshard.reshard


def place(tree: Any, shardings: Any) -> Any:
    """`tree` moved to `shardings` (same structure)."""
    reshard = _pathways_reshard()
    if reshard is not None:
        return reshard(tree, shardings)
    return jax.device_put(tree, shardings)
