"""Context parallelism for Gated DeltaNet: the sequence sharded over a ``context`` mesh axis.

Owns three things, each with a per-shard form (call it inside your own ``jax.shard_map``) and a
global wrapper (give it the mesh):

1. ``gated_delta_rule_shard`` / ``context_parallel_gated_delta_rule``: the chunked gated delta rule
   with T sharded contiguously (shard s holds tokens [s T/D, (s+1) T/D)).
2. ``causal_conv1d_shard`` / ``context_parallel_causal_conv1d``: the causal conv with its K-1 token
   halo taken from the previous shard.
3. ``PackedSequenceDescriptor`` and ``relayout_shard`` / ``relayout``: the interleaved ("zigzag")
   layout attention uses for load balance <-> the contiguous layout the recurrence needs.

Invariant: at the same ``chunk_size`` the forward is bit-identical (float32) to the single-device
``chunk_gated_delta_rule`` / ``causal_conv1d`` on the gathered sequence, and gradients agree to
float32 rounding. Packed-sequence semantics (document starts, padding) are those of the single-device
ops, including a document that starts exactly on a shard edge (the previous shard's last segment id
travels with one ``ppermute``).

Why a relay and not a prefix scan of affine summaries
-----------------------------------------------------
Across chunks the state map is affine, S' = M S + N, so a shard could fold its chunks into one
(M, N) (dk x dk and dk x dv per head) and the shards could combine them with log2(D) ``ppermute``
rounds (or one all-gather). That is exact math but not exact floating point: the combination
re-associates the sums, so the state entering shard s differs from the single-device scan in the
last bits, and it costs an extra dk x dk x C matmul per chunk to build M (plus a second pass over
the chunks from the combined state). We relay instead:

  * the state-independent work (``intra_chunk_terms``: the triangular inverse, Q K^T, decays, about
    all of the FLOPs and all of the O(T) activations) runs on every shard at once;
  * the sequential ``inter_chunk_scan`` is relayed: shard r scans its own chunks from the state it
    received (exactly the state the single-device scan holds at that chunk edge, computed by the
    same ``chunk_step``) and ``ppermute``s its final state to shard r + 1.

The relay is a wavefront over G head groups (``pipeline_groups``; heads never interact): shard r
scans head group j at step r + j and passes that group's state on, so while shard 1 scans group 0,
shard 0 already scans group 1. That takes D + G - 1 steps of 1/G of a shard's scan instead of D
full ones (G = D: about 2x a shard's scan instead of Dx). Bit-exactness then also needs each head's
arithmetic to be the same whatever heads share its batched matmul: true on XLA:CPU (tested for
G = 1, 2, 8); on a backend where it is not, ``pipeline_groups=1`` is the plain relay.

Communication: D + G - 1 forward ``ppermute`` steps of one [B, H/G, dk, dv] group state (in total
each shard sends its [B, H, dk, dv] final state once), the same backward for the cotangent, one
ppermute of the [B] boundary segment ids, one psum to broadcast the final state. The intra-chunk
part and all activations divide by D; the scan part is sequential by nature when it must be exact.

Memory: a ``custom_vjp`` keeps, per shard, only the chunk terms of its own T/D tokens and the
[B, H, dk, dv] state it received; the backward wavefront (reverse order, cotangent of the state
flowing shard r -> r - 1) re-runs the shard's local scan of one head group under ``jax.vjp`` when
its turn comes, so per-chunk states are rematerialised locally and never stored for the whole
sequence. Without it, autodiff of the relay loop would keep every step's scan residuals (D x T/D = T
per device), and activation memory would not fall with D. ``bench/cp_scan.py`` measures it: per
device temp memory of forward + backward at T = 8192 (H = 4, dk = dv = 64) is 0.54 / 0.24 / 0.12
of degree 1 for D = 2 / 4 / 8 with the default head groups, 0.46 / 0.23 / 0.12 with G = 1 (the
slice of one head group adds 1/G of the chunk terms).

Relayout
--------
The interleaved layout splits *each sample* (not the whole row) into 2D equal chunks; shard i holds
chunks i and 2D-1-i of every sample, sample after sample. A sample may span several segments, e.g.
a trajectory and the padding that rounds it up to a multiple of 2D, so the descriptor records how
many segments each sample contributes: a real segment of length 8 followed by a padding segment of
length 8 is split as one sample of 16 or as two samples of 8 depending on that count, and the two
layouts differ although the cumulative offsets are identical. ``relayout_shard`` moves tokens with a
ring of D - 1 ``ppermute`` steps of one T/D block each: every shard keeps at most two blocks alive
(activation memory stays O(T/D)); an all-to-all with static capacity would need an O(T) buffer
because per-sample zigzag can send a whole block to one peer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from t1jax.ops.causal_conv import conv_with_history
from t1jax.ops.gated_delta_rule import (
    _check_inputs,
    _from_chunks,
    _masked_f32,
    inter_chunk_scan,
    intra_chunk_terms,
    segment_flags,
)
from t1jax.ops.varying import varying_like

__all__ = [
    "PackedSequenceDescriptor",
    "causal_conv1d_shard",
    "context_parallel_causal_conv1d",
    "context_parallel_gated_delta_rule",
    "gated_delta_rule_shard",
    "relayout",
    "relayout_shard",
]

_HIGHEST = lax.Precision.HIGHEST


# --------------------------------------------------------------------------------------------------
# small collective helpers
# --------------------------------------------------------------------------------------------------


def _shift(x, axis_name, size, step):
    """Send each shard's ``x`` to shard index + ``step`` (no wrap); receivers at the edge get zeros."""
    if step > 0:
        perm = [(i, i + step) for i in range(size - step)]
    else:
        perm = [(i, i + step) for i in range(-step, size)]
    if not perm:
        return jnp.zeros_like(x)
    return lax.ppermute(x, axis_name, perm)


