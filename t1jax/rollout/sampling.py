"""Token sampling with per-request parameters and seeds, and the log-probabilities the learner needs.

Owns the one definition of the *processed* distribution (what a token is actually drawn from) so
that the sampler and any trainer-side check compute it identically:

    scaled    = logits / temperature                        (float32)
    top-k     : keep the k highest-ranked tokens (rank by scaled logit, ties broken by lower id;
                exactly k survive; k = 0 keeps all)
    top-p     : over the top-k survivors, renormalised, keep a token iff the probability mass
                ranked strictly before it is < top_p (the smallest prefix reaching top_p; the
                best token always survives); top_p = 1 keeps all
    processed = log_softmax(scaled restricted to the survivors)

`raw` logprobs are `log_softmax(logits)` with no processing at all.

Greedy (`temperature == 0`): the token is argmax(logits) (ties: lowest id); the processed
distribution is a point mass on it, so its processed logprob is exactly 0.0; the raw logprob is
reported as usual.

Invariants: every quantity is computed per row from that row's logits, parameters and key only,
so a row's result never depends on what else is in the batch; a row's key for its i-th generated
token is `token_key(seed, i)`, so a request's sample depends only on (seed, i, its logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_SEED_BITS = 64


def split_seed(seed: int) -> tuple[int, int]:
    """A non-negative 64-bit seed as (low, high) uint32 halves (jax keys take 32 bits at a time)."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= int(seed) < 2**_SEED_BITS:
        raise ValueError(f"seed must lie in [0, 2**{_SEED_BITS}), got {seed}")
    return int(seed) & 0xFFFFFFFF, int(seed) >> 32


def token_key(seed_low: jax.Array, seed_high: jax.Array, index: jax.Array) -> jax.Array:
    """The PRNG key of a request's `index`-th generated token (scalars; traceable)."""
    key = jax.random.key(seed_low.astype(jnp.uint32))
    key = jax.random.fold_in(key, seed_high.astype(jnp.uint32))
    return jax.random.fold_in(key, index.astype(jnp.uint32))


