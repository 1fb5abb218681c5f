"""Extension points of the training forward, where a parallel strategy replaces a piece of it.

Four pieces of the forward couple tokens across the sequence or across experts; everything else
is per token and GSPMD shards it from the logical axis names. Each piece has a single-device
default in the model and may be replaced while tracing:

- ``routed_experts(x, expert_ids, gate_weights, w_gate, w_up, w_down, *, matmul) -> [N, H]``:
  same contract as ``t1jax.model.moe.routed_experts`` (expert parallelism swaps in an all-to-all
  dispatch); ``matmul`` is the layer's grouped-matmul kernel (``ExecutionConfig.grouped_matmul()``).
- ``attention(query, key, value, segment_ids, *, execution) -> attn``: same contract as
  ``attend(query, key, value, packed_causal_mask(segment_ids))`` (context parallelism swaps in an
  attention whose causal mask follows each token's original position); ``execution`` is the
  layer's ``ExecutionConfig`` (which kernel and blocks to use).
- ``recurrent``: a ``RecurrentSequenceOps`` used by the Gated DeltaNet full forward: it moves the
  layer input into the layout the recurrence needs and back, and supplies the causal conv and the
  chunked delta rule (context parallelism: the zigzag -> contiguous relayout and the state relay).
- ``decoder_layer(layer, hidden, **kwargs) -> (hidden, expert_ids)``: how each decoder layer is
  called (e.g. under ``nnx.remat``).

Invariants: with no hooks installed (the default) the model runs exactly its own single-device
code. Hooks are read while tracing, so they must be installed *inside* the function being
jitted (``with forward_hooks(...)`` in the traced body): they are not part of jit's cache key.
Only the full forward (``__call__``) consults them; ``extend`` / ``decode_step`` never do.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import jax


class RecurrentSequenceOps(Protocol):
    """The sequence-coupled part of a Gated DeltaNet layer's full forward."""

    def enter(self, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Layer input [B, T, H] and segment ids -> the same in the recurrence's layout."""

    def leave(self, y: jax.Array) -> jax.Array:
        """Layer output [B, T, H] in the recurrence's layout -> the caller's layout."""

    def causal_conv1d(self, x, weight, *, segment_ids):
        """Same contract as ``t1jax.ops.causal_conv1d`` (returns (y, final_state))."""

    def chunk_gated_delta_rule(self, q, k, v, g, beta, *, segment_ids):
        """Same contract as ``t1jax.ops.chunk_gated_delta_rule`` (returns (out, final_state))."""


@dataclasses.dataclass(frozen=True)
class ForwardHooks:
    """Replacements for the sequence- or expert-coupled pieces of the forward; None = default."""

    routed_experts: Callable | None = None
    attention: Callable | None = None
    recurrent: RecurrentSequenceOps | None = None
    decoder_layer: Callable | None = None


_NO_HOOKS = ForwardHooks()
_ACTIVE: contextvars.ContextVar[ForwardHooks] = contextvars.ContextVar(
    "t1jax_forward_hooks", default=_NO_HOOKS
)


def active_hooks() -> ForwardHooks:
    """The hooks installed by the innermost ``forward_hooks`` (all None outside one)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def forward_hooks(hooks: ForwardHooks) -> Iterator[ForwardHooks]:
    """Install ``hooks`` for the forwards traced inside this block."""
    token = _ACTIVE.set(hooks)
    try:
        yield hooks
    finally:
        _ACTIVE.reset(token)
