"""Random inputs shaped like Gated DeltaNet's, shared by the ops tests."""

import numpy as np


def random_gdr_inputs(seed, batch, length, heads, dk, dv, *, decay_scale=1.0):
    """q, k L2-normalised (q scaled by dk**-0.5), g = -softplus-like log-decay, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, length, heads, dk)).astype(np.float32)
    k = rng.standard_normal((batch, length, heads, dk)).astype(np.float32)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk**-0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((batch, length, heads, dv)).astype(np.float32)
    g = (-decay_scale * np.log1p(np.exp(rng.standard_normal((batch, length, heads))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((batch, length, heads))))).astype(np.float32)
    return q, k, v, g, beta


def random_state(seed, batch, heads, dk, dv):
    return np.random.default_rng(seed).standard_normal((batch, heads, dk, dv)).astype(np.float32)


def segments_from_lengths(rows, length):
    """rows: per row a list of (segment_id, run_length); the rest of the row is padding (id 0)."""
    ids = np.zeros((len(rows), length), np.int32)
    for row, runs in enumerate(rows):
        position = 0
        for segment_id, run in runs:
            ids[row, position : position + run] = segment_id
            position += run
        assert position <= length
    return ids