def _ring(x, axis_name, size):
    """Send each shard's ``x`` to shard index + 1 mod size."""
    return lax.ppermute(x, axis_name, [(i, (i + 1) % size) for i in range(size)])


def _from_shard(x, shard, axis_name):
    """The value of ``x`` held by ``shard``, on every shard (exact: the other terms are zeros)."""
    return lax.psum(jnp.where(lax.axis_index(axis_name) == shard, x, jnp.zeros_like(x)), axis_name)


# --------------------------------------------------------------------------------------------------
# the state relay (custom_vjp so that activations stay local)
# --------------------------------------------------------------------------------------------------


def _head_slice(x, start, width, axis):
    return lax.dynamic_slice_in_dim(x, start, width, axis)


def _head_update(x, update, start, axis):
    return lax.dynamic_update_slice_in_dim(x, update, start, axis)


def _group_terms(terms, start, width):
    """The chunk terms of heads [start, start + width) (the head axis of every field is axis 2)."""
    return jax.tree.map(lambda x: _head_slice(x, start, width, 2), terms)


def _relay_forward(terms, state0, axis_name, precision, groups):
    """Wavefront relay: shard r scans head group j at step r + j, then hands that group's final state
    to shard r + 1, which scans the same group at the next step. D + G - 1 steps."""
    size = lax.axis_size(axis_name)
    index = lax.axis_index(axis_name)
    width = state0.shape[1] // groups
    idle_send = varying_like(jnp.zeros_like(state0[:, :width]), (terms, state0, index))

    def run_step(step, carry):
        incoming, out, final = carry
        group = step - index
        start = jnp.clip(group, 0, groups - 1) * width

        def scan_group():
            group_out, group_final = inter_chunk_scan(
                _group_terms(terms, start, width), _head_slice(incoming, start, width, 1), precision
            )
            return (
                _head_update(out, group_out, start, 2),
                _head_update(final, group_final, start, 1),
                group_final,
            )

        out, final, finished = lax.cond(
            (group >= 0) & (group < groups),
            scan_group,
            lambda: (out, final, idle_send),
        )
        received = _shift(finished, axis_name, size, 1)
        # What arrives from shard index - 1 is the group this shard scans at the next step.
        arriving = group + 1
        arriving_start = jnp.clip(arriving, 0, groups - 1) * width
        incoming = jnp.where(
            (index > 0) & (arriving >= 0) & (arriving < groups),
            _head_update(incoming, received, arriving_start, 1),
            incoming,
        )
        return incoming, out, final

    carry = (state0, jnp.zeros(terms.u.shape, jnp.float32), jnp.zeros_like(state0))
    carry = varying_like(carry, (terms, state0, index))
    incoming, out, final = lax.fori_loop(0, size + groups - 1, run_step, carry)
    return out, final, incoming


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _relay_scan(terms, state0, axis_name, precision, groups):
    out, final, _ = _relay_forward(terms, state0, axis_name, precision, groups)
    return out, final


