"""The model's training forward under a sharding plan: which parallel pieces replace the
single-device ones, installed through the model's forward hooks (``t1jax.model.hooks``).

``parallel_forward(plan, mesh, segment_ids=..., layout_index=...)`` is a context manager used
*inside* a traced function (a loss, a train step) around the model call:

- tokens sharded at all (batch or sequence): the routed experts run in a shard_map over the
  token axes (``expert_parallel_routed_experts``), exchanging rows over ``expert`` when
  expert > 1 and staying local otherwise;
- context > 1: full attention is ``context_parallel_attention`` and Gated DeltaNet layers use
  ``ContextParallelRecurrence`` (relayout to contiguous, conv halo, state relay, relayout back);
- remat "layer": each decoder layer is rematerialised in the backward pass (``nnx.remat``), so a
  step keeps one [B, T, hidden] residual per layer plus one layer's internals.

Inputs must already be in the layout the ``layout_index`` describes (``ContextLayout.prepare``)
and placed with ``batch_sharding``; the model is called under the plan's (abstract) mesh and
logical rules (``parallel_forward`` sets both).

Invariant: with every degree 1 and remat "none" no hook is installed and the forward is the
model's own code.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
from flax import nnx

from t1jax.model.hooks import ForwardHooks, forward_hooks
from t1jax.parallel.context import ContextParallelRecurrence, LayoutIndex, context_parallel_attention
from t1jax.parallel.expert_parallel import expert_parallel_routed_experts
from t1jax.parallel.plan import ShardingPlan, batch_axes_for, plan_rules

__all__ = ["forward_hooks_for", "parallel_forward", "remat_layer"]


def remat_layer(layer, hidden, *, positions, segment_ids, replay_ids):
    """Call a decoder layer under ``nnx.remat``: only its inputs are saved for the backward."""

    def body(layer, hidden, positions, segment_ids, replay_ids):
        return layer(hidden, positions=positions, segment_ids=segment_ids, replay_ids=replay_ids)

    return nnx.remat(body)(layer, hidden, positions, segment_ids, replay_ids)


def _token_axes(mesh, plan: ShardingPlan, batch_axes: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes of the flattened [B * T] token dimension: B's axes, then context; the expert
    axis last if the batch could not use it (so each expert shard still holds its own tokens)."""
    axes = batch_axes + (("context",) if plan.context > 1 else ())
    if plan.expert > 1 and "expert" not in axes:
        axes = axes + ("expert",)
    return axes


def forward_hooks_for(
    plan: ShardingPlan,
    mesh,
    *,
    segment_ids: jax.Array,
    layout_index: LayoutIndex | None = None,
    chunk_size: int = 64,
) -> ForwardHooks:
    """The hooks that run the model under ``plan``; ``segment_ids`` int32 [B, T] in the model's
    layout, ``layout_index`` its traced layout (None: contiguous)."""
    batch_size = segment_ids.shape[0]
    batch_axes = batch_axes_for(mesh, plan, batch_size)
    routed = attention = recurrent = None
    token_axes = _token_axes(mesh, plan, batch_axes)
    if token_axes:
        # Also without expert parallelism: the grouped MoE sorts the flattened [B * T] tokens,
        # and GSPMD cannot split a sort along the sorted axis, so under plain sharding every
        # device would gather and process the whole batch's tokens. In the shard_map each shard
        # routes and computes only its own (with an expert axis of size 1 nothing is exchanged).
        routed = functools.partial(
            expert_parallel_routed_experts,
            mesh=mesh,
            expert_axis="expert",
            token_axes=token_axes,
            tensor_axis="tensor" if plan.tensor > 1 else None,
            collective=plan.moe_collective,
        )
    if plan.context > 1:
        head_axis = "tensor" if plan.tensor > 1 else None
        original_position = None if layout_index is None else layout_index.original_position

        def attention(query, key, value, segment_ids, *, execution):
            position = original_position
            if position is None:  # contiguous layout: slot == position
                position = jax.lax.broadcasted_iota("int32", segment_ids.shape, 1)
            return context_parallel_attention(
                query,
                key,
                value,
                segment_ids,
                position,
                mesh=mesh,
                batch_axes=batch_axes,
                head_axis=head_axis,
                reorder=layout_index is not None,
                execution=execution,
            )

        recurrent = ContextParallelRecurrence.build(
            mesh, segment_ids, layout_index, batch_axes=batch_axes, head_axis=head_axis, chunk_size=chunk_size
        )
    decoder_layer = remat_layer if plan.remat == "layer" else None
    return ForwardHooks(
        routed_experts=routed, attention=attention, recurrent=recurrent, decoder_layer=decoder_layer
    )


@contextlib.contextmanager
def parallel_forward(
    plan: ShardingPlan,
    mesh,
    *,
    segment_ids: jax.Array,
    layout_index: LayoutIndex | None = None,
    chunk_size: int = 64,
) -> Iterator[ForwardHooks]:
    """Mesh, logical rules and forward hooks of ``plan`` for the model calls in this block (use
    inside the traced function)."""
    abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
    # Inside jit the mesh context is the abstract one (`jax.set_mesh` is refused under jit).
    with jax.sharding.use_abstract_mesh(abstract), nnx.logical_axis_rules(plan_rules(plan)):
        hooks = forward_hooks_for(
            plan, mesh, segment_ids=segment_ids, layout_index=layout_index, chunk_size=chunk_size
        )
        with forward_hooks(hooks):
            yield hooks
