"""Log-probabilities of target tokens from hidden states and the LM head, in sequence chunks.

``chunked_target_logprobs(hidden, kernel, target_ids, num_chunks=n)`` returns
``log_softmax(hidden @ kernel)[..., target]`` (float32 [B, T]) without a [B, T, V] logit tensor:
the positions are split into n chunks and each chunk's logits [B, T / n, V] are formed, reduced
to (target logit, log-sum-exp) and dropped; a ``jax.custom_vjp`` recomputes them chunk by chunk
in the backward pass (d logits = g (onehot - softmax), never stored whole), accumulating the head's
gradient in float32.

Chunks are strided: chunk c holds positions c, c + n, c + 2n, ... . A sequence sharded in
contiguous blocks (context parallelism) then keeps every chunk evenly split over its shards, so
no chunk needs a resharding, as long as n divides each shard's length (``num_chunks_for`` picks a
power of two for that reason). The vocabulary may be sharded (tensor parallelism): the target
logit is a masked sum over the vocabulary, not a gather, so both reductions are partial sums
the partitioner completes with one all-reduce each; ``constrain_logits`` / ``constrain_kernel``
let the caller pin the chunk's logits and the head gradient to their shardings.

Numerics: logits are the same dot products as the unchunked head (compute-dtype operands, float32
accumulation); every reduction runs over the full vocabulary of a row, so values equal the
unchunked path's and gradients differ only by the summation order of the head gradient over
chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["chunked_target_logprobs", "num_chunks_for"]

MAX_CHUNKS = 64


def num_chunks_for(length: int, chunk: int) -> int:
    """The number of strided chunks for rows of ``length`` positions and chunks of about ``chunk``:
    the largest power of two n <= min(length / chunk, MAX_CHUNKS) dividing ``length`` (>= 1).
    Powers of two up to 64 divide every context shard of a t1jax row (rows split into shards of
    whole 64-token chunks)."""
    n = 1
    while 2 * n <= min(length // max(chunk, 1), MAX_CHUNKS) and length % (2 * n) == 0:
        n *= 2
    return n


def _identity(x):
    return x


def _to_chunks(x, n):
    """[B, T, ...] -> [n, B, T / n, ...], chunk c holding positions c, c + n, ..."""
    batch, length = x.shape[:2]
    return jnp.moveaxis(x.reshape((batch, length // n, n) + x.shape[2:]), 2, 0)


def _from_chunks(x):
    """[n, B, T / n, ...] -> [B, T, ...]."""
    n, batch, per = x.shape[:3]
    return jnp.moveaxis(x, 0, 2).reshape((batch, per * n) + x.shape[3:])


def _chunk_logits(h, kernel, constrain_logits, temperature):
    logits = jnp.einsum("btd,dv->btv", h, kernel, preferred_element_type=jnp.float32)
    if temperature != 1.0:  # the default program stays exactly the untempered one
        logits = logits / temperature
    return constrain_logits(logits)


def _target_mask(logits, targets):
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return vocab == targets[..., None].astype(jnp.int32)


def chunked_target_logprobs(
    hidden: jax.Array,
    kernel: jax.Array,
    target_ids: jax.Array,
    *,
    num_chunks: int,
    constrain_logits: Callable | None = None,
    constrain_kernel: Callable | None = None,
    temperature: float = 1.0,
) -> jax.Array:
    """hidden [B, T, H] (compute dtype), kernel [H, V] (same dtype), target_ids int [B, T] ->
    float32 [B, T]. T must be a multiple of ``num_chunks``. A target id outside [0, V) yields
    -log-sum-exp (its logit counts as 0): give padding positions any id and mask them later.

    ``temperature`` (a Python float > 0): log-probabilities of softmax(logits / temperature), the
    float32 logits divided as the sampler divides them (``t1jax.rollout.sampling``), so a policy
    sampled at that temperature is scored by the same numbers."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.ndim != 3 or kernel.ndim != 2 or hidden.shape[-1] != kernel.shape[0]:
        raise ValueError(f"hidden [B, T, H] and kernel [H, V] expected, got {hidden.shape}, {kernel.shape}")
    if target_ids.shape != hidden.shape[:2]:
        raise ValueError(f"target_ids must be {hidden.shape[:2]}, got {target_ids.shape}")
    if num_chunks < 1 or hidden.shape[1] % num_chunks:
        raise ValueError(f"num_chunks {num_chunks} must divide the sequence length {hidden.shape[1]}")
    return _logprobs(
        hidden,
        kernel,
        target_ids.astype(jnp.int32),
        num_chunks,
        constrain_logits or _identity,
        constrain_kernel or _identity,
        float(temperature),
    )


def _forward(hidden, kernel, target_ids, num_chunks, constrain_logits, temperature):
    def chunk(_, xs):
        h, targets = xs
        logits = _chunk_logits(h, kernel, constrain_logits, temperature)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.sum(jnp.where(_target_mask(logits, targets), logits, 0.0), axis=-1)
        return None, (target - lse, lse)

    _, (logprobs, lse) = lax.scan(
        chunk, None, (_to_chunks(hidden, num_chunks), _to_chunks(target_ids, num_chunks))
    )
    return _from_chunks(logprobs), _from_chunks(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _logprobs(hidden, kernel, target_ids, num_chunks, constrain_logits, constrain_kernel, temperature):
    return _forward(hidden, kernel, target_ids, num_chunks, constrain_logits, temperature)[0]


def _logprobs_fwd(hidden, kernel, target_ids, num_chunks, constrain_logits, constrain_kernel, temperature):
    logprobs, lse = _forward(hidden, kernel, target_ids, num_chunks, constrain_logits, temperature)
    return logprobs, (hidden, kernel, target_ids, lse)


def _logprobs_bwd(num_chunks, constrain_logits, constrain_kernel, temperature, residuals, grad):
    hidden, kernel, target_ids, lse = residuals
    compute = hidden.dtype

    def chunk(d_kernel, xs):
        h, targets, lse_c, g = xs
        logits = _chunk_logits(h, kernel, constrain_logits, temperature)
        probs = jnp.exp(logits - lse_c[..., None])
        d_logits = g[..., None] * (_target_mask(logits, targets).astype(jnp.float32) - probs)
        if temperature != 1.0:  # d(logits / t) = d(logits) / t
            d_logits = d_logits / temperature
        d_logits = constrain_logits(d_logits).astype(compute)
        d_h = jnp.einsum("btv,dv->btd", d_logits, kernel, preferred_element_type=jnp.float32)
        d_kernel = d_kernel + jnp.einsum("btd,btv->dv", h, d_logits, preferred_element_type=jnp.float32)
        return constrain_kernel(d_kernel), d_h.astype(compute)

    xs = tuple(_to_chunks(x, num_chunks) for x in (hidden, target_ids, lse, grad.astype(jnp.float32)))
    start = constrain_kernel(jnp.zeros(kernel.shape, jnp.float32))
    d_kernel, d_hidden = lax.scan(chunk, start, xs)
    return _from_chunks(d_hidden), d_kernel.astype(kernel.dtype), None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)