def _relay_scan_fwd(terms, state0, axis_name, precision, groups):
    out, final, incoming = _relay_forward(terms, state0, axis_name, precision, groups)
    return (out, final), (terms, incoming)


def _relay_scan_bwd(axis_name, precision, groups, residuals, cotangents):
    """The same wavefront in reverse: shard r back-propagates head group j at step (D - 1 - r) + j
    (re-running its local scan under ``jax.vjp``) and hands the group's incoming-state cotangent
    to shard r - 1."""
    terms, incoming = residuals
    d_out, d_final = cotangents
    size = lax.axis_size(axis_name)
    index = lax.axis_index(axis_name)
    width = incoming.shape[1] // groups
    every_input = (terms, incoming, d_out, d_final, index)
    idle_send = varying_like(jnp.zeros_like(incoming[:, :width]), every_input)

    def run_step(step, carry):
        d_state_out, d_terms, d_incoming = carry
        group = step - (size - 1 - index)
        start = jnp.clip(group, 0, groups - 1) * width

        def backprop_group():
            _, pullback = jax.vjp(
                lambda t, s: inter_chunk_scan(t, s, precision),
                _group_terms(terms, start, width),
                _head_slice(incoming, start, width, 1),
            )
            d_group_terms, d_group_incoming = pullback(
                (_head_slice(d_out, start, width, 2), _head_slice(d_state_out, start, width, 1))
            )
            d_terms_new = jax.tree.map(lambda acc, d: _head_update(acc, d, start, 2), d_terms, d_group_terms)
            return d_terms_new, _head_update(d_incoming, d_group_incoming, start, 1), d_group_incoming

        d_terms, d_incoming, finished = lax.cond(
            (group >= 0) & (group < groups),
            backprop_group,
            lambda: (d_terms, d_incoming, idle_send),
        )
        received = _shift(finished, axis_name, size, -1)
        arriving = group + 1
        arriving_start = jnp.clip(arriving, 0, groups - 1) * width
        accumulated = _head_slice(d_state_out, arriving_start, width, 1) + received
        d_state_out = jnp.where(
            (index < size - 1) & (arriving >= 0) & (arriving < groups),
            _head_update(d_state_out, accumulated, arriving_start, 1),
            d_state_out,
        )
        return d_state_out, d_terms, d_incoming

    zeros_terms = jax.tree.map(jnp.zeros_like, terms)
    carry = (d_final, zeros_terms, jnp.zeros_like(incoming))
    carry = varying_like(carry, every_input)
    _, d_terms, d_incoming = lax.fori_loop(0, size + groups - 1, run_step, carry)
    # Only shard 0 read state0; the replicated input's cotangent is summed over shards by shard_map.
    d_state0 = jnp.where(index == 0, d_incoming, 0.0)
    return d_terms, d_state0


_relay_scan.defvjp(_relay_scan_fwd, _relay_scan_bwd)


# --------------------------------------------------------------------------------------------------
# per-shard operators
# --------------------------------------------------------------------------------------------------


def _previous_shard_tail(x, axis_name, width):
    """The last ``width`` positions (axis 1) of the previous shard; zeros on shard 0."""
    return _shift(x[:, x.shape[1] - width :], axis_name, lax.axis_size(axis_name), 1)


def _default_pipeline_groups(heads, degree):
    """The largest divisor of ``heads`` not above ``degree`` (D groups fill the wavefront)."""
    return max(d for d in range(1, min(heads, degree) + 1) if heads % d == 0)


