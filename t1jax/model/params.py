"""How model parameters are created: value, dtype, and logical axis names in one place.

Every parameter of the model is an `nnx.Param` whose `out_sharding` metadata holds one logical axis
name per dimension (see `t1jax.model.axes`). Eager sharding is off: placement on a mesh is
decided once, from those names and a rules table, by `t1jax.parallel.rules.state_shardings` (so a model can be
built, or abstractly evaluated, without a mesh in scope).

Random initial values are drawn with numpy (seeded from the nnx key) when the key is concrete and
with `jax.random` when it is traced (under `nnx.jit` / `nnx.eval_shape`). Eager construction thus
compiles nothing (drawing with jax.random compiles one program per distinct shape, ~10 s for the
tiny model on a shared 2-core machine); the price is that a model built eagerly and one built
under jit from the same seed hold different (equally distributed) values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Init:
    """A parameter distribution: 'normal' (std = a), 'uniform' on [a, b), 'log_uniform' (log of a
    U(a, b) draw), 'zeros', 'ones'."""

    kind: str
    a: float = 0.0
    b: float = 0.0

    def with_jax(self, key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
        if self.kind == "zeros":
            return jnp.zeros(shape, dtype)
        if self.kind == "ones":
            return jnp.ones(shape, dtype)
        if self.kind == "normal":
            return (self.a * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        draw = jax.random.uniform(key, shape, jnp.float32, self.a, self.b)
        return (jnp.log(draw) if self.kind == "log_uniform" else draw).astype(dtype)

    def with_numpy(self, rng: np.random.Generator, shape: tuple[int, ...], dtype) -> jax.Array:
        if self.kind == "zeros":
            return jnp.zeros(shape, dtype)
        if self.kind == "ones":
            return jnp.ones(shape, dtype)
        if self.kind == "normal":
            value = self.a * rng.standard_normal(shape, dtype=np.float32)
        else:
            value = rng.uniform(self.a, self.b, shape).astype(np.float32)
            if self.kind == "log_uniform":
                value = np.log(value)
        return jnp.asarray(value, dtype=dtype)


def normal(stddev: float) -> Init:
    return Init("normal", stddev)


def uniform(low: float, high: float) -> Init:
    return Init("uniform", low, high)


zeros = Init("zeros")
ones = Init("ones")
# Gated DeltaNet `A_log`: log of A ~ U(0.01, 16), as transformers initialises it.
log_uniform_decay = Init("log_uniform", 0.01, 16.0)


_abstract_scope = threading.local()


@contextlib.contextmanager
def abstract_params() -> Iterator[None]:
    """Within this scope models are built with `jax.ShapeDtypeStruct` values and no randomness:
    the same abstract model `nnx.eval_shape` gives, without tracing a single initializer (the
    122B model's ~1,300 parameters trace in ~15 s; this takes well under a second)."""
    previous = getattr(_abstract_scope, "active", False)
    _abstract_scope.active = True
    try:
        yield
    finally:
        _abstract_scope.active = previous


def make_param(
    rngs: nnx.Rngs,
    initializer: Init,
    shape: Sequence[int],
    dtype,
    axes: Sequence[str | None],
) -> nnx.Param:
    shape = tuple(shape)
    if len(axes) != len(shape):
        raise ValueError(f"parameter of shape {shape} given {len(axes)} logical axes {tuple(axes)}")
    if getattr(_abstract_scope, "active", False):
        return nnx.Param(jax.ShapeDtypeStruct(shape, dtype), out_sharding=tuple(axes), eager_sharding=False)
    key = rngs.params()
    if isinstance(key, jax.core.Tracer):
        value = initializer.with_jax(key, shape, dtype)
    else:
        seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
        value = initializer.with_numpy(np.random.default_rng(seed), shape, dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)
