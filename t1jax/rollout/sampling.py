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
    # Sorting the vocabulary is the expensive part (on CPU it costs more than a tiny model's
    # decode step): skip it when no row filters. Either branch only builds the mask; the
    # distribution below is the same computation for every row, so a row's result does not
    # depend on whether another row in the batch filters.
    keep = jax.lax.cond(
        jnp.any((top_k > 0) | (top_p < 1.0)),
        _kept_tokens,
        lambda scaled, top_k, top_p: jnp.ones(scaled.shape, bool),
        scaled,
        top_k,
        top_p,
    )
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def _kept_tokens(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """bool [..., V]: the tokens that survive top-k then top-p (see the module docstring)."""
    vocab = scaled.shape[-1]
    flat = scaled.reshape(-1, vocab)
    # Stable descending order: equal logits keep ascending token ids.
    order = jnp.argsort(-flat, axis=-1, stable=True)
    sorted_scaled = jnp.take_along_axis(flat, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)
    top_k = top_k.reshape(-1, 1)
    keep_sorted = (top_k <= 0) | (rank < top_k)
    sorted_probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_scaled, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    top_p = top_p.reshape(-1, 1)
    # top_p >= 1 disables the filter outright: a float32 cumsum can reach 1.0 before the tail.
    keep_sorted = keep_sorted & ((top_p >= 1.0) | (mass_before < top_p))
    keep_sorted = keep_sorted.at[:, 0].set(True)
    rows = jnp.arange(flat.shape[0])[:, None]
    keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
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
    processed = processed_log_distribution(logits, temperature, top_k, top_p)
    keys = jax.vmap(token_key)(seed_low, seed_high, index)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
    drawn = jnp.argmax(processed + noise, axis=-1).astype(jnp.int32)
    greedy = jnp.asarray(temperature) <= 0
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)
    pick = lambda logp: jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    processed_logprob = jnp.where(greedy, 0.0, pick(processed))
    return token, processed_logprob, pick(raw)