def gated_delta_rule_shard(
    q,
    k,
    v,
    g,
    beta,
    *,
    axis_name,
    chunk_size=64,
    initial_state=None,
    segment_ids=None,
    pipeline_groups=None,
    precision=_HIGHEST,
):
    """Per-shard body of the context-parallel chunked gated delta rule (call inside shard_map).

    Arguments are this shard's contiguous slice of the ``chunk_gated_delta_rule`` arguments (local
    length a multiple of ``chunk_size``); ``initial_state`` is the same on every shard (it only
    enters shard 0). Returns (out for this shard's tokens, final state of the whole row on every
    shard).
    """
    _check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    batch, local_length, heads, dk = q.shape
    dv = v.shape[-1]
    if local_length % chunk_size:
        raise ValueError(
            f"each context shard's length ({local_length}) must be a multiple of chunk_size ({chunk_size})"
        )
    size = lax.axis_size(axis_name)
    index = lax.axis_index(axis_name)
    groups = _default_pipeline_groups(heads, size) if pipeline_groups is None else pipeline_groups
    if groups < 1 or heads % groups:
        raise ValueError(f"pipeline_groups must divide the {heads} heads, got {groups}")
    previous_id = None
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
        received = _previous_shard_tail(segment_ids, axis_name, 1)[:, 0]
        previous_id = jnp.where(index == 0, segment_ids[:, 0], received)
    valid, starts = segment_flags(segment_ids, batch, local_length, previous_id)
    q, k, v, g, beta = _masked_f32(valid, q, k, v, g, beta)
    if initial_state is None:
        state0 = jnp.zeros((batch, heads, dk, dv), jnp.float32)
    else:
        state0 = initial_state.astype(jnp.float32)
    terms = intra_chunk_terms(q, k, v, g, beta, valid, starts, chunk_size=chunk_size, precision=precision)
    state0 = varying_like(state0, (terms, lax.axis_index(axis_name)))
    out, final = _relay_scan(terms, state0, axis_name, precision, groups)
    out = jnp.where(valid[..., None, None], _from_chunks(out), 0.0)
    return out, _from_shard(final, size - 1, axis_name)


def causal_conv1d_shard(x, weight, *, axis_name, initial_state=None, segment_ids=None):
    """Per-shard body of the context-parallel causal conv (call inside shard_map).

    ``x`` [B, T/D, C] is this shard's contiguous slice, ``initial_state`` [B, K-1, C] the same on
    every shard. Returns (y for this shard's tokens, final conv state of the row on every shard).
    """
    batch, local_length, channels = x.shape
    kernel = weight.shape[1]
    halo = kernel - 1
    if local_length < halo:
        raise ValueError(f"each context shard needs at least K-1 = {halo} tokens, got {local_length}")
    index = lax.axis_index(axis_name)
    if initial_state is None:
        initial_state = jnp.zeros((batch, halo, channels), jnp.float32)
    if segment_ids is None:
        segment_ids = jnp.ones((batch, local_length), jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    if halo == 0:
        y = jnp.where((segment_ids != 0)[..., None], x.astype(jnp.float32) * weight[:, 0], 0.0)
        return y, initial_state.astype(jnp.float32)
    masked_x = jnp.where((segment_ids != 0)[..., None], x.astype(jnp.float32), 0.0)
    halo_x = _previous_shard_tail(masked_x, axis_name, halo)
    halo_ids = _previous_shard_tail(segment_ids, axis_name, halo)
    first = index == 0
    history = jnp.where(first, initial_state.astype(jnp.float32), halo_x)
    history_ids = jnp.where(first, jnp.broadcast_to(segment_ids[:, :1], (batch, halo)), halo_ids)
    y, last_window, has_real = conv_with_history(x, weight, history, history_ids, segment_ids)
    # The row's conv cache comes from the last shard holding a real token (shard 0 if none: there
    # ``last_window`` is the initial state). T/D >= K-1 keeps every window within one halo.
    holder = lax.pmax(jnp.where(has_real, index, 0), axis_name)  # [B]
    final = lax.psum(jnp.where((index == holder)[:, None, None], last_window, 0.0), axis_name)
    return y, final


# --------------------------------------------------------------------------------------------------
# global wrappers
# --------------------------------------------------------------------------------------------------


def _spec_axes(spec):
    for entry in spec:
        if entry is None:
            continue
        yield from (entry if isinstance(entry, tuple) else (entry,))


def _placed(mesh, args, specs):
    """Reshard arguments onto their specs when the mesh axes are Explicit (shard_map insists); with
    Auto axes shard_map reshards by itself."""
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
    }
    placed = []
    for x, spec in zip(args, specs, strict=True):
        named = set(_spec_axes(spec))
        if named and named <= explicit:
            x = jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))
        elif named & explicit:
            raise ValueError(f"spec {spec} mixes Explicit and non-Explicit mesh axes; use one kind")
        placed.append(x)
    return placed


