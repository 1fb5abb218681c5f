"""The chunked gated delta rule as TPU Pallas kernels: a forward kernel and a reverse-scan backward.

Same contract and same algorithm as the pure-JAX reference ``t1jax.ops.gated_delta_rule.
chunk_gated_delta_rule`` (read its docstring for the math and the packed-sequence semantics):
within a chunk, L = causal & same-document decays, A = (I + strict_tril(diag(beta) K K^T * L))^-1,
U = A (beta V), W = A (beta K exp(c) [doc == 0]); across chunks the state recurrence
V_new = U - W S, O = Q exp(c) S + (Q K^T * L) V_new, S <- decay S + (K to_end)^T V_new.

What the kernels own, and why they exist: the reference materialises the [N, C, C] chunk matrices
(L, A, Q K^T) in HBM; here each grid step (batch row, head, chunk) builds them in VMEM, and the
state [dk, dv] lives in a VMEM scratch across the sequential chunk axis. Work that is O(T) per head
(padding, masking, the in-chunk cumulative log-decay and its exponentials) stays in plain JAX around
the kernels, so autodiff carries the gradient of ``g`` through ``cumsum``/``exp`` and the backward
kernel only returns the gradients of its own inputs.

Differences from the reference, each deliberate:
- A is formed by forward substitution (row i of A = e_i - M[i, :] A), C dependent row updates,
  instead of the reference's recursive block inversion: the latter needs sub-tile slices that a
  TPU vector unit cannot address. Both are exact inverses of a unit lower triangular matrix; in
  float32 they agree to rounding (the tests bound it).
- The backward stores the state entering each chunk ([B, H, N, dk, dv] float32, as fla and other
  chunked kernels do) instead of letting XLA save what ``lax.scan``'s autodiff needs.

Invariants: float32 throughout (inputs are cast, every dot asks for ``Precision.HIGHEST``); the
kernel is selected only by the caller (``t1jax.ops.pallas.chunk_gated_delta_rule(kernel=...)``),
never by a fallback; ``interpret=True`` runs the very same kernel bodies through Pallas' interpreter
(how the tests check them on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from t1jax.ops.gated_delta_rule import chunked_inputs

__all__ = ["pallas_chunk_gated_delta_rule"]

_HIGHEST = lax.Precision.HIGHEST
_NN = (((1,), (0,)), ((), ()))  # a @ b
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_TN = (((0,), (0,)), ((), ()))  # a^T @ b


def _dot(a, b, dims=_NN):
    return lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------------------------------
# pieces shared by both kernels (they run inside a kernel body, on one chunk of one head)
# --------------------------------------------------------------------------------------------------


def _pair_decay(c_col, c_row, doc_col, doc_row):
    """L [C, C]: exp(c_i - c_j) where j <= i in the same document, else 0 (masked before exp)."""
    size = c_col.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    mask = (cols <= rows) & (doc_col == doc_row)
    return jnp.exp(jnp.where(mask, c_col - c_row, -jnp.inf))


def _strict_lower(x):
    size = x.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    return jnp.where(cols < rows, x, 0.0)


def _unit_lower_inverse(strict, inverse_ref):
    """Write (I + strict)^-1 into ``inverse_ref`` [C, C] (``strict`` is zero on and above the
    diagonal) by forward substitution: rows of the inverse below i are untouched identity rows
    while row i is computed, and strict[i, j >= i] = 0 keeps them out of it."""
    size = strict.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    inverse_ref[...] = (rows == cols).astype(jnp.float32)
    lanes = lax.broadcasted_iota(jnp.int32, (1, size), 1)
    strict_rows = strict

    def row(i, carry):
        pick = (lax.broadcasted_iota(jnp.int32, (1, size), 1) == i).astype(jnp.float32)
        m_row = _dot(pick, strict_rows)  # strict[i, :] as [1, C]
        new_row = (lanes == i).astype(jnp.float32) - _dot(m_row, inverse_ref[...])
        inverse_ref[pl.ds(i, 1), :] = new_row
        return carry

    lax.fori_loop(1, size, row, 0)
    return inverse_ref[...]


def _chunk_matrices(q, k, beta, c_col, c_row, doc_col, doc_row, inverse_ref):
    """(L, K K^T, Q K^T, A) of one chunk."""
    decay = _pair_decay(c_col, c_row, doc_col, doc_row)
    kk = _dot(k, k, _NT)
    qk = _dot(q, k, _NT)
    inverse = _unit_lower_inverse(_strict_lower(beta * kk * decay), inverse_ref)
    return decay, kk, qk, inverse


# --------------------------------------------------------------------------------------------------
# forward kernel
# --------------------------------------------------------------------------------------------------


def _forward_kernel(
    q_ref, k_ref, v_ref, beta_ref, c_col_ref, c_row_ref, doc_col_ref, doc_row_ref,
    from_start_ref, to_end_ref, chunk_decay_ref, state0_ref,
    out_ref, final_state_ref, chunk_states_ref,
    state_ref, inverse_ref,
):  # fmt: skip
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        state_ref[...] = state0_ref[...]

    q, k, v, beta = q_ref[...], k_ref[...], v_ref[...], beta_ref[...]
    from_start, to_end = from_start_ref[...], to_end_ref[...]
    decay, _, qk, inverse = _chunk_matrices(
        q, k, beta, c_col_ref[...], c_row_ref[...], doc_col_ref[...], doc_row_ref[...], inverse_ref
    )
    u = _dot(inverse, beta * v)
    w = _dot(inverse, beta * k * from_start)
    state = state_ref[...]
    chunk_states_ref[...] = state
    v_new = u - _dot(w, state)
    out_ref[...] = _dot(q * from_start, state) + _dot(qk * decay, v_new)
    state = chunk_decay_ref[...] * state + _dot(k * to_end, v_new, _TN)
    state_ref[...] = state

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        final_state_ref[...] = state


# --------------------------------------------------------------------------------------------------
# backward kernel (chunks in reverse order)
# --------------------------------------------------------------------------------------------------


def _backward_kernel(
    q_ref, k_ref, v_ref, beta_ref, c_col_ref, c_row_ref, doc_col_ref, doc_row_ref,
    from_start_ref, to_end_ref, chunk_decay_ref, chunk_states_ref, d_out_ref, d_final_ref,
    dq_ref, dk_ref, dv_ref, dbeta_ref, dc_col_ref, dc_row_ref, d_from_start_ref, d_to_end_ref,
    d_chunk_decay_ref, d_state0_ref,
    d_state_ref, inverse_ref,
):  # fmt: skip
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _():
        d_state_ref[...] = d_final_ref[...]

    q, k, v, beta = q_ref[...], k_ref[...], v_ref[...], beta_ref[...]
    from_start, to_end, chunk_decay = from_start_ref[...], to_end_ref[...], chunk_decay_ref[...]
    state = chunk_states_ref[...]  # entering this chunk
    d_out = d_out_ref[...]
    d_next = d_state_ref[...]  # cotangent of the state leaving this chunk
    decay, kk, qk, inverse = _chunk_matrices(
        q, k, beta, c_col_ref[...], c_row_ref[...], doc_col_ref[...], doc_row_ref[...], inverse_ref
    )
    v_beta = beta * v
    k_beta = beta * k * from_start
    u = _dot(inverse, v_beta)
    w = _dot(inverse, k_beta)
    v_new = u - _dot(w, state)
    q_start = q * from_start
    k_end = k * to_end
    intra = qk * decay

    # state_out = chunk_decay * state + k_end^T v_new
    d_state = chunk_decay * d_next
    d_chunk_decay_ref[...] = jnp.sum(state * d_next, keepdims=True)
    d_k_end = _dot(v_new, d_next, _NT)
    d_v_new = _dot(k_end, d_next)
    # out = q_start state + intra v_new
    d_q_start = _dot(d_out, state, _NT)
    d_state = d_state + _dot(q_start, d_out, _TN)
    d_intra = _dot(d_out, v_new, _NT)
    d_v_new = d_v_new + _dot(intra, d_out, _TN)
    # v_new = u - w state
    d_w = -_dot(d_v_new, state, _NT)
    d_state = d_state - _dot(w, d_v_new, _TN)
    # u = A v_beta, w = A k_beta
    d_inverse = _dot(d_v_new, v_beta, _NT) + _dot(d_w, k_beta, _NT)
    d_v_beta = _dot(inverse, d_v_new, _TN)
    d_k_beta = _dot(inverse, d_w, _TN)
    # A = (I + M)^-1, M = strict_lower(beta kk decay): dM = -A^T dA A^T on the strict lower part
    d_m = _strict_lower(-_dot(_dot(inverse, d_inverse, _TN), inverse, _NT))
    d_kk = d_m * beta * decay
    d_decay = d_m * beta * kk + d_intra * qk
    d_qk = d_intra * decay

    dq_ref[...] = _dot(d_qk, k) + d_q_start * from_start
    dk_ref[...] = (
        _dot(d_qk, q, _TN)
        + _dot(d_kk, k)
        + _dot(d_kk, k, _TN)
        + d_k_end * to_end
        + d_k_beta * beta * from_start
    )
    dv_ref[...] = d_v_beta * beta
    dbeta_ref[...] = (
        jnp.sum(d_m * kk * decay, axis=1, keepdims=True)
        + jnp.sum(d_v_beta * v, axis=1, keepdims=True)
        + jnp.sum(d_k_beta * k * from_start, axis=1, keepdims=True)
    )
    d_log_decay = d_decay * decay  # d/d(c_i - c_j) of exp(c_i - c_j)
    dc_col_ref[...] = jnp.sum(d_log_decay, axis=1, keepdims=True)
    dc_row_ref[...] = -jnp.sum(d_log_decay, axis=0, keepdims=True)
    d_from_start_ref[...] = jnp.sum(d_q_start * q + d_k_beta * beta * k, axis=1, keepdims=True)
    d_to_end_ref[...] = jnp.sum(d_k_end * k, axis=1, keepdims=True)
    d_state_ref[...] = d_state

    @pl.when(step == pl.num_programs(2) - 1)
    def _():
        d_state0_ref[...] = d_state


# --------------------------------------------------------------------------------------------------
# pallas_call plumbing
# --------------------------------------------------------------------------------------------------


def _specs(batch, heads, chunks, chunk, dk, dv, reverse):
    """BlockSpecs for grid (B, H, N). Every block's last two dims are the array's full last two
    dims (chunk-major layout), which is what the TPU block-shape rule asks of small blocks."""
    sq = pl.squeezed

    def chunk_index(n):
        return chunks - 1 - n if reverse else n

    def per_chunk(rows, cols):
        return pl.BlockSpec((sq, sq, sq, rows, cols), lambda b, h, n: (b, h, chunk_index(n), 0, 0))

    def per_row_chunk(rows, cols):  # document flags depend on the batch row only
        return pl.BlockSpec((sq, sq, rows, cols), lambda b, h, n: (b, chunk_index(n), 0, 0))

    state = pl.BlockSpec((sq, sq, dk, dv), lambda b, h, n: (b, h, 0, 0))
    return {
        "qk": per_chunk(chunk, dk),
        "v": per_chunk(chunk, dv),
        "col": per_chunk(chunk, 1),
        "row": per_chunk(1, chunk),
        "doc_col": per_row_chunk(chunk, 1),
        "doc_row": per_row_chunk(1, chunk),
        "scalar": per_chunk(1, 1),
        "chunk_state": per_chunk(dk, dv),
        "state": state,
    }


def _chunk_input_specs(s):
    """Specs of the per-chunk inputs both kernels read, in `_chunked_core`'s order (q, k, v, beta,
    c_col, c_row, doc_col, doc_row, from_start, to_end, chunk_decay)."""
    return [
        s["qk"], s["qk"], s["v"], s["col"], s["col"], s["row"], s["doc_col"], s["doc_row"],
        s["col"], s["col"], s["scalar"],
    ]  # fmt: skip


def _call(kernel, inputs, in_specs, out_specs, out_shape, interpret):
    """One pallas_call over grid (B, H, N) with the state and chunk-matrix VMEM scratch."""
    batch, heads, chunks, chunk, dk = inputs[0].shape
    dv = inputs[2].shape[-1]
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, chunks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32), pltpu.VMEM((chunk, chunk), jnp.float32)],
        compiler_params=None
        if interpret
        else pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(*inputs)


def _forward_call(inputs, interpret):
    q, _, v = inputs[:3]
    batch, heads, chunks, chunk, dk = q.shape
    dv = v.shape[-1]
    s = _specs(batch, heads, chunks, chunk, dk, dv, reverse=False)
    f32 = jnp.float32
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, chunks, chunk, dv), f32),
        jax.ShapeDtypeStruct((batch, heads, dk, dv), f32),
        jax.ShapeDtypeStruct((batch, heads, chunks, dk, dv), f32),
    ]
    in_specs = [*_chunk_input_specs(s), s["state"]]
    out_specs = [s["v"], s["state"], s["chunk_state"]]
    return _call(_forward_kernel, list(inputs), in_specs, out_specs, out_shape, interpret)


def _backward_call(inputs, chunk_states, d_out, d_final, interpret):
    q, _, v = inputs[:3]
    batch, heads, chunks, chunk, dk = q.shape
    s = _specs(batch, heads, chunks, chunk, dk, v.shape[-1], reverse=True)
    in_specs = [*_chunk_input_specs(s), s["chunk_state"], s["v"], s["state"]]
    out_specs = [*_chunk_input_specs(s)[:6], s["col"], s["col"], s["scalar"], s["state"]]
    # gradients of q, k, v, beta, c_col, c_row, from_start, to_end, chunk_decay, initial state
    grad_of = [*inputs[:6], *inputs[8:]]
    out_shape = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in grad_of]
    operands = [*inputs[:-1], chunk_states, d_out, d_final]
    return _call(_backward_kernel, operands, in_specs, out_specs, out_shape, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_core(interpret, *inputs):
    out, final_state, _ = _forward_call(inputs, interpret)
    return out, final_state


def _core_fwd(interpret, *inputs):
    out, final_state, chunk_states = _forward_call(inputs, interpret)
    return (out, final_state), (inputs, chunk_states)


def _core_bwd(interpret, residuals, cotangents):
    inputs, chunk_states = residuals
    d_out, d_final = cotangents
    grads = _backward_call(inputs, chunk_states, d_out, d_final, interpret)
    dq, dk, dv, dbeta, dc_col, dc_row, d_from_start, d_to_end, d_chunk_decay, d_state0 = grads
    doc_col, doc_row = inputs[6], inputs[7]
    return (
        dq, dk, dv, dbeta, dc_col, dc_row, jnp.zeros_like(doc_col), jnp.zeros_like(doc_row),
        d_from_start, d_to_end, d_chunk_decay, d_state0,
    )  # fmt: skip


_chunked_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------------------------------
# the public function
# --------------------------------------------------------------------------------------------------


def pallas_chunk_gated_delta_rule(
    q, k, v, g, beta, *, chunk_size=64, initial_state=None, segment_ids=None, interpret=False
):
    """``chunk_gated_delta_rule``'s contract (shapes, segment semantics, float32 outputs), computed
    by the Pallas kernels. Differentiable in q, k, v, g, beta and initial_state."""
    inputs = chunked_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    q, k, v, g, beta, starts, state0 = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.starts,
                                        inputs.state)  # fmt: skip
    batch, padded, heads, _ = q.shape
    dv = v.shape[-1]
    chunks = padded // chunk_size

    def head_chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape((batch, heads, chunks, chunk_size) + x.shape[3:])

    q_c, k_c, v_c = head_chunks(q), head_chunks(k), head_chunks(v)
    g_c, beta_c = head_chunks(g), head_chunks(beta)  # [B, H, N, C]
    doc = jnp.cumsum(starts.reshape(batch, chunks, chunk_size).astype(jnp.int32), axis=-1)
    cum = jnp.cumsum(g_c, axis=-1)
    doc_h = doc[:, None]
    from_start = jnp.exp(jnp.where(doc_h == 0, cum, -jnp.inf))
    to_end = jnp.exp(jnp.where(doc_h == doc_h[..., -1:], cum[..., -1:] - cum, -jnp.inf))
    chunk_decay = jnp.exp(jnp.where(doc_h[..., -1] == 0, cum[..., -1], -jnp.inf))
    doc_f = doc.astype(jnp.float32)  # small integers, exact in float32
    out, final_state = _chunked_core(
        bool(interpret),
        q_c,
        k_c,
        v_c,
        beta_c[..., None],
        cum[..., None],
        cum[..., None, :],
        doc_f[..., None],
        doc_f[..., None, :],
        from_start[..., None],
        to_end[..., None],
        chunk_decay[..., None, None],
        state0,
    )
    out = inputs.output(jnp.moveaxis(out.reshape(batch, heads, chunks * chunk_size, dv), 1, 2))
    return out, final_state
