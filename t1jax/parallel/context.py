"""Context parallelism for the whole model: the sequence sharded over a ``context`` mesh axis.

Owns the model-level pieces around the ops of ``t1jax.ops.context_parallel``:

- ``ContextLayout`` (host side): where each token of a packed batch sits in the layout the model
  runs in. ``ContextLayout.interleaved(descriptor)`` is the zigzag layout (each sample cut into 2D
  equal chunks, shard i holding chunks i and 2D-1-i) that balances causal-attention work across
  shards (paper §7.2); ``ContextLayout.contiguous(rows, length)`` is the identity. ``prepare``
  turns contiguous-order model inputs into layout order (positions are computed first, in
  contiguous order, since they are within-document indices).
- ``context_parallel_attention``: causal attention of the local queries against all keys.
  K, V and segment ids are all-gathered over ``context`` and scattered back into contiguous
  order; the causal mask compares each local query's original position with the key's, which is
  what makes the interleaved layout correct. With the blockwise kernel (the default,
  ``t1jax.ops.flash_attention``) each local query block reads only the key blocks up to its own
  position, so under the zigzag layout every shard does the same causal work (shard s holds chunks
  s and 2D-1-s: one early, one late) and no [T/D, T] score block exists; with ``kernel="dense"``
  each query row reduces over exactly the keys, in exactly the order, of the single-device
  ``attend``.
- ``ContextParallelRecurrence`` (a ``RecurrentSequenceOps``): a Gated DeltaNet layer's input is
  relaid from the model's layout to contiguous (``ops.relayout``), the causal conv takes its K-1
  halo from the previous shard and the chunked delta rule relays its state shard to shard
  (``ops.context_parallel``), and the output is relaid back.

Why all-gather K/V rather than a ring: Qwen3.5's attention is GQA with 2 KV heads against 32
query heads, so the gathered K/V of a whole 84k-token row is ~170 MB per layer in bf16 (head_dim
256), small next to the logits; the gather is one collective per layer that XLA can overlap, and it
keeps the softmax a single exact reduction (a ring with online softmax re-associates the
normaliser and is not bit-exact). Memory: the gathered K/V, plus one [block_q, block_k] score
block per head with the blockwise kernel (the dense core's is [T/D, T]).

Exactness (float32): the recurrent path is bit-identical to one device at the same chunking (the
ops guarantee it); dense attention reduces over the same keys in the same order, so it is
bit-identical whenever the backend's per-row dot products do not depend on how many query rows a
call holds (true of XLA:CPU in our tests); blockwise attention visits each row's key blocks in the
same order as on one device but its query blocks hold other rows, so it matches to float32
rounding. Gradients re-associate sums across shards (K/V cotangents are reduce-scattered), so they
match to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from t1jax.model.attention import attend
from t1jax.model.execution import DEFAULT_EXECUTION, ExecutionConfig
from t1jax.model.transformer import positions_within_documents
from t1jax.ops.context_parallel import (
    PackedSequenceDescriptor,
    context_parallel_causal_conv1d,
    context_parallel_gated_delta_rule,
    relayout,
)
from t1jax.ops.flash_attention import blockwise_attention

__all__ = [
    "ContextLayout",
    "ContextParallelRecurrence",
    "LayoutIndex",
    "context_parallel_attention",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayoutIndex:
    """The traced form of a ``ContextLayout`` (int32 [B, T] each, sharded like the tokens).

    ``original_position[b, t]``: the contiguous position of the token at layout slot t.
    ``layout_slot[b, p]``: the layout slot holding contiguous position p (the inverse)."""

    original_position: jax.Array
    layout_slot: jax.Array


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """Host-side description of the token order the model runs in (see module docstring).

    ``original_position`` int32 [B, T]: for each slot of the layout, the contiguous position of
    the token it holds (a permutation of 0..T-1 per row). ``is_identity`` skips relayouts."""

    original_position: np.ndarray
    is_identity: bool

    @classmethod
    def contiguous(cls, rows: int, length: int) -> ContextLayout:
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
        return cls(positions, True)

    @classmethod
    def interleaved(cls, descriptor: PackedSequenceDescriptor) -> ContextLayout:
        return cls(np.asarray(descriptor.contiguous_position(), np.int32), False)

    def __post_init__(self):
        order = np.sort(self.original_position, axis=1)
        if self.original_position.ndim != 2 or not (order == np.arange(order.shape[1])).all():
            raise ValueError("original_position must be [B, T] holding a permutation of 0..T-1 per row")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.original_position.shape)

    def layout_slot(self) -> np.ndarray:
        slots = np.empty_like(self.original_position)
        rows = np.arange(self.shape[0])[:, None]
        slots[rows, self.original_position] = np.arange(self.shape[1], dtype=np.int32)[None]
        return slots

    def index(self) -> LayoutIndex:
        return LayoutIndex(jnp.asarray(self.original_position), jnp.asarray(self.layout_slot()))

    def to_layout(self, x) -> np.ndarray:
        """[B, T, ...] in contiguous order -> layout order."""
        x = np.asarray(x)
        return np.take_along_axis(x, self.original_position.reshape(self.shape + (1,) * (x.ndim - 2)), 1)

    def to_contiguous(self, x) -> np.ndarray:
        """[B, T, ...] in layout order -> contiguous order."""
        x = np.asarray(x)
        return np.take_along_axis(x, self.layout_slot().reshape(self.shape + (1,) * (x.ndim - 2)), 1)

    def prepare(self, input_ids, segment_ids=None, positions=None, routing_replay=None) -> dict:
        """Model keyword inputs in layout order from contiguous-order ones (positions default to
        each token's index within its document, computed before the reordering)."""
        input_ids = np.asarray(input_ids)
        if input_ids.shape != self.shape:
            raise ValueError(f"input_ids has shape {input_ids.shape}, the layout is for {self.shape}")
        if segment_ids is None:
            segment_ids = np.ones(self.shape, np.int32)
        if positions is None:
            positions = np.asarray(positions_within_documents(jnp.asarray(segment_ids, jnp.int32)))
        batch = {
            "input_ids": self.to_layout(input_ids).astype(np.int32),
            "segment_ids": self.to_layout(segment_ids).astype(np.int32),
            "positions": self.to_layout(positions).astype(np.int32),
        }
        if routing_replay is not None:
            batch["routing_replay"] = self.to_layout(routing_replay).astype(np.int32)
        return batch


def _axes(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _spec_entry(axes: Sequence[str]):
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _to_contiguous_order(x, original_position):
    """Scatter layout-ordered rows x [b, T, ...] to contiguous order (a permutation: exact)."""
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.zeros_like(x).at[rows, original_position].set(x, unique_indices=True)


def _attention_shard(query, key, value, segment_ids, original_position, *, axis_name, reorder, execution):
    gather = functools.partial(lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
    all_keys, all_values, all_ids = gather(key), gather(value), gather(segment_ids)
    if reorder:
        all_positions = gather(original_position)
        all_keys, all_values, all_ids = (
            _to_contiguous_order(x, all_positions) for x in (all_keys, all_values, all_ids)
        )
    if execution.attention != "dense":
        return blockwise_attention(
            query,
            all_keys,
            all_values,
            q_segment_ids=segment_ids,
            kv_segment_ids=all_ids,
            q_index=original_position,
            block_q=execution.attention_block_q,
            block_k=execution.attention_block_k,
        )
    key_position = jnp.arange(all_ids.shape[1], dtype=jnp.int32)
    mask = (
        (segment_ids[:, :, None] == all_ids[:, None, :])
        & (all_ids != 0)[:, None, :]
        & (key_position[None, None, :] <= original_position[:, :, None])
    )
    return attend(query, all_keys, all_values, mask)


def context_parallel_attention(
    query,
    key,
    value,
    segment_ids,
    original_position,
    *,
    mesh,
    axis_name: str = "context",
    batch_axes=None,
    head_axis: str | None = None,
    reorder: bool = True,
    execution: ExecutionConfig = DEFAULT_EXECUTION,
):
    """``attend(query, key, value, packed_causal_mask)`` with T sharded over ``axis_name``.

    query [B, T, heads, D], key/value [B, T, kv_heads, D], segment_ids and original_position int32
    [B, T], all in the model's layout (``original_position``: each slot's contiguous position).
    ``head_axis`` shards both head counts (only if it divides both); ``reorder=False`` asserts the
    layout is contiguous. ``execution.attention`` "dense" is the dense core; any other kernel
    runs blockwise (the splash kernel has no context-parallel form here). Returns
    [B, T, heads, D] in the layout.
    """
    batch = _spec_entry(_axes(batch_axes))
    if head_axis is not None:
        size = mesh.shape.get(head_axis, 1)
        if size == 1 or query.shape[2] % size or key.shape[2] % size:
            head_axis = None
    heads = P(batch, axis_name, head_axis, None)
    tokens = P(batch, axis_name)
    body = functools.partial(_attention_shard, axis_name=axis_name, reorder=reorder, execution=execution)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(heads, heads, heads, tokens, tokens),
        out_specs=heads,
    )(query, key, value, segment_ids.astype(jnp.int32), original_position.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class ContextParallelRecurrence:
    """``RecurrentSequenceOps`` for a context-sharded sequence (built inside the traced forward).

    ``index`` is the traced layout (None: the model already runs in contiguous order);
    ``contiguous_segment_ids`` the row's segment ids in contiguous order."""

    mesh: object
    axis_name: str
    batch_axes: tuple[str, ...]
    head_axis: str | None
    chunk_size: int
    index: LayoutIndex | None
    contiguous_segment_ids: jax.Array

    @property
    def _batch(self):
        return _spec_entry(self.batch_axes)

    def _relayout(self, x, source_position):
        return relayout(x, source_position, mesh=self.mesh, axis_name=self.axis_name, batch_axis=self._batch)

    def enter(self, x, segment_ids):
        if self.index is not None:
            x = self._relayout(x, self.index.layout_slot)
        return x, self.contiguous_segment_ids

    def leave(self, y):
        if self.index is None:
            return y
        return self._relayout(y, self.index.original_position)

    def causal_conv1d(self, x, weight, *, segment_ids):
        return context_parallel_causal_conv1d(
            x,
            weight,
            mesh=self.mesh,
            axis_name=self.axis_name,
            segment_ids=segment_ids,
            batch_axis=self._batch,
        )

    def chunk_gated_delta_rule(self, q, k, v, g, beta, *, segment_ids):
        head_axis = self.head_axis
        if head_axis is not None and q.shape[2] % self.mesh.shape.get(head_axis, 1):
            head_axis = None
        return context_parallel_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            mesh=self.mesh,
            axis_name=self.axis_name,
            chunk_size=self.chunk_size,
            segment_ids=segment_ids,
            batch_axis=self._batch,
            head_axis=head_axis,
        )

    @classmethod
    def build(
        cls,
        mesh,
        segment_ids,
        index: LayoutIndex | None,
        *,
        axis_name="context",
        batch_axes=(),
        head_axis=None,
        chunk_size=64,
    ) -> ContextParallelRecurrence:
        """``segment_ids`` in the model's layout; relaid once here for every recurrent layer."""
        batch_axes = _axes(batch_axes)
        contiguous_ids = segment_ids.astype(jnp.int32)
        if index is not None:
            contiguous_ids = relayout(
                contiguous_ids,
                index.layout_slot,
                mesh=mesh,
                axis_name=axis_name,
                batch_axis=_spec_entry(batch_axes),
            )
        return cls(mesh, axis_name, batch_axes, head_axis, chunk_size, index, contiguous_ids)