def _check_mesh(mesh, axis_name, length, what):
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis_name!r} (axes: {mesh.axis_names})")
    degree = mesh.shape[axis_name]
    if length % degree:
        raise ValueError(f"{what}: sequence length {length} is not divisible by context degree {degree}")
    return degree


def context_parallel_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    mesh,
    axis_name="context",
    chunk_size=64,
    initial_state=None,
    segment_ids=None,
    batch_axis=None,
    head_axis=None,
    pipeline_groups=None,
    precision=_HIGHEST,
):
    """``chunk_gated_delta_rule`` with T sharded contiguously over ``mesh`` axis ``axis_name``.

    Same arguments and results as ``chunk_gated_delta_rule`` (global arrays). ``batch_axis`` /
    ``head_axis`` name mesh axes (or tuples, or None) that shard B and H, so the operator composes
    with data and tensor parallelism. Requires T / D to be a multiple of ``chunk_size``.
    """
    _check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    degree = _check_mesh(mesh, axis_name, q.shape[1], "context_parallel_gated_delta_rule")
    if (q.shape[1] // degree) % chunk_size:
        raise ValueError(
            f"T / D = {q.shape[1] // degree} must be a multiple of chunk_size = {chunk_size} "
            "(pad the sequence)"
        )
    token = P(batch_axis, axis_name, head_axis, None)
    per_head = P(batch_axis, axis_name, head_axis)
    state_spec = P(batch_axis, head_axis, None, None)
    args = [q, k, v, g, beta]
    specs = [token, token, token, per_head, per_head]
    has_state, has_ids = initial_state is not None, segment_ids is not None
    if has_state:
        args.append(initial_state)
        specs.append(state_spec)
    if has_ids:
        args.append(segment_ids)
        specs.append(P(batch_axis, axis_name))

    def body(q, k, v, g, beta, *rest):
        rest = list(rest)
        state = rest.pop(0) if has_state else None
        ids = rest.pop(0) if has_ids else None
        return gated_delta_rule_shard(
            q,
            k,
            v,
            g,
            beta,
            axis_name=axis_name,
            chunk_size=chunk_size,
            initial_state=state,
            segment_ids=ids,
            pipeline_groups=pipeline_groups,
            precision=precision,
        )

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(token, state_spec))(
        *_placed(mesh, args, specs)
    )


def context_parallel_causal_conv1d(
    x,
    weight,
    *,
    mesh,
    axis_name="context",
    initial_state=None,
    segment_ids=None,
    batch_axis=None,
    channel_axis=None,
):
    """``causal_conv1d`` with T sharded contiguously over ``mesh`` axis ``axis_name`` (halo exchange).

    Same arguments and results as ``causal_conv1d``; ``channel_axis`` may shard C (and the weight's
    rows). Requires T / D >= K - 1.
    """
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"x must be [B, T, C] and weight [C, K]; got {x.shape} and {weight.shape}")
    _check_mesh(mesh, axis_name, x.shape[1], "context_parallel_causal_conv1d")
    token = P(batch_axis, axis_name, channel_axis)
    state_spec = P(batch_axis, None, channel_axis)
    args, specs = [x, weight], [token, P(channel_axis, None)]
    has_state, has_ids = initial_state is not None, segment_ids is not None
    if has_state:
        args.append(initial_state)
        specs.append(state_spec)
    if has_ids:
        args.append(segment_ids)
        specs.append(P(batch_axis, axis_name))

    def body(x, weight, *rest):
        rest = list(rest)
        state = rest.pop(0) if has_state else None
        ids = rest.pop(0) if has_ids else None
        return causal_conv1d_shard(x, weight, axis_name=axis_name, initial_state=state, segment_ids=ids)

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(token, state_spec))(
        *_placed(mesh, args, specs)
    )


