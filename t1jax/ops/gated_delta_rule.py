"""The gated delta rule (Gated DeltaNet's recurrent operator): chunked, token-recurrent and one-step forms.

Owns the math of the recurrence and its packed-sequence semantics; the model layer owns projections,
the causal conv, L2 normalisation and the output norm.

Recurrence, per batch row and value head, with state S of shape [dk, dv] (transformers'
``torch_recurrent_gated_delta_rule``, fla ``naive``)::

    S   <- exp(g_t) * S                         # decay first ...
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T # ... then the delta-rule write reads the decayed state
    o_t  = S^T q_t

Packed sequences (``segment_ids`` int32 [B, T]):
  * id 0 is padding: the state passes through unchanged and the output is exactly zero.
  * a position t > 0 whose id is non-zero and differs from the id at t - 1 starts a document: the
    state is zeroed just before it. ``initial_state`` therefore only reaches the run that starts at
    t = 0 (a row that begins with padding drops it at its first real token).
  * ``final_state`` is the state after the last position; padding does not change it, so with right
    padding it is the state after the row's last real token.

Chunked form (``chunk_gated_delta_rule``), chunk length C, positions i, j inside a chunk, cumulative
log-decay c_i = g_0 + ... + g_i and ``doc_i`` = number of document starts in [0, i] of the chunk:

    L_ij      = exp(c_i - c_j)  if j <= i and doc_i == doc_j, else 0   (masked *before* exp)
    A         = (I + strict_tril(diag(beta) K K^T * L))^-1              (unit lower triangular solve)
    U         = A (beta * V);   W = A (beta * K * exp(c) [doc == 0])
    per chunk, incoming state S:
        V_new = U - W S
        O     = (Q * exp(c) [doc == 0]) S + (Q K^T * L) V_new
        S    <- exp(c_last) [doc_last == 0] S + (K * exp(c_last - c) [doc == doc_last])^T V_new

A document start inside a chunk thus cuts every path from an earlier position (or the incoming
state) to a later one; several starts per chunk, or one on a chunk edge, need nothing special.

``A`` is formed explicitly by recursive block inversion (``unit_lower_triangular_inverse``): with
the diagonal blocks of a unit lower triangular matrix already inverted, [[P, 0], [R, Q]]^-1 =
[[P^-1, 0], [-Q^-1 R P^-1, Q^-1]], doubling the block size log2(C) times, only batched matmuls, and a
``custom_vjp`` (dM = -A^T dA A^T, strictly lower part) so the backward keeps A alone. Not
``jax.scipy.linalg.solve_triangular``: on CPU it is a LAPACK custom call that fans its batch out
onto XLA's intra-op Eigen pool from inside that pool and blocks; with several (fake) CPU devices
solving at once every pool worker ends up blocked and the process deadlocks (seen with 8 devices on
a loaded 2-core host). Not transformers' row-by-row forward substitution either: C dependent steps.

Everything is computed in float32 whatever the input dtype, and every contraction asks for
``Precision.HIGHEST`` so that TPUs do not silently drop f32 matmuls to one bf16 pass.

The chunked form is split in two stages that the context-parallel scan (``context_parallel.py``)
reuses verbatim, which is what makes it bit-exact against this single-device path:
``intra_chunk_terms`` (state independent, parallel over chunks) and ``inter_chunk_scan`` (the
sequential scan over chunks, a ``lax.scan`` of ``chunk_step``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "ChunkTerms",
    "chunk_gated_delta_rule",
    "chunk_step",
    "gated_delta_rule_step",
    "inter_chunk_scan",
    "intra_chunk_terms",
    "recurrent_gated_delta_rule",
    "segment_flags",
    "unit_lower_triangular_inverse",
]

_HIGHEST = lax.Precision.HIGHEST


# --------------------------------------------------------------------------------------------------
# input checking and packed-sequence flags
# --------------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, g, beta, initial_state, segment_ids):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, dk], got shape {q.shape}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape} (heads expanded), got {k.shape}")
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, dv] with [B, T, H] = {q.shape[:3]}, got {v.shape}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != q.shape[:3]:
            raise ValueError(f"{name} must be [B, T, H] = {q.shape[:3]}, got {x.shape}")
    batch, _, heads, dk = q.shape
    dv = v.shape[-1]
    if initial_state is not None and initial_state.shape != (batch, heads, dk, dv):
        raise ValueError(
            f"initial_state must be [B, H, dk, dv] = {(batch, heads, dk, dv)}, got {initial_state.shape}"
        )
    if segment_ids is not None:
        if segment_ids.shape != q.shape[:2]:
            raise ValueError(f"segment_ids must be [B, T] = {q.shape[:2]}, got {segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integers, got dtype {segment_ids.dtype}")


def segment_flags(segment_ids, batch: int, length: int, previous_segment_id=None):
    """(valid, starts) boolean [B, T] from segment ids (None: one document, no padding).

    ``starts[t]`` marks the first token of a document that does not continue from ``t - 1``.
    ``previous_segment_id`` [B] is the id just before position 0 (the tail of the previous context
    shard); None means position 0 never starts a new document (``initial_state`` applies).
    """
    if segment_ids is None:
        ones = jnp.ones((batch, length), bool)
        return ones, jnp.zeros((batch, length), bool)
    segment_ids = segment_ids.astype(jnp.int32)
    first_prev = segment_ids[:, :1] if previous_segment_id is None else previous_segment_id[:, None]
    previous = jnp.concatenate([first_prev.astype(jnp.int32), segment_ids[:, :-1]], axis=1)
    valid = segment_ids != 0
    return valid, valid & (segment_ids != previous)


def _masked_f32(valid, *arrays):
    """Cast to float32 and zero padding positions (so garbage there can never reach real tokens)."""
    out = []
    for x in arrays:
        mask = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
        out.append(jnp.where(mask, x.astype(jnp.float32), 0.0))
    return out


# --------------------------------------------------------------------------------------------------
# one token
# --------------------------------------------------------------------------------------------------


def gated_delta_rule_step(q, k, v, g, beta, state):
    """One token: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv]
    -> (out [B, H, dv] float32, new_state [B, H, dk, dv] float32)."""
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    state = state.astype(jnp.float32) * jnp.exp(g)[..., None, None]
    remembered = jnp.einsum("bhkv,bhk->bhv", state, k, precision=_HIGHEST)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = jnp.einsum("bhkv,bhk->bhv", state, q, precision=_HIGHEST)
    return out, state


# --------------------------------------------------------------------------------------------------
# token-recurrent form
# --------------------------------------------------------------------------------------------------


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, segment_ids=None):
    """Same contract as ``chunk_gated_delta_rule``, evaluated token by token with ``lax.scan``
    (the decode form; also used for short extensions)."""
    _check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    valid, starts = segment_flags(segment_ids, batch, length)
    q, k, v, g, beta = _masked_f32(valid, q, k, v, g, beta)
    if initial_state is None:
        state = jnp.zeros((batch, heads, dk, dv), jnp.float32)
    else:
        state = initial_state.astype(jnp.float32)

    def token(state, xs):
        q_t, k_t, v_t, g_t, beta_t, valid_t, start_t = xs
        fresh = jnp.where(start_t[:, None, None, None], 0.0, state)
        out_t, new_state = gated_delta_rule_step(q_t, k_t, v_t, g_t, beta_t, fresh)
        new_state = jnp.where(valid_t[:, None, None, None], new_state, state)
        out_t = jnp.where(valid_t[:, None, None], out_t, 0.0)
        return new_state, out_t

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, valid, starts)]
    state, out = lax.scan(token, state, time_major)
    return jnp.moveaxis(out, 0, 1), state


# --------------------------------------------------------------------------------------------------
# chunked form
# --------------------------------------------------------------------------------------------------


class ChunkTerms(NamedTuple):
    """State-independent per-chunk terms, chunk-major: every field is [N, B, H, C, ...] ([N, B, H]
    for ``chunk_decay``). ``inter_chunk_scan`` consumes them one chunk at a time."""

    u: jax.Array  # [N, B, H, C, dv]  A (beta V)
    w: jax.Array  # [N, B, H, C, dk]  A (beta K exp(c)), rows after a document start are zero
    q_decayed: jax.Array  # [N, B, H, C, dk]  Q exp(c), zero after a document start
    intra: jax.Array  # [N, B, H, C, C]   (Q K^T) * L
    k_to_end: jax.Array  # [N, B, H, C, dk]  K exp(c_last - c), zero before the chunk's last start
    chunk_decay: jax.Array  # [N, B, H]  exp(c_last), zero if the chunk holds a document start


def _to_chunks(x, chunk_size):
    """[B, T, H, ...] -> [N, B, H, C, ...] with T = N * C."""
    batch, length = x.shape[:2]
    x = x.reshape((batch, length // chunk_size, chunk_size) + x.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def _from_chunks(x):
    """[N, B, H, C, dv] -> [B, N * C, H, dv]."""
    n, batch, heads, chunk, dv = x.shape
    return jnp.moveaxis(x, 0, 1).transpose(0, 1, 3, 2, 4).reshape(batch, n * chunk, heads, dv)


def _block_diagonal(matrix, block):
    """[..., n, n] -> [..., n // block, block, block]: the diagonal blocks.

    By reshapes and slices only (an exact copy): in the row-major flattening, diagonal block a
    starts at a * (block * n + block) and its row i at a further i * n, so padding the flat matrix
    by n entries and cutting it into rows of block * (n + 1) lines the blocks up. (A repeated-index
    einsum lowers to a masked reduction over every tile: ~10% of a CPU train step.)"""
    n = matrix.shape[-1]
    count = n // block
    lead = matrix.shape[:-2]
    flat = matrix.reshape(lead + (n * n,))
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, n)])
    strips = flat.reshape(lead + (count, block * (n + 1)))[..., : block * n]
    return strips.reshape(lead + (count, block, n))[..., :block]


def _unit_lower_inverse_forward(matrix, precision):
    size = matrix.shape[-1]
    padded = 1 << max(size - 1, 0).bit_length()  # next power of two; padding is identity
    strict = jnp.tril(matrix, -1)
    if padded != size:
        pad = [(0, 0)] * (matrix.ndim - 2) + [(0, padded - size)] * 2
        strict = jnp.pad(strict, pad)
    unit = strict + jnp.eye(padded, dtype=matrix.dtype)
    inverse_blocks = jnp.ones(matrix.shape[:-2] + (padded, 1, 1), matrix.dtype)
    block = 1
    while block < padded:
        lower_left = _block_diagonal(unit, 2 * block)[..., block:, :block]
        upper_inv, lower_inv = inverse_blocks[..., 0::2, :, :], inverse_blocks[..., 1::2, :, :]
        coupling = -jnp.einsum(
            "...ij,...jk,...kl->...il", lower_inv, lower_left, upper_inv, precision=precision
        )
        top = jnp.concatenate([upper_inv, jnp.zeros_like(upper_inv)], axis=-1)
        bottom = jnp.concatenate([coupling, lower_inv], axis=-1)
        inverse_blocks = jnp.concatenate([top, bottom], axis=-2)
        block *= 2
    return inverse_blocks[..., 0, :size, :size]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def unit_lower_triangular_inverse(matrix, precision=_HIGHEST):
    """(I + strict_tril(matrix))^-1 over the last two axes (the diagonal and upper triangle of
    ``matrix`` are ignored, as LAPACK's unit-diagonal solve does)."""
    return _unit_lower_inverse_forward(matrix, precision)


def _unit_lower_inverse_fwd(matrix, precision):
    inverse = _unit_lower_inverse_forward(matrix, precision)
    return inverse, inverse


def _unit_lower_inverse_bwd(precision, inverse, cotangent):
    grad = -jnp.einsum("...ji,...jk,...lk->...il", inverse, cotangent, inverse, precision=precision)
    return (jnp.tril(grad, -1),)


unit_lower_triangular_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def intra_chunk_terms(q, k, v, g, beta, valid, starts, *, chunk_size, precision=_HIGHEST):
    """The state-independent work of the chunked form, for T a multiple of ``chunk_size``.

    Inputs as in ``chunk_gated_delta_rule`` (already float32 and zero at padding), plus the
    [B, T] ``valid`` / ``starts`` flags from ``segment_flags``. Returns ``ChunkTerms``.
    """
    q, k, v = (_to_chunks(x, chunk_size) for x in (q, k, v))  # [N, B, H, C, d]
    g, beta = (_to_chunks(x[..., None], chunk_size)[..., 0] for x in (g, beta))  # [N, B, H, C]
    starts = _to_chunks(starts[:, :, None], chunk_size)  # [N, B, 1, C]

    cum_decay = jnp.cumsum(g, axis=-1)
    doc = jnp.cumsum(starts.astype(jnp.int32), axis=-1)  # [N, B, 1, C]
    causal = np.tril(np.ones((chunk_size, chunk_size), bool))
    pair_mask = causal & (doc[..., :, None] == doc[..., None, :])
    pair_decay = jnp.exp(jnp.where(pair_mask, cum_decay[..., :, None] - cum_decay[..., None, :], -jnp.inf))
    from_start = jnp.exp(jnp.where(doc == 0, cum_decay, -jnp.inf))
    to_end = jnp.exp(jnp.where(doc == doc[..., -1:], cum_decay[..., -1:] - cum_decay, -jnp.inf))
    chunk_decay = jnp.exp(jnp.where(doc[..., -1] == 0, cum_decay[..., -1], -jnp.inf))

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # The solve reads only the strict lower triangle (unit diagonal), as transformers' unitriangular.
    ut_system = jnp.einsum("...ik,...jk->...ij", k_beta, k, precision=precision) * pair_decay
    rhs = jnp.concatenate([v_beta, k_beta * from_start[..., None]], axis=-1)
    inverse = unit_lower_triangular_inverse(ut_system, precision)
    solved = jnp.einsum("...ij,...jd->...id", inverse, rhs, precision=precision)
    dv = v.shape[-1]
    intra = jnp.einsum("...ik,...jk->...ij", q, k, precision=precision) * pair_decay
    return ChunkTerms(
        u=solved[..., :dv],
        w=solved[..., dv:],
        q_decayed=q * from_start[..., None],
        intra=intra,
        k_to_end=k * to_end[..., None],
        chunk_decay=jnp.broadcast_to(chunk_decay, g.shape[:-1]),
    )


def chunk_step(state, terms: ChunkTerms, precision=_HIGHEST):
    """Advance [B, H, dk, dv] ``state`` over one chunk (fields of ``terms`` without the N axis).
    Returns (new_state, out [B, H, C, dv])."""
    v_new = terms.u - jnp.einsum("bhck,bhkv->bhcv", terms.w, state, precision=precision)
    out = jnp.einsum("bhck,bhkv->bhcv", terms.q_decayed, state, precision=precision) + jnp.einsum(
        "bhcs,bhsv->bhcv", terms.intra, v_new, precision=precision
    )
    new_state = state * terms.chunk_decay[..., None, None] + jnp.einsum(
        "bhck,bhcv->bhkv", terms.k_to_end, v_new, precision=precision
    )
    return new_state, out


def inter_chunk_scan(terms: ChunkTerms, state, precision=_HIGHEST):
    """Sequential scan of ``chunk_step`` over the chunks of ``terms`` from ``state``.
    Returns (out [N, B, H, C, dv], final_state [B, H, dk, dv])."""
    final_state, out = lax.scan(lambda s, t: chunk_step(s, t, precision), state, terms)
    return out, final_state


def chunk_gated_delta_rule(
    q, k, v, g, beta, *, chunk_size=64, initial_state=None, segment_ids=None, precision=_HIGHEST
):
    """Chunked gated delta rule (training / prefill form).

    q, k: [B, T, H, dk] (already L2-normalised, q already scaled by dk**-0.5, heads already
    expanded to the value-head count H); v: [B, T, H, dv]; g: [B, T, H] log-decay (<= 0);
    beta: [B, T, H]; initial_state: [B, H, dk, dv] or None (zeros).
    segment_ids: int32 [B, T] or None. 0 marks padding; a change of segment id between t-1 and t
    starts a new document: the state is reset to zero there (initial_state applies only to the
    segment that begins at t=0). Padding positions leave the state unchanged and output zeros.
    T need not be a multiple of chunk_size (padded internally).
    Returns (out [B, T, H, dv] float32, final_state [B, H, dk, dv] float32), final_state being the
    state after the last position of each row (padding leaves it unchanged, so with right-padding it
    is the state after each row's last real token).
    """
    x = chunked_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    terms = intra_chunk_terms(x.q, x.k, x.v, x.g, x.beta, x.valid, x.starts, chunk_size=chunk_size,
                              precision=precision)  # fmt: skip
    out, final_state = inter_chunk_scan(terms, x.state, precision)
    return x.output(_from_chunks(out)), final_state


class ChunkedInputs(NamedTuple):
    """The inputs of a chunked gated delta rule, checked and made ready for its chunks: right-padded
    to a multiple of the chunk size, float32, zero at padding; `valid` / `starts` the segment flags
    [B, T + pad]; `state` the float32 initial state (zeros when none was given); `length` the T the
    caller gave."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    valid: jax.Array
    starts: jax.Array
    state: jax.Array
    length: int

    def output(self, out):
        """[B, T + pad, H, dv] -> the caller's [B, T, H, dv], exactly zero at padding."""
        return jnp.where(self.valid[:, : self.length, None, None], out[:, : self.length], 0.0)


def chunked_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size: int) -> ChunkedInputs:
    """What every chunked form (this module's, the Pallas kernels') does before its chunks.
    Padding positions are exact no-ops on the state (beta = 0, g = 0); their outputs are cut."""
    _check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    valid, starts = segment_flags(segment_ids, batch, length)
    pad = -length % chunk_size
    if pad:

        def right_pad(x):
            return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

        q, k, v, g, beta, valid, starts = map(right_pad, (q, k, v, g, beta, valid, starts))
    q, k, v, g, beta = _masked_f32(valid, q, k, v, g, beta)
    if initial_state is None:
        state = jnp.zeros((batch, heads, dk, dv), jnp.float32)
    else:
        state = initial_state.astype(jnp.float32)
    return ChunkedInputs(q, k, v, g, beta, valid, starts, state, length)
