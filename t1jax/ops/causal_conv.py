"""Depthwise causal 1-D convolution over time (Gated DeltaNet's short conv), full-sequence and one-step.

Owns the packed-sequence semantics of the conv window, matching ``gated_delta_rule``:
  * ``y[t, c] = sum_j weight[c, j] * x[t - (K - 1) + j, c]`` (PyTorch ``Conv1d`` cross-correlation
    with K - 1 left padding, no bias, no activation), summed in the fixed order j = 0 .. K-1 so the
    full, one-step and context-parallel forms produce the same bits;
  * the window only sees inputs of the same *run* as t (a run is a maximal stretch of equal segment
    ids), so a document start sees zeros instead of the previous document and padding (id 0) never
    enters a real token's window; padding positions output exactly zero;
  * the K - 1 inputs before t = 0 come from ``initial_state`` and belong to the run of position 0;
  * ``final_state`` holds the last K - 1 inputs of the row's last real run (zeros where that run is
    shorter), i.e. the conv cache after the last real token; an all-padding row keeps its
    ``initial_state``.

``conv_with_history`` is the shared core: the context-parallel path calls it with the previous
shard's K - 1 inputs (the halo) as history.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["causal_conv1d", "causal_conv1d_step", "conv_with_history"]


def _check(x, weight, initial_state, segment_ids):
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, C], got shape {x.shape}")
    if weight.ndim != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, K] with C = {x.shape[-1]}, got {weight.shape}")
    kernel = weight.shape[1]
    expected_state = (x.shape[0], kernel - 1, x.shape[-1])
    if initial_state is not None and initial_state.shape != expected_state:
        raise ValueError(f"initial_state must be [B, K-1, C] = {expected_state}, got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != x.shape[:2]:
        raise ValueError(f"segment_ids must be [B, T] = {x.shape[:2]}, got {segment_ids.shape}")


def _weighted_window_sum(taps, weight):
    """sum_j taps[j] * weight[:, j] in the order j = 0 .. K-1 (the one summation order used everywhere)."""
    total = taps[0] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        total = total + taps[j] * weight[:, j]
    return total


def conv_with_history(x, weight, history, history_segment_ids, segment_ids):
    """Causal conv of ``x`` [B, T, C] given the K - 1 inputs before it.

    ``history`` [B, K-1, C] and ``history_segment_ids`` [B, K-1] are those inputs and their ids;
    ``segment_ids`` [B, T] int32 (0 = padding). Returns (y [B, T, C] float32, last_window
    [B, K-1, C], has_real [B]): ``last_window`` is the conv cache after the last real token of this
    stretch (or ``history`` masked to its last run if there is none).
    """
    batch, length, _ = x.shape
    kernel = weight.shape[1]
    weight = weight.astype(jnp.float32)
    valid = segment_ids != 0
    x = jnp.where(valid[..., None], x.astype(jnp.float32), 0.0)
    ext_x = jnp.concatenate([history.astype(jnp.float32), x], axis=1)  # [B, K-1+T, C]
    ext_ids = jnp.concatenate([history_segment_ids, segment_ids], axis=1).astype(jnp.int32)
    run_id = jnp.cumsum(
        jnp.concatenate([jnp.zeros((batch, 1), bool), ext_ids[:, 1:] != ext_ids[:, :-1]], axis=1), axis=1
    )

    own_run = run_id[:, kernel - 1 :]
    taps = [
        jnp.where((run_id[:, j : j + length] == own_run)[..., None], ext_x[:, j : j + length], 0.0)
        for j in range(kernel)
    ]
    y = jnp.where(valid[..., None], _weighted_window_sum(taps, weight), 0.0)

    # The cache after the last real token: ext positions last-(K-2) .. last, kept if in its run.
    positions = jnp.arange(length)
    last_real = jnp.max(jnp.where(valid, positions, -1), axis=1) + (kernel - 1)  # K-2 if none
    window = last_real[:, None] + jnp.arange(-(kernel - 2), 1)  # [B, K-1]
    window_x = jnp.take_along_axis(ext_x, window[..., None], axis=1)
    window_run = jnp.take_along_axis(run_id, window, axis=1)
    last_run = jnp.take_along_axis(run_id, last_real[:, None], axis=1)
    last_window = jnp.where((window_run == last_run)[..., None], window_x, 0.0)
    return y, last_window, jnp.any(valid, axis=1)


def causal_conv1d(x, weight, *, initial_state=None, segment_ids=None):
    """Depthwise causal conv, no bias, no activation. x: [B, T, C]; weight: [C, K] (kernel K);
    initial_state: [B, K-1, C] (the K-1 inputs before t=0; zeros if None). At a document start
    (segment id change) the window sees zeros instead of the previous document; padding (id 0)
    positions output zeros and do not enter later windows' history of a new segment.
    Returns (y [B, T, C] float32, final_state [B, K-1, C] float32) where final_state holds the last
    K-1 real inputs of each row (with zeros where the row's current document is shorter than K-1)."""
    _check(x, weight, initial_state, segment_ids)
    batch, length, channels = x.shape
    kernel = weight.shape[1]
    if initial_state is None:
        initial_state = jnp.zeros((batch, kernel - 1, channels), jnp.float32)
    if segment_ids is None:
        segment_ids = jnp.ones((batch, length), jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    history_ids = jnp.broadcast_to(segment_ids[:, :1], (batch, kernel - 1))
    if kernel == 1:
        y = x.astype(jnp.float32) * weight[:, 0].astype(jnp.float32)
        return jnp.where((segment_ids != 0)[..., None], y, 0.0), initial_state.astype(jnp.float32)
    y, final_state, _ = conv_with_history(x, weight, initial_state, history_ids, segment_ids)
    return y, final_state


def causal_conv1d_step(x, weight, state):
    """x: [B, C] one token; state [B, K-1, C] -> (y [B, C] float32, new_state [B, K-1, C] float32)."""
    if x.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"x must be [B, C] with C = weight.shape[0] = {weight.shape[0]}, got {x.shape}")
    expected_state = (x.shape[0], weight.shape[1] - 1, x.shape[1])
    if state.shape != expected_state:
        raise ValueError(f"state must be [B, K-1, C] = {expected_state}, got {state.shape}")
    window = jnp.concatenate([state.astype(jnp.float32), x.astype(jnp.float32)[:, None]], axis=1)
    y = _weighted_window_sum([window[:, j] for j in range(weight.shape[1])], weight.astype(jnp.float32))
    return y, window[:, 1:]