def processed_log_distribution(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """log of the distribution actually sampled from, float32 [..., V]; -inf outside the kept set.

    logits [..., V]; temperature, top_k, top_p broadcast against logits[..., 0]. A temperature
    <= 0 (greedy) is treated as 1 here; the greedy point mass is handled by `sample`.
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    temperature = jnp.where(temperature > 0, temperature, 1.0)[..., None]
    scaled = logits / temperature
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), scaled.shape[:-1])
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), scaled.shape[:-1])
    # The threshold searches cost 64 passes over the vocabulary: skip them when no row filters.
    # Either branch only builds the mask; the distribution below is the same computation for
    # every row, so a row's result does not depend on whether another row in the batch filters.
    keep = jax.lax.cond(
        jnp.any((top_k > 0) | (top_p < 1.0)),
        _kept_tokens,
        lambda scaled, top_k, top_p: jnp.ones(scaled.shape, bool),
        scaled,
        top_k,
        top_p,
    )
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


_KEY_BITS = 32


def _ordered_keys(values: jax.Array) -> jax.Array:
    """uint32 keys whose unsigned order is the float order of `values` (finite float32; -0.0
    and +0.0 get the same key, as they compare equal)."""
    values = jnp.where(values == 0, jnp.float32(0), values)
    bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
    negative = (bits >> (_KEY_BITS - 1)) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << (_KEY_BITS - 1)))


def _largest_key_where(keys: jax.Array, holds) -> jax.Array:
    """Per row, the largest uint32 t with `holds(keys >= t)` true, for a predicate that is
    monotone (true at t = 0 whenever it is true anywhere, false once it fails): a radix descent
    fixing one bit per pass from the top, 32 passes over [R, V], no sort."""

    def fix_bit(step, threshold):
        candidate = threshold | (jnp.uint32(1) << (_KEY_BITS - 1 - step).astype(jnp.uint32))
        return jnp.where(holds(keys >= candidate[:, None]), candidate, threshold)

    return jax.lax.fori_loop(0, _KEY_BITS, fix_bit, jnp.zeros(keys.shape[:1], jnp.uint32))


def _rank_among_equal(at_threshold: jax.Array) -> jax.Array:
    """int32 [R, V]: how many tokens with a lower id are also at the threshold (ties rank by id)."""
    inclusive = jnp.cumsum(at_threshold.astype(jnp.int32), axis=-1)
    return inclusive - at_threshold.astype(jnp.int32)


def _kept_tokens(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """bool [..., V]: the tokens that survive top-k then top-p (see the module docstring).

    Both filters keep a prefix of the ranking (scaled logit descending, ties by lower id), so
    each is a threshold on the logit plus a count among the tokens tied at it; the thresholds
    are found by radix descent over order-preserving integer keys instead of sorting the
    vocabulary. Top-k: the k-th largest key, exactly k survivors. Top-p: the largest key at
    which the mass of the tokens at or above it still reaches top_p (the token that completes
    the smallest prefix reaching top_p); a tied token there survives iff the mass ranked
    strictly before it is < top_p. Masses are float32 sums over the kept set, as in the
    definition; only their summation order differs from a sorted cumulative sum."""
    vocab = scaled.shape[-1]
    flat = scaled.reshape(-1, vocab)
    keys = _ordered_keys(flat)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).reshape(-1)
    kth = _largest_key_where(keys, lambda above: jnp.sum(above, axis=-1) >= k)[:, None]
    above_k = keys > kth
    at_k = keys == kth
    room = k[:, None] - jnp.sum(above_k, axis=-1, keepdims=True)
    keep = above_k | (at_k & (_rank_among_equal(at_k) < room))

    probs = jax.nn.softmax(jnp.where(keep, flat, -jnp.inf), axis=-1)
    top_p = top_p.reshape(-1)
    mass_of = lambda mask: jnp.sum(jnp.where(mask, probs, 0.0), axis=-1)
    last = _largest_key_where(keys, lambda above: mass_of(above) >= top_p)[:, None]
    at_last = keep & (keys == last)
    tie_prob = jnp.max(jnp.where(at_last, probs, 0.0), axis=-1, keepdims=True)
    mass_before = mass_of(keep & (keys > last))[:, None] + _rank_among_equal(at_last) * tie_prob
    in_nucleus = (keys > last) | (at_last & (mass_before < top_p[:, None]))
    # top_p >= 1 disables the filter outright: a float32 sum can reach 1.0 before the tail.
    keep = keep & ((top_p[:, None] >= 1.0) | in_nucleus)
    return keep.reshape(scaled.shape)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed_low: jax.Array,
    seed_high: jax.Array,
    index: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row. logits float32 [B, V]; the rest [B].

    Returns (token int32 [B], processed logprob float32 [B], raw logprob float32 [B]).
    Sampling is Gumbel-max over the processed log-distribution with the row's own key.
    """
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.broadcast_to(jnp.asarray(temperature) <= 0, logits.shape[:1])
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    pick = lambda logp, token: jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]

    def drawn(logits):
        processed = processed_log_distribution(logits, temperature, top_k, top_p)
        keys = jax.vmap(token_key)(seed_low, seed_high, index)
        noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        token = jnp.where(greedy, best, jnp.argmax(processed + noise, axis=-1).astype(jnp.int32))
        return token, jnp.where(greedy, 0.0, pick(processed, token))

    # An all-greedy batch (a greedy evaluation) skips the noise and the processed distribution:
    # ~30% of a greedy decode step on CPU (the demo's model, batch 16). Either branch gives every
    # row the same result, so a row's token still does not depend on the other rows (as in
    # `processed_log_distribution`).
    token, processed_logprob = jax.lax.cond(
        jnp.all(greedy), lambda logits: (best, jnp.zeros(logits.shape[:1], jnp.float32)), drawn, logits
    )
    return token, processed_logprob, pick(raw, token)
