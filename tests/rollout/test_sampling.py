"""The processed distribution and the sampler's draws, against numpy written from the definitions,
and against the sort-based mask the sampler used before its threshold search (same distribution)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.rollout.sampling import processed_log_distribution, sample, split_seed


def reference_processed(logits, temperature, top_k, top_p):
    """Temperature, then exactly-k top-k (ties to the lower id), then top-p on the renormalised
    survivors, then renormalise: a float64 loop over tokens."""
    scaled = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    kept = order if top_k <= 0 else order[:top_k]
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    survivors, mass = [], 0.0
    for token, p in zip(kept, probs, strict=True):
        if mass < top_p or not survivors:
            survivors.append(token)
        mass += p
    out = np.full(len(scaled), -np.inf)
    sub = scaled[survivors]
    out[survivors] = sub - (sub.max() + np.log(np.exp(sub - sub.max()).sum()))
    return out


def sorted_keep(scaled, top_k, top_p):
    """The kept set as the sampler computed it before the threshold search: a stable descending
    argsort of the whole vocabulary, exactly-k, then a cumulative sum of the renormalised
    survivors. (The reference the new search must reproduce token for token.)"""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_scaled = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)
    keep_sorted = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    sorted_probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_scaled, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = keep_sorted & ((top_p[:, None] >= 1.0) | (mass_before < top_p[:, None]))
    keep_sorted = keep_sorted.at[:, 0].set(True)
    rows = jnp.arange(scaled.shape[0])[:, None]
    return jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)


_processed = jax.jit(processed_log_distribution)
_sample = jax.jit(sample)

CASES = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 3, 1.0),
    (1.3, 0, 0.8),
    (0.5, 5, 0.6),
    (1.0, 1, 1.0),
    (2.0, 0, 0.05),
]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_processed_distribution_matches_the_definition(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(3, 11)).astype(np.float32) * 2
    logits[1, 4] = logits[1, 7]  # a tie that top-k must break towards the lower id
    got = np.asarray(
        _processed(jnp.asarray(logits), jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
    )
    for row in range(3):
        want = reference_processed(logits[row], temperature, top_k, top_p)
        assert np.array_equal(np.isfinite(got[row]), np.isfinite(want)), (row, got[row], want)
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[row][finite], want[finite], rtol=0, atol=2e-6)


def _draw(logits, temperature, top_k, top_p, seeds, indices=None):
    rows = len(seeds)
    logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (rows, len(logits)))
    halves = np.asarray([split_seed(s) for s in seeds], np.uint32)
    full = lambda v, dt: jnp.full((rows,), v, dt)
    indices = np.zeros(rows, np.int32) if indices is None else np.asarray(indices, np.int32)
    return _sample(
        logits,
        full(temperature, jnp.float32),
        full(top_k, jnp.int32),
        full(top_p, jnp.float32),
        jnp.asarray(halves[:, 0]),
        jnp.asarray(halves[:, 1]),
        jnp.asarray(indices),
    )


def test_draws_follow_the_processed_distribution():
    logits = np.array([2.0, 1.5, 1.0, 0.2, -1.0, 0.9], np.float32)
    temperature, top_k, top_p = 0.8, 4, 0.9
    tokens, logprobs, raw = _draw(logits, temperature, top_k, top_p, seeds=range(20_000))
    want = np.exp(reference_processed(logits, temperature, top_k, top_p))
    freq = np.bincount(np.asarray(tokens), minlength=len(logits)) / 20_000
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))
    np.testing.assert_allclose(freq, want, atol=0.015)
    np.testing.assert_allclose(np.exp(np.asarray(logprobs)), want[np.asarray(tokens)], rtol=1e-5)
    raw_want = logits - np.log(np.exp(logits).sum())
    np.testing.assert_allclose(np.asarray(raw), raw_want[np.asarray(tokens)], rtol=1e-5)


def test_greedy_takes_the_argmax_with_processed_logprob_zero():
    logits = np.array([0.1, 3.0, 3.0, -2.0], np.float32)
    tokens, logprobs, raw = _draw(logits, 0.0, 0, 1.0, seeds=[1, 2, 3])
    assert np.asarray(tokens).tolist() == [1, 1, 1]  # ties go to the lower id
    assert np.asarray(logprobs).tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_allclose(np.asarray(raw), logits[1] - np.log(np.exp(logits).sum()), rtol=1e-6)


def test_a_greedy_row_gets_the_same_result_beside_sampled_rows_as_in_an_all_greedy_batch():
    # An all-greedy batch takes a shorter path (no noise, no processed distribution); the rows
    # must not be able to tell which path their batch took.
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(4, 64)).astype(np.float32)
    halves = np.asarray([split_seed(s) for s in (3, 4, 5, 6)], np.uint32)
    temperature = np.array([0.0, 0.7, 0.0, 1.0], np.float32)

    def draw(rows, temperatures):
        n = len(rows)
        out = _sample(
            jnp.asarray(logits[rows]),
            jnp.asarray(temperatures),
            jnp.full(n, 5, jnp.int32),
            jnp.full(n, 0.9),
            jnp.asarray(halves[rows, 0]),
            jnp.asarray(halves[rows, 1]),
            jnp.full(n, 2, jnp.int32),
        )
        return [np.asarray(x) for x in out]

    mixed = draw([0, 1, 2, 3], temperature)
    greedy = draw([0, 2], temperature[[0, 2]])
    for position, row in enumerate([0, 2]):
        for a, b in zip(greedy, mixed, strict=True):
            assert a[position] == b[row]
    assert greedy[0].tolist() == np.argmax(logits[[0, 2]], axis=-1).tolist()
    assert greedy[1].tolist() == [0.0, 0.0]


def test_a_row_draw_depends_only_on_its_seed_index_and_logits():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 64)).astype(np.float32)
    halves = np.asarray([split_seed(s) for s in (5, 6, 7, 2**40 + 5)], np.uint32)
    args = lambda rows: (
        jnp.asarray(logits[rows]),
        jnp.ones(len(rows)),
        jnp.zeros(len(rows), jnp.int32),
        jnp.ones(len(rows)),
        jnp.asarray(halves[rows, 0]),
        jnp.asarray(halves[rows, 1]),
        jnp.full(len(rows), 9, jnp.int32),
    )
    together = [np.asarray(x) for x in _sample(*args([0, 1, 2, 3]))]
    for row in range(4):
        alone = [np.asarray(x) for x in _sample(*args([row]))]
        for a, b in zip(alone, together, strict=True):
            assert a[0] == b[row]


def test_the_seed_high_half_and_the_token_index_change_the_draw():
    logits = np.zeros(64, np.float32)  # uniform: draws are pure noise
    draws = lambda seed, first_index: np.asarray(
        _draw(logits, 1.0, 0, 1.0, [seed] * 32, indices=np.arange(first_index, first_index + 32))[0]
    )
    base = draws(5, 0)
    assert np.array_equal(base, draws(5, 0))
    assert (base != draws(2**40 + 5, 0)).sum() > 16
    assert (base[1:] != draws(5, 1)[:-1]).sum() == 0  # the index, not the call, picks the key
    assert (base != draws(6, 0)).sum() > 16


def test_seed_must_be_a_64_bit_non_negative_int():
    assert split_seed(2**40 + 3) == (3, 2**8)
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            split_seed(bad)


def test_without_processing_the_processed_distribution_is_the_raw_one():
    # peaked logits: a float32 cumulative sum reaches 1.0 long before the tail, which top_p = 1
    # must not cut
    logits = np.random.default_rng(1).normal(size=(2, 2048)).astype(np.float32) * 30
    got = np.asarray(_processed(jnp.asarray(logits), jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0)))
    np.testing.assert_array_equal(got, np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1)))


@pytest.mark.parametrize("vocab", [11, 2048, 50_000])
def test_threshold_search_keeps_exactly_what_the_sort_kept(vocab):
    """Many rows of every kind (flat and peaked logits, duplicated values, exact zeros and -0.0,
    k above the vocabulary, tiny and large top_p): the kept sets are identical token for token,
    so the processed distributions are bit-identical."""
    rng = np.random.default_rng(vocab)
    rows = 48
    scale = rng.choice([0.1, 1.0, 5.0, 40.0], size=(rows, 1))
    logits = (rng.normal(size=(rows, vocab)) * scale).astype(np.float32)
    logits[::3, : vocab // 3] = np.round(logits[::3, : vocab // 3])  # many exact ties
    logits[1::4, :5] = logits[1::4, 5:10]  # ties between the best tokens
    logits[2, :4] = [0.0, -0.0, 0.0, -0.0]
    top_k = rng.choice([0, 0, 1, 2, 5, 40, vocab, vocab + 7], size=rows).astype(np.int32)
    top_p = rng.choice([1.0, 1.0, 0.999, 0.9, 0.5, 0.05, 1e-6], size=rows).astype(np.float32)
    temperature = rng.choice([1.0, 0.7, 1.3], size=rows).astype(np.float32)
    scaled = jnp.asarray(logits) / jnp.asarray(temperature)[:, None]
    want = np.asarray(jax.jit(sorted_keep)(scaled, jnp.asarray(top_k), jnp.asarray(top_p)))
    got = np.isfinite(
        np.asarray(_processed(jnp.asarray(logits), temperature, jnp.asarray(top_k), jnp.asarray(top_p)))
    )
    differing = np.flatnonzero((got != want).any(axis=-1))
    assert differing.size == 0, [(int(r), int(top_k[r]), float(top_p[r])) for r in differing]
    reference = jax.nn.log_softmax(jnp.where(want, scaled, -jnp.inf), axis=-1)
    got_values = _processed(jnp.asarray(logits), temperature, jnp.asarray(top_k), jnp.asarray(top_p))
    np.testing.assert_array_equal(np.asarray(got_values), np.asarray(reference))
