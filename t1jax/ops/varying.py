"""shard_map's varying-axes types for values made inside a manual region.

Inside ``jax.shard_map`` every value carries the set of mesh axes it varies over (``vma``). A loop
carry or a ``cond`` branch must keep its type, so an initial value built from constants (zeros,
-inf) has to be cast to vary over the axes of the data it will be combined with. Outside
shard_map every set is empty and the cast is the identity.
"""

from __future__ import annotations

import jax
from jax import lax

__all__ = ["varying_axes", "varying_like"]


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over inside shard_map (``aval.vma`` on newer jax)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    return frozenset(aval.mat.varying if vma is None else vma)


def varying_like(x, like):
    """Cast every leaf of ``x`` to vary over the mesh axes any leaf of ``like`` varies over, so that
    loop carries and cond branches agree on shard_map's types (the values are unchanged)."""
    axes = frozenset().union(*(varying_axes(leaf) for leaf in jax.tree.leaves(like)))

    def cast(leaf):
        missing = tuple(sorted(axes - varying_axes(leaf), key=str))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, x)