# --------------------------------------------------------------------------------------------------
# interleaved <-> contiguous layout
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedSequenceDescriptor:
    """How the rows of a packed batch are cut into segments and samples, for one context degree.

    Per row: ``segment_lengths`` (consecutive runs of tokens), ``segment_is_padding`` (same length),
    and ``segments_per_sample``: how many consecutive segments each sample contributes. A sample is
    the unit the interleaved layout splits into 2D equal chunks, so each sample's total length must
    be a multiple of 2D; all rows have the same total length T. Real segments get distinct positive
    segment ids, padding segments id 0. The grouping cannot be recovered from segment offsets: a
    real segment of 8 and a padding segment of 8 are either one sample of 16 or two samples of 8.
    """

    segment_lengths: tuple[tuple[int, ...], ...]
    segment_is_padding: tuple[tuple[bool, ...], ...]
    segments_per_sample: tuple[tuple[int, ...], ...]
    context_degree: int

    def __post_init__(self):
        rows = len(self.segment_lengths)
        if rows == 0:
            raise ValueError("PackedSequenceDescriptor needs at least one row")
        if len(self.segment_is_padding) != rows or len(self.segments_per_sample) != rows:
            raise ValueError(
                f"segment_lengths, segment_is_padding and segments_per_sample must have one entry per row; "
                f"got {rows}, {len(self.segment_is_padding)}, {len(self.segments_per_sample)}"
            )
        if self.context_degree < 1:
            raise ValueError(f"context_degree must be >= 1, got {self.context_degree}")
        split = 2 * self.context_degree
        for row in range(rows):
            lengths = self.segment_lengths[row]
            if len(self.segment_is_padding[row]) != len(lengths):
                raise ValueError(
                    f"row {row}: {len(lengths)} segment lengths but "
                    f"{len(self.segment_is_padding[row])} padding flags"
                )
            if any(n <= 0 for n in lengths):
                raise ValueError(f"row {row}: segment lengths must be positive, got {lengths}")
            if any(n <= 0 for n in self.segments_per_sample[row]):
                raise ValueError(
                    f"row {row}: segments_per_sample must be positive, got {self.segments_per_sample[row]}"
                )
            if sum(self.segments_per_sample[row]) != len(lengths):
                raise ValueError(
                    f"row {row}: segments_per_sample {self.segments_per_sample[row]} covers "
                    f"{sum(self.segments_per_sample[row])} segments, the row has {len(lengths)}"
                )
            for sample, length in enumerate(self._sample_lengths(row)):
                if length % split:
                    raise ValueError(
                        f"row {row}, sample {sample}: length {length} is not a multiple of "
                        f"2 * context_degree = {split}"
                    )
        totals = {sum(lengths) for lengths in self.segment_lengths}
        if len(totals) != 1:
            raise ValueError(f"all rows must have the same total length, got {sorted(totals)}")

    @classmethod
    def from_documents(cls, rows, *, row_length, context_degree):
        """One sample per document, each rounded up to a multiple of 2D by its own padding segment;
        the rest of each row is one padding sample. ``rows``: per row, the real document lengths."""
        split = 2 * context_degree
        lengths, padding, per_sample = [], [], []
        for documents in rows:
            row_lengths, row_padding, row_per_sample = [], [], []
            for n in documents:
                pad = -n % split
                row_lengths += [n] + ([pad] if pad else [])
                row_padding += [False] + ([True] if pad else [])
                row_per_sample.append(2 if pad else 1)
            rest = row_length - sum(row_lengths)
            if rest < 0:
                raise ValueError(f"documents {documents} do not fit a row of {row_length} once padded")
            if rest:
                row_lengths.append(rest)
                row_padding.append(True)
                row_per_sample.append(1)
            lengths.append(tuple(row_lengths))
            padding.append(tuple(row_padding))
            per_sample.append(tuple(row_per_sample))
        return cls(tuple(lengths), tuple(padding), tuple(per_sample), context_degree)

    @property
    def rows(self) -> int:
        return len(self.segment_lengths)

    @property
    def row_length(self) -> int:
        return sum(self.segment_lengths[0])

    def _sample_lengths(self, row):
        lengths, position = [], 0
        for count in self.segments_per_sample[row]:
            lengths.append(sum(self.segment_lengths[row][position : position + count]))
            position += count
        return lengths

    def sample_lengths(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self._sample_lengths(row)) for row in range(self.rows))

    def segment_ids(self) -> np.ndarray:
        """int32 [B, T] in contiguous order: real segments numbered 1, 2, ... per row, padding 0."""
        ids = np.zeros((self.rows, self.row_length), np.int32)
        for row in range(self.rows):
            position, next_id = 0, 1
            segments = zip(self.segment_lengths[row], self.segment_is_padding[row], strict=True)
            for length, is_padding in segments:
                if not is_padding:
                    ids[row, position : position + length] = next_id
                    next_id += 1
                position += length
        return ids

    def contiguous_position(self) -> np.ndarray:
        """int32 [B, T]: for each position of the interleaved layout, the contiguous position of the
        token it holds (``relayout`` source index for interleaved <- contiguous)."""
        degree, split = self.context_degree, 2 * self.context_degree
        index = np.zeros((self.rows, self.row_length), np.int32)
        for row in range(self.rows):
            shard_blocks = [[] for _ in range(degree)]
            start = 0
            for length in self._sample_lengths(row):
                piece = length // split
                for shard in range(degree):
                    for chunk in (shard, split - 1 - shard):
                        shard_blocks[shard].append(np.arange(piece) + start + chunk * piece)
                start += length
            index[row] = np.concatenate([np.concatenate(block) for block in shard_blocks])
        return index

    def interleaved_position(self) -> np.ndarray:
        """int32 [B, T]: for each contiguous position, where the token sits in the interleaved layout
        (``relayout`` source index for contiguous <- interleaved)."""
        forward = self.contiguous_position()
        inverse = np.empty_like(forward)
        rows = np.arange(self.rows)[:, None]
        inverse[rows, forward] = np.arange(self.row_length, dtype=np.int32)[None]
        return inverse


