"""Gated full attention of Qwen3.5 (the layers whose `layer_types` entry is "full_attention").

Owns: partial rotary embeddings, the packed-sequence attention mask, the dense attention core
(`attend`, the reference), the choice of core by `ExecutionConfig.attention` (`attention_core`:
dense, blockwise `t1jax.ops.flash_attention`, or Pallas splash on TPU; a context-parallel variant
replaces it through the forward hooks), the one-token decode attention over a cache
(`decode_attention`), and the `GatedAttention` module with its full forward and its cached forms
(`extend` for chunked prefill, `decode` for one token per row).

Math (transformers' `Qwen3_5MoeAttention`): `q_proj` emits, per head, [query | gate] (2*head_dim);
per-head zero-centred RMSNorm on q and k; rotate-half RoPE on the first `rotary_dim` dims only;
GQA (query head h reads kv head h // (heads / kv_heads)); softmax(q k^T * head_dim^-0.5) in
float32; output `attn * sigmoid(gate)` then `o_proj`.

Parameter layout ([in, out] kernels, heads kept as their own axis):
  q_proj [hidden, heads, 2*head_dim]  (embed, q_heads, head_dim)
  k_proj, v_proj [hidden, kv_heads, head_dim]  (embed, kv_heads, head_dim)
  o_proj [heads, head_dim, hidden]  (q_heads, head_dim, embed)
  q_norm, k_norm [head_dim]

Invariants: a query attends only to keys of its own document (same non-zero segment id) at or
before its own index; a query on padding (segment 0) sees nothing and yields finite garbage that
no valid position ever reads. `decode_attention` reads only the cache chunks up to the farthest
live row, and a row's result does not depend on how many chunks were read (so neither on the
other rows' lengths).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from t1jax.model.axes import (
    ACT_BATCH,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_LENGTH,
    EMBED,
    HEAD_DIM,
    KV_HEADS,
    Q_HEADS,
    constrain,
    per_shard,
    resolve_spec,
    rules_in_scope,
)
from t1jax.model.config import Qwen35MoeConfig
from t1jax.model.execution import DEFAULT_EXECUTION, ExecutionConfig
from t1jax.model.hooks import active_hooks
from t1jax.model.norms import RMSNorm
from t1jax.model.params import make_param, normal
from t1jax.ops.flash_attention import blockwise_attention

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
DECODE_KV_CHUNK = 256  # cache slots per step of the decode attention's loop


def rotary_tables(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + (rotary_dim,), float32, in rotate-half layout."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_partial_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first cos.shape[-1] dims of x [B, T, heads, D]; cos/sin are [B, T, rot]."""
    rotary_dim = cos.shape[-1]
    rotated, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    first, second = jnp.split(rotated, 2, axis=-1)
    rotate_half = jnp.concatenate([-second, first], axis=-1)
    return jnp.concatenate([rotated * cos + rotate_half * sin, passthrough], axis=-1)


def packed_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """bool [B, T, T]: query i may read key j iff j <= i and both lie in the same document
    (equal, non-zero segment ids)."""
    seq_len = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    real_key = (segment_ids != 0)[:, None, :]
    return causal[None] & same_doc & real_key


