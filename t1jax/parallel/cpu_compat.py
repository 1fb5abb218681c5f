"""A workaround for a jaxlib 0.10 CPU deadlock that multi-device CPU runs of the model hit.

jaxlib 0.10's CPU lowering of ``triangular_solve`` (used by the chunked gated delta rule) calls
LAPACK ``trsm`` through an FFI kernel that splits a batch over XLA:CPU's intra-op thread pool
(``jax::ParallelBatchMap``) and blocks until the pieces finish. That pool also runs the thunks of
every fake CPU device; when as many devices as the pool has threads (8 on a small machine with 8
fake devices) reach a batched ``trsm`` at the same time, each occupies a pool thread waiting for
work that no free thread can run, and the process hangs with zero CPU use (seen with the model's
forward under an 8-way context or data sharding). jaxlib 0.11 builds without that parallel path.

``xla_triangular_solve_on_cpu()`` lowers ``triangular_solve`` on CPU to XLA's own TriangularSolve
op for the traces made inside it (the lowering jax uses on every other backend). It changes only
which code solves the unit-triangular systems, not the math; comparisons of a sharded run with a
single-device run must trace both inside it. On jaxlib >= 0.11 it does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jaxlib

__all__ = ["needs_trsm_workaround", "xla_triangular_solve_on_cpu"]


def needs_trsm_workaround() -> bool:
    major, minor = (int(part) for part in jaxlib.__version__.split(".")[:2])
    return (major, minor) < (0, 11) and jax.default_backend() == "cpu"


@contextlib.contextmanager
def xla_triangular_solve_on_cpu() -> Iterator[None]:
    """Within this block, CPU traces lower ``triangular_solve`` to XLA's TriangularSolve op."""
    if not needs_trsm_workaround():
        yield
        return
    from jax._src.interpreters import mlir
    from jax._src.lax import linalg

    table = mlir._platform_specific_lowerings["cpu"]
    previous = table.get(linalg.triangular_solve_p)
    mlir.register_lowering(linalg.triangular_solve_p, linalg._triangular_solve_lowering, platform="cpu")
    try:
        yield
    finally:
        if previous is None:
            table.pop(linalg.triangular_solve_p, None)
        else:
            table[linalg.triangular_solve_p] = previous
