"""Pallas TPU kernels for the training forward and backward, chosen per call and never by a
fallback (paper §7.2: a library that silently switches the long-sequence algorithm re-opens the
train-inference gap).

- `chunk_gated_delta_rule(..., kernel="jax" | "pallas")`: the chunked gated delta rule. "jax" is
  the pure-JAX reference `t1jax.ops.chunk_gated_delta_rule`; "pallas" the forward and
  reverse-scan backward kernels of `t1jax.ops.pallas.gated_delta_rule` (same algorithm, same
  contract, float32).
- `grouped_matmul(..., kernel="ragged_dot" | "megablox")`: the grouped expert matmul.
  "ragged_dot" is `jax.lax.ragged_dot` (what `t1jax.model.moe.routed_experts` calls); "megablox"
  JAX's megablox `gmm` kernel (`t1jax.ops.pallas.grouped_matmul`).

Invariants: a Pallas kernel compiles for TPU (Mosaic) only; anywhere else it must be asked for
with `interpret=True`, which runs the same kernel body through Pallas' interpreter (how the
tests check it on CPU) — a "pallas" call off TPU without it is an error, not a silent switch to
the reference. An unknown kernel name is an error. `lowering_for_tpu()` is the one exception:
inside it a CPU host may trace the Mosaic kernels to lower a program for TPU without running it
(`t1jax.tools.lowering`, `t1jax launch --dry-run`); compiling or running them still needs a TPU.
The model picks its kernels from `t1jax.model.execution.ExecutionConfig`
(`gated_delta_rule_kernel`, `grouped_matmul_kernel`, `attention: splash`, `pallas_interpret`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

from t1jax.ops.gated_delta_rule import chunk_gated_delta_rule as _reference_chunk_gated_delta_rule
from t1jax.ops.pallas.gated_delta_rule import pallas_chunk_gated_delta_rule
from t1jax.ops.pallas.grouped_matmul import megablox_grouped_matmul

__all__ = [
    "GATED_DELTA_RULE_KERNELS",
    "GROUPED_MATMUL_KERNELS",
    "chunk_gated_delta_rule",
    "grouped_matmul",
    "lowering_for_tpu",
    "megablox_grouped_matmul",
    "pallas_chunk_gated_delta_rule",
    "require_tpu_or_interpret",
]

GATED_DELTA_RULE_KERNELS = ("jax", "pallas")
GROUPED_MATMUL_KERNELS = ("ragged_dot", "megablox")


_LOWERING_FOR_TPU: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "t1jax_lowering_for_tpu", default=False
)


@contextlib.contextmanager
def lowering_for_tpu() -> Iterator[None]:
    """Trace the Mosaic (TPU) kernels on any host, to lower a program for TPU (never to run it)."""
    token = _LOWERING_FOR_TPU.set(True)
    try:
        yield
    finally:
        _LOWERING_FOR_TPU.reset(token)


def require_tpu_or_interpret(what: str, interpret: bool) -> None:
    """A Pallas TPU kernel runs on a TPU, through the interpreter, or is traced under
    `lowering_for_tpu()`; anything else is an error naming `what` (never a silent fallback)."""
    if interpret or _LOWERING_FOR_TPU.get() or jax.default_backend() == "tpu":
        return
    raise ValueError(
        f"the {what} kernel compiles for TPU only (backend here: {jax.default_backend()!r}); pass "
        "interpret=True (execution.pallas_interpret: true) to run it in Pallas interpret mode"
    )


def _check_kernel(
    kernel: str, choices: tuple[str, ...], what: str, pallas_name: str, interpret: bool
) -> None:
    if kernel not in choices:
        raise ValueError(f"{what} kernel must be one of {choices}, got {kernel!r}")
    if kernel == pallas_name:
        require_tpu_or_interpret(f"{pallas_name!r} {what}", interpret)


def chunk_gated_delta_rule(
    q, k, v, g, beta, *, kernel: str = "jax", chunk_size=64, initial_state=None, segment_ids=None,
    interpret: bool = False,
):  # fmt: skip
    """`t1jax.ops.chunk_gated_delta_rule`'s contract, computed by the named kernel."""
    _check_kernel(kernel, GATED_DELTA_RULE_KERNELS, "gated delta rule", "pallas", interpret)
    if kernel == "jax":
        return _reference_chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state, segment_ids=segment_ids
        )
    return pallas_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state, segment_ids=segment_ids,
        interpret=interpret,
    )  # fmt: skip


def grouped_matmul(
    lhs, rhs, group_sizes, *, kernel: str = "ragged_dot", tiling=(128, 128, 128), interpret: bool = False
):
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)`, computed by the named kernel."""
    _check_kernel(kernel, GROUPED_MATMUL_KERNELS, "grouped matmul", "megablox", interpret)
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    return megablox_grouped_matmul(lhs, rhs, group_sizes, tiling=tiling, interpret=interpret)