def relayout_shard(x, source_position, *, axis_name):
    """Per-shard body of ``relayout``: this shard's ``x`` [B, T/D, ...] in the source layout and
    ``source_position`` int32 [B, T/D] (for each local output position, the global source position).
    Returns [B, T/D, ...] in the target layout. D - 1 ring ``ppermute`` steps of one block each."""
    size = lax.axis_size(axis_name)
    index = lax.axis_index(axis_name)
    local_length = x.shape[1]
    source_shard = source_position // local_length
    source_offset = (source_position % local_length).reshape(source_position.shape + (1,) * (x.ndim - 2))
    out = jnp.zeros_like(x)
    visiting = x
    for step in range(size):
        # After ``step`` ring steps the visiting block is the one shard index - step holds.
        holder = (index - step) % size
        picked = jnp.take_along_axis(visiting, source_offset, axis=1)
        take = (source_shard == holder).reshape(source_shard.shape + (1,) * (x.ndim - 2))
        out = jnp.where(take, picked, out)
        if step + 1 < size:
            visiting = _ring(visiting, axis_name, size)
    return out


def relayout(x, source_position, *, mesh, axis_name="context", batch_axis=None):
    """Permute the tokens of ``x`` [B, T, ...] (T sharded over ``axis_name``) within each row:
    ``out[b, t] = x[b, source_position[b, t]]``. With a ``PackedSequenceDescriptor`` ``d``:
    interleaved -> contiguous uses ``d.interleaved_position()``, contiguous -> interleaved uses
    ``d.contiguous_position()``. Exact (a pure data movement) and differentiable."""
    _check_mesh(mesh, axis_name, x.shape[1], "relayout")
    if source_position.shape != x.shape[:2]:
        raise ValueError(f"source_position must be [B, T] = {x.shape[:2]}, got {source_position.shape}")
    spec = P(batch_axis, axis_name, *([None] * (x.ndim - 2)))
    body = functools.partial(relayout_shard, axis_name=axis_name)
    specs = (spec, P(batch_axis, axis_name))
    args = _placed(mesh, (x, jnp.asarray(source_position, jnp.int32)), specs)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec)(*args)
