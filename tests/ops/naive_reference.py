"""Float64 per-token references for the ops tests, written straight from the math with numpy.

They share no code with ``t1jax.ops``: a loop over rows, heads and time, the packed-sequence rules
spelled out case by case.
"""

import numpy as np


def _is_document_start(segment_ids, row, t):
    if segment_ids is None or t == 0:
        return False
    current, previous = segment_ids[row, t], segment_ids[row, t - 1]
    return current != 0 and current != previous


def _is_padding(segment_ids, row, t):
    return segment_ids is not None and segment_ids[row, t] == 0


def naive_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, segment_ids=None):
    """S <- exp(g_t) S; S <- S + k_t beta_t (v_t - S^T k_t)^T; o_t = S^T q_t, per row and head."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    segment_ids = None if segment_ids is None else np.asarray(segment_ids)
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    out = np.zeros((batch, length, heads, dv))
    final = np.zeros((batch, heads, dk, dv))
    for b in range(batch):
        for h in range(heads):
            state = np.zeros((dk, dv)) if initial_state is None else np.array(initial_state[b, h], np.float64)
            for t in range(length):
                if _is_padding(segment_ids, b, t):
                    continue
                if _is_document_start(segment_ids, b, t):
                    state = np.zeros((dk, dv))
                state = np.exp(g[b, t, h]) * state
                error = v[b, t, h] - state.T @ k[b, t, h]
                state = state + np.outer(k[b, t, h], beta[b, t, h] * error)
                out[b, t, h] = state.T @ q[b, t, h]
            final[b, h] = state
    return out, final


def naive_causal_conv1d(x, weight, *, initial_state=None, segment_ids=None):
    """y[t] = sum_j w[:, j] x[t - K + 1 + j] over inputs of t's own run (history = initial_state)."""
    x = np.asarray(x, np.float64)
    weight = np.asarray(weight, np.float64)
    batch, length, channels = x.shape
    kernel = weight.shape[1]
    y = np.zeros_like(x)
    final = np.zeros((batch, kernel - 1, channels))
    for b in range(batch):
        # The conv cache, updated token by token exactly as a decoder would.
        cache = (
            np.zeros((kernel - 1, channels))
            if initial_state is None
            else np.array(initial_state[b], np.float64)
        )
        for t in range(length):
            if _is_padding(segment_ids, b, t):
                continue
            if _is_document_start(segment_ids, b, t):
                cache = np.zeros((kernel - 1, channels))
            window = np.concatenate([cache, x[b, t][None]], axis=0)
            y[b, t] = (window * weight.T).sum(axis=0)
            cache = window[1:]
        final[b] = cache
    return y, final