def attend(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    query [B, T, heads, D], key/value [B, S, kv_heads, D], mask bool [B, T, S] -> [B, T, heads, D].
    Scores and softmax in float32; query head h reads kv head h // (heads // kv_heads).
    """
    batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    groups = num_heads // num_kv_heads
    grouped = query.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, key, preferred_element_type=jnp.float32) * (
        head_dim**-0.5
    )
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, value)
    return out.reshape(batch, q_len, num_heads, head_dim)


def _splash_per_shard(query, key, value, segment_ids, execution: ExecutionConfig) -> jax.Array:
    """The splash kernel on each device's rows (and heads, where query and kv heads split alike,
    so each shard's query groups meet their own kv heads): a Mosaic kernel is not partitioned
    automatically (`per_shard`)."""
    from t1jax.ops.splash_attention import splash_attention

    q_heads, kv_heads = ACT_HEADS, ACT_KV_HEADS
    mesh, rules = jax.sharding.get_abstract_mesh(), rules_in_scope()
    if not mesh.empty and rules:
        q_spec = resolve_spec((None, None, q_heads, None), query.shape, mesh, rules)
        kv_spec = resolve_spec((None, None, kv_heads, None), key.shape, mesh, rules)
        if q_spec[2] != kv_spec[2]:
            q_heads = kv_heads = None
    kernel = functools.partial(
        splash_attention,
        block_q=execution.attention_block_q,
        block_k=execution.attention_block_k,
        interpret=execution.pallas_interpret,
    )
    q_names, kv_names = (ACT_BATCH, None, q_heads, None), (ACT_BATCH, None, kv_heads, None)
    return per_shard(
        kernel, (q_names, kv_names, kv_names, (ACT_BATCH, None)), (q_names,), query, key, value, segment_ids
    )


def attention_core(
    query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array, execution: ExecutionConfig
) -> jax.Array:
    """`attend(query, key, value, packed_causal_mask(segment_ids))` by the kernel
    `execution.attention` names (rows that may read no key, i.e. padding, are unspecified)."""
    if execution.attention == "dense":
        return attend(query, key, value, packed_causal_mask(segment_ids))
    if execution.attention == "splash":
        return _splash_per_shard(query, key, value, segment_ids, execution)
    return blockwise_attention(
        query,
        key,
        value,
        q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids,
        block_q=execution.attention_block_q,
        block_k=execution.attention_block_k,
    )


def decode_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    positions: jax.Array,
    live: jax.Array,
    *,
    chunk: int = DECODE_KV_CHUNK,
) -> jax.Array:
    """One query per row over its cache slots [0, positions[b]] (grouped-query, float32 softmax).

    query [B, heads, D]; key_cache/value_cache [B, S, kv_heads, D] (the query's own key already
    written at slot positions[b]); positions int32 [B]; live bool [B]: the rows whose positions
    bound the work. Returns [B, heads, D] in the query's dtype.

    The cache is read `chunk` slots at a time in a loop whose trip count is data-dependent,
    ceil((farthest live position + 1) / chunk), so the cost follows the longest live row rather
    than S, and one compiled program serves every length. The softmax is online (running max,
    rescaled sums, float32). A chunk wholly past a row's position changes nothing for that row:
    its max is unchanged (rescale exp(0) = 1) and its weights are exact zeros, so a row's result
    is bit-identical whatever the other rows make the loop read.
    """
    batch, num_heads, head_dim = query.shape
    max_len, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    groups = num_heads // num_kv_heads
    chunk = min(chunk, max_len)
    grouped = query.reshape(batch, num_kv_heads, groups, head_dim)
    farthest = jnp.max(jnp.where(live, positions, 0))
    num_chunks = jnp.minimum(farthest // chunk + 1, -(-max_len // chunk))
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def read_chunk(index, carry):
        best, total, weighted = carry
        first = index * chunk
        start = jnp.minimum(first, max_len - chunk)  # the last chunk may overlap the one before
        keys = jax.lax.dynamic_slice_in_dim(key_cache, start, chunk, 1).astype(query.dtype)
        values = jax.lax.dynamic_slice_in_dim(value_cache, start, chunk, 1).astype(query.dtype)
        slots = start + offsets
        visible = (slots >= first)[None, :] & (slots[None, :] <= positions[:, None])
        scores = jnp.einsum("bkgd,bskd->bkgs", grouped, keys, preferred_element_type=jnp.float32) * (
            head_dim**-0.5
        )
        scores = jnp.where(visible[:, None, None, :], scores, _MASKED)
        new_best = jnp.maximum(best, scores.max(axis=-1))
        rescale = jnp.exp(best - new_best)
        weights = jnp.exp(scores - new_best[..., None])
        total = total * rescale + weights.sum(axis=-1)
        update = jnp.einsum(
            "bkgs,bskd->bkgd", weights.astype(values.dtype), values, preferred_element_type=jnp.float32
        )
        return new_best, total, weighted * rescale[..., None] + update

    init = (
        jnp.full((batch, num_kv_heads, groups), -jnp.inf, jnp.float32),
        jnp.zeros((batch, num_kv_heads, groups), jnp.float32),
        jnp.zeros((batch, num_kv_heads, groups, head_dim), jnp.float32),
    )
    _, total, weighted = jax.lax.fori_loop(0, num_chunks, read_chunk, init)
    out = weighted / total[..., None]
    return out.reshape(batch, num_heads, head_dim).astype(query.dtype)


class GatedAttention(nnx.Module):
    def __init__(
        self,
        config: Qwen35MoeConfig,
        *,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        execution: ExecutionConfig = DEFAULT_EXECUTION,
    ):
        self.config = config
        self.dtype = dtype
        self.execution = execution
        hidden, heads, kv_heads, head_dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        init = normal(config.initializer_range)
        self.q_proj = make_param(
            rngs, init, (hidden, heads, 2 * head_dim), param_dtype, (EMBED, Q_HEADS, HEAD_DIM)
        )
        self.k_proj = make_param(
            rngs, init, (hidden, kv_heads, head_dim), param_dtype, (EMBED, KV_HEADS, HEAD_DIM)
        )
        self.v_proj = make_param(
            rngs, init, (hidden, kv_heads, head_dim), param_dtype, (EMBED, KV_HEADS, HEAD_DIM)
        )
        self.o_proj = make_param(
            rngs, init, (heads, head_dim, hidden), param_dtype, (Q_HEADS, HEAD_DIM, EMBED)
        )
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)

    def _project(self, x: jax.Array, positions: jax.Array):
        """x [B, T, hidden] -> rotated query, output gate, rotated key, value (per head)."""
        dtype = self.dtype
        x = x.astype(dtype)
        head_dim = self.config.head_dim
        query_and_gate = jnp.einsum("bth,hnd->btnd", x, self.q_proj[...].astype(dtype))
        query, gate = query_and_gate[..., :head_dim], query_and_gate[..., head_dim:]
        key = jnp.einsum("bth,hnd->btnd", x, self.k_proj[...].astype(dtype))
        value = jnp.einsum("bth,hnd->btnd", x, self.v_proj[...].astype(dtype))
        query = self.q_norm(query)
        key = self.k_norm(key)
        cos, sin = rotary_tables(positions, self.config.rotary_dim, self.config.rope_parameters.rope_theta)
        query = constrain(apply_partial_rotary(query, cos, sin), (ACT_BATCH, ACT_LENGTH, ACT_HEADS, None))
        key = apply_partial_rotary(key, cos, sin)
        return query, gate, key, value

    def _output(self, attn: jax.Array, gate: jax.Array) -> jax.Array:
        dtype = self.dtype
        gated = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dtype)
        return jnp.einsum("btnd,ndh->bth", gated, self.o_proj[...].astype(dtype))

    def __call__(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Full forward over packed rows. x [B, T, hidden]; positions, segment_ids int32 [B, T]."""
        query, gate, key, value = self._project(x, positions)
        attention = active_hooks().attention
        with jax.named_scope("core"):
            if attention is None:
                attn = attention_core(query, key, value, segment_ids, self.execution)
            else:
                attn = attention(query, key, value, segment_ids, execution=self.execution)
        return self._output(attn, gate)

    def extend(
        self,
        x: jax.Array,
        key_cache: jax.Array,
        value_cache: jax.Array,
        *,
        cache_lengths: jax.Array,
        valid_lengths: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Append T new tokens per row (the first valid_lengths[b] of them real) to a KV cache and
        attend over everything cached. One sequence per row; its positions continue the cache.

        key_cache/value_cache [B, S, kv_heads, head_dim]; cache_lengths, valid_lengths int32 [B].
        Returns (output [B, T, hidden], new key_cache, new value_cache). Slots past a row's new
        length are never read, so what the padded tokens would write is dropped instead.
        """
        batch, new_len = x.shape[:2]
        max_len = key_cache.shape[1]
        offsets = jnp.arange(new_len, dtype=jnp.int32)
        positions = cache_lengths[:, None] + offsets[None, :]
        query, gate, key, value = self._project(x, positions)
        is_real = offsets[None, :] < valid_lengths[:, None]
        write_at = jnp.where(is_real, positions, max_len)  # out of bounds -> dropped
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], write_at.shape)
        key_cache = key_cache.at[rows, write_at].set(key.astype(key_cache.dtype), mode="drop")
        value_cache = value_cache.at[rows, write_at].set(value.astype(value_cache.dtype), mode="drop")
        keys, values = key_cache.astype(self.dtype), value_cache.astype(self.dtype)
        if self.execution.attention == "dense":
            slots = jnp.arange(max_len, dtype=jnp.int32)
            mask = slots[None, None, :] <= positions[:, :, None]
            attn = attend(query, keys, values, mask)
        else:
            # Prefill: blockwise over the cache, reading only the key blocks up to each query
            # block's last position (the cost follows the cached length, not max_len).
            attn = blockwise_attention(
                query,
                keys,
                values,
                q_segment_ids=jnp.ones((batch, new_len), jnp.int32),
                kv_segment_ids=jnp.ones((batch, max_len), jnp.int32),
                q_index=positions,
                block_q=self.execution.attention_block_q,
                block_k=self.execution.attention_block_k,
            )
        return self._output(attn, gate), key_cache, value_cache

    def decode(
        self,
        x: jax.Array,
        key_cache: jax.Array,
        value_cache: jax.Array,
        *,
        cache_lengths: jax.Array,
        active: jax.Array,
        kv_chunk: int = DECODE_KV_CHUNK,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One new token per row (x [B, 1, hidden]) at position cache_lengths[b]: write its key and
        value (active rows only; an inactive row's cache is untouched) and attend with
        `decode_attention`. Returns (output [B, 1, hidden], new key_cache, new value_cache)."""
        batch = x.shape[0]
        max_len = key_cache.shape[1]
        query, gate, key, value = self._project(x, cache_lengths[:, None])
        write_at = jnp.where(active, cache_lengths, max_len)  # out of bounds -> dropped
        rows = jnp.arange(batch)
        key_cache = key_cache.at[rows, write_at].set(key[:, 0].astype(key_cache.dtype), mode="drop")
        value_cache = value_cache.at[rows, write_at].set(value[:, 0].astype(value_cache.dtype), mode="drop")
        attn = decode_attention(query[:, 0], key_cache, value_cache, cache_lengths, active, chunk=kv_chunk)
        return self._output(attn[:, None], gate), key_cache, value_cache
