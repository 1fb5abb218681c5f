"""Expert parallelism: the routed experts sharded over an ``expert`` mesh axis, tokens exchanged
with an all-to-all, no token dropped.

Owns ``expert_parallel_routed_experts`` (same contract as ``t1jax.model.moe.routed_experts``, so it
is installed through the ``routed_experts`` forward hook) and the two collectives it can exchange
rows with.

Per shard (inside one ``jax.shard_map`` over the whole mesh), with ``eta`` expert shards each
holding ``E / eta`` consecutive experts:

1. sort this shard's (token, slot) assignments by global expert id; that groups them by the shard
   that owns the expert (``expert_id // (E / eta)``) and, within it, by local expert;
2. exchange the sizes (one ``all_gather`` of an ``eta``-vector) and then the rows and their local
   expert ids with a ragged all-to-all;
3. run the local experts on the received rows: sort by local expert, three grouped matmuls
   (``t1jax.ops.grouped_matmul``: ``lax.ragged_dot``, tiled on CPU);
4. send the results back with the reverse ragged all-to-all (same sizes, transposed), unsort and
   combine with the gate weights exactly as the single-device function does.

Routing itself (``route``, free or replay mode) happens before, in the model, on the global
arrays: replayed ids travel the same path as freely chosen ones, and the router's gradient flows
through the gate weights only, as on one device.

No dropping. Both collectives are sized for the worst case: one sender's slice to one receiver
holds at most ``n * min(k, E / eta)`` rows (n local tokens; a token's k experts are distinct), so
the receive buffer has ``eta * n * min(k, E / eta)`` rows. This relies on the ids of one token
being distinct (true for top-k; replay ids are checked on the host by ``validate_routing_replay``).

Collectives. ``"ragged"`` is ``lax.ragged_all_to_all`` (TPU, GPU): only the real rows move.
XLA:CPU has no ragged all-to-all (``UNIMPLEMENTED: HLO opcode ragged-all-to-all``), so ``"padded"``
implements the same semantics with a dense ``lax.all_to_all`` of per-destination blocks of the
worst-case capacity (zeros beyond each slice's size): exact, differentiable, and ``eta`` times the
ragged send volume in the worst case. ``"auto"`` picks ragged except on CPU. The expert
computation, the offsets and the combine are the same code for both.

With an expert axis of size 1 the same shard_map runs the grouped MoE on each shard's own tokens
and exchanges nothing: GSPMD alone cannot split ``routed_experts``' sort of the flattened tokens
along the sorted axis, and would have every device gather and process all of them.

Composition: tokens ``[N, H]`` are sharded over ``token_axes`` (data-like axes and ``context``;
they must include the expert axis for the shards to hold different tokens); expert weights over
the expert axis and, optionally, their intermediate dimension over a ``tensor_axis`` (partial
down-projections are summed with one ``psum``); any other sharding of the weights (fsdp) is
gathered on entry by the shard_map and reduce-scattered on the way back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from t1jax.ops.grouped_matmul import grouped_matmul

__all__ = [
    "COLLECTIVES",
    "expert_parallel_routed_experts",
    "padded_ragged_all_to_all",
    "worst_case_slice_rows",
]

COLLECTIVES = ("auto", "ragged", "padded")


def worst_case_slice_rows(tokens_per_shard: int, top_k: int, experts_per_shard: int) -> int:
    """The most (token, expert) rows one shard can send to one other: each token reaches at most
    min(k, E / eta) distinct experts of a shard."""
    return tokens_per_shard * min(top_k, experts_per_shard)


def padded_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, capacity
):
    """``lax.ragged_all_to_all`` semantics (one slice per peer) with a dense all-to-all.

    Each shard cuts ``operand[input_offsets[d] : input_offsets[d] + send_sizes[d]]`` for every peer
    d into a zero-padded block of ``capacity`` rows, exchanges the blocks, and writes the slice
    received from peer s at ``output[o_s : o_s + recv_sizes[s]]``, where o_s is the
    ``output_offsets[me]`` peer s passed; every other row of ``output`` is kept. Requires every
    slice to have at most ``capacity`` rows (rows past it would be lost).
    """
    peers = lax.axis_size(axis_name)
    if input_offsets.shape != (peers,):
        raise ValueError(f"one slice per peer: offsets must be [{peers}], got {input_offsets.shape}")
    slot = jnp.arange(capacity, dtype=jnp.int32)
    source_rows = input_offsets[:, None] + slot[None, :]
    sending = slot[None, :] < send_sizes[:, None]
    tail = (1,) * (operand.ndim - 1)
    blocks = jnp.take(operand, jnp.clip(source_rows, 0, operand.shape[0] - 1), axis=0)
    blocks = jnp.where(sending.reshape(sending.shape + tail), blocks, jnp.zeros((), operand.dtype))
    received = lax.all_to_all(blocks, axis_name, 0, 0)  # [peers (sender), capacity, ...]
    landing = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where sender s writes
    target_rows = landing[:, None] + slot[None, :]
    target_rows = jnp.where(slot[None, :] < recv_sizes[:, None], target_rows, output.shape[0])
    flat = received.reshape((peers * capacity,) + received.shape[2:])
    return output.at[target_rows.reshape(-1)].set(flat, mode="drop", unique_indices=True)


def _exchange(collective, axis_name, capacity):
    if collective == "ragged":
        return functools.partial(lax.ragged_all_to_all, axis_name=axis_name)
    return functools.partial(padded_ragged_all_to_all, axis_name=axis_name, capacity=capacity)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _local_experts(rows, local_ids, w_gate, w_up, w_down, matmul=grouped_matmul):
    """SwiGLU of each row with its local expert; ``local_ids == E_local`` marks an empty row
    (output zero). Same arithmetic as ``routed_experts``' grouped computation (``matmul``: the
    grouped matmul kernel, ``ExecutionConfig.grouped_matmul()``)."""
    num_local = w_gate.shape[0]
    order = jnp.argsort(local_ids, stable=True)
    sorted_rows = jnp.take(rows, order, axis=0)
    real = local_ids < num_local
    group_sizes = jnp.bincount(
        jnp.where(real, local_ids, 0), weights=real.astype(jnp.int32), length=num_local
    ).astype(jnp.int32)
    gate = matmul(sorted_rows, w_gate, group_sizes)
    up = matmul(sorted_rows, w_up, group_sizes)
    hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(rows.dtype)
    out = matmul(hidden, w_down, group_sizes)
    # Rows past the groups are empty slots; ragged_dot leaves them unspecified on some backends.
    filled = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    out = jnp.where(filled[:, None], out, jnp.zeros((), out.dtype))
    return jnp.take(out, jnp.argsort(order), axis=0)


def _shard_body(
    x, expert_ids, gate_weights, w_gate, w_up, w_down, *, expert_axis, tensor_axis, collective, matmul
):
    num_tokens, top_k = expert_ids.shape
    peers = lax.axis_size(expert_axis)
    experts_per_shard = w_gate.shape[0]
    capacity = worst_case_slice_rows(num_tokens, top_k, experts_per_shard)
    exchange = _exchange(collective, expert_axis, capacity)

    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    sorted_ids = jnp.take(flat_ids, order)
    send_rows = jnp.take(x, order // top_k, axis=0)
    if peers == 1:  # every expert is local: this shard's tokens never leave it
        returned = _local_experts(send_rows, sorted_ids, w_gate, w_up, w_down, matmul)
    else:
        me = lax.axis_index(expert_axis)
        destination = sorted_ids // experts_per_shard
        send_sizes = jnp.bincount(destination, length=peers).astype(jnp.int32)
        input_offsets = _exclusive_cumsum(send_sizes)
        all_sizes = lax.all_gather(send_sizes, expert_axis)  # [sender, receiver]
        output_offsets = _exclusive_cumsum(all_sizes, axis=0)[me]  # where my slice lands on each peer
        recv_sizes = all_sizes[:, me]
        recv_offsets = _exclusive_cumsum(recv_sizes)

        buffer_rows = peers * capacity
        recv_rows = exchange(
            send_rows,
            jnp.zeros((buffer_rows, x.shape[1]), x.dtype),
            input_offsets,
            send_sizes,
            output_offsets,
            recv_sizes,
        )
        recv_ids = exchange(
            (sorted_ids % experts_per_shard).astype(jnp.int32),
            jnp.full((buffer_rows,), experts_per_shard, jnp.int32),
            input_offsets,
            send_sizes,
            output_offsets,
            recv_sizes,
        )
        expert_out = _local_experts(recv_rows, recv_ids, w_gate, w_up, w_down, matmul)
        # Back: peer s's rows sit at recv_offsets[s]; they land where s cut them (its input offset to me).
        return_offsets = _exclusive_cumsum(all_sizes, axis=1)[:, me]
        returned = exchange(
            expert_out,
            jnp.zeros((num_tokens * top_k, expert_out.shape[1]), expert_out.dtype),
            recv_offsets,
            recv_sizes,
            return_offsets,
            send_sizes,
        )
    unsorted = jnp.take(returned, jnp.argsort(order), axis=0)
    unsorted = unsorted.reshape(num_tokens, top_k, -1).astype(jnp.float32)
    combined = jnp.einsum("nkh,nk->nh", unsorted, gate_weights.astype(jnp.float32))
    if tensor_axis is not None:
        combined = lax.psum(combined, tensor_axis)
    return combined.astype(x.dtype)


def _resolve_collective(collective: str, mesh) -> str:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    if collective != "auto":
        return collective
    if isinstance(mesh, jax.sharding.Mesh):
        platform = mesh.devices.flat[0].platform
    else:  # an AbstractMesh (lowering for another machine): the backend we lower for
        platform = jax.default_backend()
    return "padded" if platform == "cpu" else "ragged"


def _axes_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def expert_parallel_routed_experts(
    x: jax.Array,
    expert_ids: jax.Array,
    gate_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    mesh,
    expert_axis: str = "expert",
    token_axes: Sequence[str] | str | None = None,
    tensor_axis: str | None = None,
    collective: str = "auto",
    matmul: Callable = grouped_matmul,
) -> jax.Array:
    """``routed_experts`` with the experts sharded over ``expert_axis`` of ``mesh``.

    x [N, H]; expert_ids int32 [N, k]; gate_weights [N, k]; w_gate, w_up [E, H, I];
    w_down [E, I, H] (global arrays). ``token_axes``: mesh axes sharding N (default: every axis
    of size > 1 among data, fsdp, expert, context, in that order); ``tensor_axis``: shards I.
    ``matmul``: each shard's grouped matmul (the model passes its ``ExecutionConfig``'s kernel).
    Returns [N, H] in x's dtype, equal to ``routed_experts`` up to float rounding of the
    tensor-axis sum (none without a tensor axis).
    """
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {expert_axis!r} (axes: {mesh.axis_names})")
    num_tokens, top_k = expert_ids.shape
    num_experts = w_gate.shape[0]
    degree = mesh.shape[expert_axis]
    if num_experts % degree:
        raise ValueError(f"{num_experts} experts cannot be split evenly over expert axis of size {degree}")
    if token_axes is None:
        token_axes = tuple(a for a in ("data", "fsdp", "expert", "context") if mesh.shape.get(a, 1) > 1)
        if degree > 1 and expert_axis not in token_axes:
            token_axes += (expert_axis,)
    token_axes = _axes_tuple(token_axes)
    if degree > 1 and expert_axis not in token_axes:
        raise ValueError(
            f"token_axes {token_axes} must include the expert axis {expert_axis!r}: each expert shard "
            "dispatches its own tokens"
        )
    token_shards = 1
    for axis in token_axes:
        token_shards *= mesh.shape[axis]
    if num_tokens % token_shards:
        raise ValueError(f"{num_tokens} tokens cannot be split over token axes {token_axes} ({token_shards})")
    if tensor_axis is not None and mesh.shape.get(tensor_axis, 1) == 1:
        tensor_axis = None
    if tensor_axis is not None and w_gate.shape[2] % mesh.shape[tensor_axis]:
        tensor_axis = None  # intermediate not divisible: replicate it (resolve_spec does the same)
    tokens = P(token_axes, None)
    expert_spec = expert_axis if degree > 1 else None  # a size-1 axis: weights stay whole
    body = functools.partial(
        _shard_body,
        expert_axis=expert_axis,
        tensor_axis=tensor_axis,
        collective=_resolve_collective(collective, mesh),
        matmul=matmul,
    )
    # A Pallas kernel's pallas_call (megablox gmm) declares its output without shard_map's
    # varying-axes type, which a checked shard_map refuses; the XLA matmul keeps the checks.
    return jax.shard_map(
        body,
        mesh=mesh,
        check_vma=matmul is grouped_matmul,
        in_specs=(
            tokens,
            tokens,
            tokens,
            P(expert_spec, None, tensor_axis),
            P(expert_spec, None, tensor_axis),
            P(expert_spec, tensor_axis, None),
        ),
        out_specs=tokens,
    )(x, expert_ids, gate_weights, w_gate, w_up, w_down)
