"""The Qwen3.5-MoE decoder: backbone, causal LM, and their cached (sampler) forms.

Owns the decoder layer (pre-norm: `h += mixer(input_layernorm(h)); h += moe(post_attention_layernorm(h))`),
the backbone `Qwen35MoeModel` (embedding, layers, final norm), the causal LM
`Qwen35MoeForCausalLM` (backbone + untied `lm_head`), and the three calling forms:

- `model(input_ids, segment_ids=None, positions=None, routing_replay=None)`: the training forward
  over packed rows. `segment_ids` int32 [B, T] (0 = padding, >= 1 = document id; documents are
  contiguous); `positions` default to each token's index within its document. With
  `routing_replay` int32 [B, T, L, k] every MoE layer uses the given experts (router mode
  "replay"), otherwise it picks the top-k of its live scores ("free"). A (token, layer) whose k
  replay entries are all -1 (`moe.NO_RECORD`: padding, a sample's last token) routes freely.
- `model.extend(input_ids, cache, valid_lengths=None, logits_at=None)`: chunked prefill; appends
  T tokens per row (the first valid_lengths[b] real, right padding after) to a `DecodeCache`
  (with `logits_at`, the logits of one position per row only).
- `model.decode_step(token_ids, cache, active=None)`: one token per row with the recurrent forms;
  attention reads the cache only up to the longest active row.
- `model.target_logprobs(input_ids, target_ids, ...)`: the training forward reduced to the
  log-probability of each position's target token (float32 [B, T]), the LM head applied in
  chunks (`ExecutionConfig.logits_chunk`, `t1jax.ops.cross_entropy`): no [B, T, vocab] logits.

`execution` (`t1jax.model.execution.ExecutionConfig`) picks the attention kernel of the training
forward and the prefill, the head's chunking and whether the training forward scans over repeats
of the layer-type period (`layer_period`); the parameters are the same either way.

Every form returns the experts it used per token and layer, `routing` int32 [B, T, L, k] (L =
num_hidden_layers: every Qwen3.5 layer is MoE); in replay mode that is the replay array itself
(with the free choice where it held -1).
Rows of padding carry garbage logits and routing.

Parameter names (state paths) follow transformers' module names, e.g.
`model.layers.3.self_attn.q_proj`, so `hf_io` maps them one to one (with transposes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from t1jax.model.attention import DECODE_KV_CHUNK, GatedAttention
from t1jax.model.axes import ACT_BATCH, ACT_EMBED, ACT_LENGTH, ACT_VOCAB, EMBED, VOCAB, constrain
from t1jax.model.cache import AttentionLayerCache, DecodeCache, LinearLayerCache, init_cache
from t1jax.model.config import FULL_ATTENTION, Qwen35MoeConfig
from t1jax.model.execution import DEFAULT_EXECUTION, ExecutionConfig
from t1jax.model.gated_deltanet import GatedDeltaNet
from t1jax.model.hooks import active_hooks
from t1jax.model.moe import SparseMoeBlock, validate_routing_replay
from t1jax.model.norms import RMSNorm
from t1jax.model.params import make_param, normal
from t1jax.ops.cross_entropy import chunked_target_logprobs, num_chunks_for


@struct.dataclass
class BackboneOutput:
    hidden_states: jax.Array  # [B, T, hidden] after the final norm, compute dtype
    routing: jax.Array  # int32 [B, T, num_hidden_layers, num_experts_per_tok]


@struct.dataclass
class CausalLMOutput:
    logits: jax.Array  # float32 [B, T, vocab]
    routing: jax.Array  # int32 [B, T, num_hidden_layers, num_experts_per_tok]


@struct.dataclass
class TargetLogprobs:
    logprobs: jax.Array  # float32 [B, T]: log p(target_ids[b, t] | tokens[b, :t + 1])
    routing: jax.Array  # int32 [B, T, num_hidden_layers, num_experts_per_tok]


def layer_period(layer_types: tuple[str, ...]) -> int:
    """The shortest p such that the layer types repeat with period p over the whole stack
    (p = len(layer_types) when they do not repeat); Qwen3.5: 4 ([linear x 3, full x 1])."""
    count = len(layer_types)
    for period in range(1, count + 1):
        if count % period == 0 and all(layer_types[i] == layer_types[i % period] for i in range(count)):
            return period
    return count


def positions_within_documents(segment_ids: jax.Array) -> jax.Array:
    """int32 [B, T]: each token's index within its document (a run of equal segment ids)."""
    seq_len = segment_ids.shape[1]
    index = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start_index = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return (index - start_index).astype(jnp.int32)


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        config: Qwen35MoeConfig,
        layer_index: int,
        *,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        execution: ExecutionConfig = DEFAULT_EXECUTION,
    ):
        self.is_full_attention = config.layer_types[layer_index] == FULL_ATTENTION
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, param_dtype=param_dtype, rngs=rngs)
        if self.is_full_attention:
            self.self_attn = GatedAttention(
                config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution
            )
        else:
            self.linear_attn = GatedDeltaNet(
                config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution
            )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps=eps, param_dtype=param_dtype, rngs=rngs
        )
        self.mlp = SparseMoeBlock(
            config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution
        )

    def _moe(self, hidden: jax.Array, replay_ids):
        with jax.named_scope("moe"):  # scopes name the profile's ops (bench/model_step.py --profile)
            moe_out, expert_ids = self.mlp(self.post_attention_layernorm(hidden), replay_ids)
        return hidden + moe_out, expert_ids

    def __call__(self, hidden, *, positions, segment_ids, replay_ids):
        normed = self.input_layernorm(hidden)
        if self.is_full_attention:
            with jax.named_scope("attention"):
                mixed = self.self_attn(normed, positions=positions, segment_ids=segment_ids)
        else:
            with jax.named_scope("gated_deltanet"):
                mixed = self.linear_attn(normed, segment_ids=segment_ids)
        return self._moe(hidden + mixed, replay_ids)

    def extend(self, hidden, layer_cache, *, cache_lengths, valid_lengths, replay_ids):
        normed = self.input_layernorm(hidden)
        if self.is_full_attention:
            mixed, key, value = self.self_attn.extend(
                normed,
                layer_cache.key,
                layer_cache.value,
                cache_lengths=cache_lengths,
                valid_lengths=valid_lengths,
            )
            new_cache = AttentionLayerCache(key=key, value=value)
        else:
            mixed, conv_state, recurrent_state = self.linear_attn.extend(
                normed, layer_cache.conv_state, layer_cache.recurrent_state, valid_lengths=valid_lengths
            )
            new_cache = LinearLayerCache(conv_state=conv_state, recurrent_state=recurrent_state)
        hidden, expert_ids = self._moe(hidden + mixed, replay_ids)
        return hidden, expert_ids, new_cache

    def step(self, hidden, layer_cache, *, cache_lengths, active, kv_chunk):
        """hidden [B, 1, H]; inactive rows keep their cache."""
        normed = self.input_layernorm(hidden)
        if self.is_full_attention:
            mixed, key, value = self.self_attn.decode(
                normed,
                layer_cache.key,
                layer_cache.value,
                cache_lengths=cache_lengths,
                active=active,
                kv_chunk=kv_chunk,
            )
            new_cache = AttentionLayerCache(key=key, value=value)
        else:
            mixed, conv_state, recurrent_state = self.linear_attn.step(
                normed[:, 0], layer_cache.conv_state, layer_cache.recurrent_state
            )
            keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
            new_cache = LinearLayerCache(
                conv_state=keep(conv_state, layer_cache.conv_state),
                recurrent_state=keep(recurrent_state, layer_cache.recurrent_state),
            )
            mixed = mixed[:, None]
        hidden, expert_ids = self._moe(hidden + mixed, None)
        return hidden, expert_ids, new_cache


class Qwen35MoeModel(nnx.Module):
    """Embedding, decoder layers, final norm. Returns normalised hidden states and routing."""

    def __init__(
        self,
        config: Qwen35MoeConfig,
        *,
        dtype=jnp.float32,
        param_dtype=None,
        rngs: nnx.Rngs,
        execution: ExecutionConfig = DEFAULT_EXECUTION,
    ):
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = dtype
        self.execution = execution
        self.embed_tokens = make_param(
            rngs,
            normal(config.initializer_range),
            (config.vocab_size, config.hidden_size),
            param_dtype,
            (VOCAB, EMBED),
        )
        self.layers = nnx.List(
            [
                DecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)

    def _embed(self, input_ids: jax.Array) -> jax.Array:
        hidden = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        return constrain(hidden, (ACT_BATCH, ACT_LENGTH, ACT_EMBED))

    def __call__(self, input_ids, *, segment_ids=None, positions=None, routing_replay=None) -> BackboneOutput:
        input_ids = _check_token_ids(input_ids, self.config)
        if segment_ids is None:
            segment_ids = jnp.ones(input_ids.shape, jnp.int32)
        else:
            segment_ids = _check_same_shape("segment_ids", segment_ids, input_ids.shape).astype(jnp.int32)
        if positions is None:
            positions = positions_within_documents(segment_ids)
        else:
            positions = _check_same_shape("positions", positions, input_ids.shape).astype(jnp.int32)
        if routing_replay is not None:
            routing_replay = validate_routing_replay(routing_replay, self.config, input_ids.shape)
        hidden = self._embed(input_ids)
        call_layer = active_hooks().decoder_layer or _call_layer
        run = self._scanned_layers if self.execution.scan_layers else self._unrolled_layers
        hidden, routing = run(call_layer, hidden, positions, segment_ids, routing_replay)
        return BackboneOutput(hidden_states=self.norm(hidden), routing=routing)

    def _unrolled_layers(self, call_layer, hidden, positions, segment_ids, routing_replay):
        routing = []
        for index, layer in enumerate(self.layers):
            replay_ids = None if routing_replay is None else routing_replay[:, :, index]
            hidden, expert_ids = call_layer(
                layer, hidden, positions=positions, segment_ids=segment_ids, replay_ids=replay_ids
            )
            hidden = constrain(hidden, (ACT_BATCH, ACT_LENGTH, ACT_EMBED))
            routing.append(expert_ids)
        return hidden, jnp.stack(routing, axis=2)

    def _scanned_layers(self, call_layer, hidden, positions, segment_ids, routing_replay):
        """The same layers as `_unrolled_layers`, as a `lax.scan` over the repeats of the
        layer-type period: slot s of repeat r is layer r * period + s. Each slot's parameters are
        stacked over the repeats for the scan (the per-layer parameters stay where they are),
        so the body compiles once per slot instead of once per layer."""
        period = layer_period(self.config.layer_types)
        repeats = len(self.layers) // period
        graphdefs, stacked = [], []
        for slot in range(period):
            states = [nnx.state(self.layers[r * period + slot]) for r in range(repeats)]
            graphdefs.append(nnx.graphdef(self.layers[slot]))
            stacked.append(jax.tree.map(lambda *xs: jnp.stack(xs), *states))
        replay = None
        if routing_replay is not None:
            batch, length, _, top_k = routing_replay.shape
            replay = jnp.moveaxis(routing_replay.reshape(batch, length, repeats, period, top_k), 2, 0)

        def body(hidden, xs):
            states, replay_r = xs
            routing = []
            for slot in range(period):
                layer = nnx.merge(graphdefs[slot], states[slot])
                replay_ids = None if replay_r is None else replay_r[:, :, slot]
                hidden, expert_ids = call_layer(
                    layer, hidden, positions=positions, segment_ids=segment_ids, replay_ids=replay_ids
                )
                hidden = constrain(hidden, (ACT_BATCH, ACT_LENGTH, ACT_EMBED))
                routing.append(expert_ids)
            return hidden, jnp.stack(routing, axis=2)

        hidden, routing = jax.lax.scan(body, hidden, (stacked, replay))
        batch, length = hidden.shape[:2]
        routing = jnp.moveaxis(routing, 0, 2)  # [B, T, repeats, period, k]
        return hidden, routing.reshape(batch, length, repeats * period, routing.shape[-1])

    def extend(self, input_ids, cache: DecodeCache, *, valid_lengths=None, routing_replay=None):
        input_ids = _check_token_ids(input_ids, self.config)
        batch, new_len = input_ids.shape
        _check_cache_batch(cache, batch, len(self.layers))
        if valid_lengths is None:
            valid_lengths = jnp.full((batch,), new_len, jnp.int32)
        valid_lengths = jnp.asarray(valid_lengths, jnp.int32)
        _check_capacity(cache, valid_lengths, new_len)
        if routing_replay is not None:
            routing_replay = validate_routing_replay(routing_replay, self.config, input_ids.shape)
        hidden = self._embed(input_ids)
        routing, layer_caches = [], []
        for index, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers, strict=True)):
            replay_ids = None if routing_replay is None else routing_replay[:, :, index]
            hidden, expert_ids, new_layer_cache = layer.extend(
                hidden,
                layer_cache,
                cache_lengths=cache.lengths,
                valid_lengths=valid_lengths,
                replay_ids=replay_ids,
            )
            routing.append(expert_ids)
            layer_caches.append(new_layer_cache)
        new_cache = DecodeCache(lengths=cache.lengths + valid_lengths, layers=tuple(layer_caches))
        return BackboneOutput(hidden_states=self.norm(hidden), routing=jnp.stack(routing, axis=2)), new_cache

    def decode_step(self, token_ids, cache: DecodeCache, *, active=None, kv_chunk=DECODE_KV_CHUNK):
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim != 1:
            raise ValueError(f"decode_step takes one token per row, int [B]; got shape {token_ids.shape}")
        batch = token_ids.shape[0]
        _check_cache_batch(cache, batch, len(self.layers))
        active = jnp.ones((batch,), bool) if active is None else jnp.asarray(active, bool)
        _check_capacity(cache, active.astype(jnp.int32), 1)
        hidden = self._embed(_check_token_ids(token_ids[:, None], self.config))
        routing, layer_caches = [], []
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            hidden, expert_ids, new_layer_cache = layer.step(
                hidden, layer_cache, cache_lengths=cache.lengths, active=active, kv_chunk=kv_chunk
            )
            routing.append(expert_ids)
            layer_caches.append(new_layer_cache)
        new_cache = DecodeCache(lengths=cache.lengths + active.astype(jnp.int32), layers=tuple(layer_caches))
        return BackboneOutput(hidden_states=self.norm(hidden), routing=jnp.stack(routing, axis=2)), new_cache


class Qwen35MoeForCausalLM(nnx.Module):
    """Backbone + LM head. `dtype` is the compute dtype, `param_dtype` the storage dtype (default:
    `dtype`); router softmax, norms and the delta rule always run in float32."""

    def __init__(
        self,
        config: Qwen35MoeConfig,
        *,
        dtype=jnp.float32,
        param_dtype=None,
        rngs: nnx.Rngs | None = None,
        execution: ExecutionConfig = DEFAULT_EXECUTION,
    ):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = dtype
        self.execution = execution
        self.model = Qwen35MoeModel(
            config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution
        )
        if not config.tie_word_embeddings:
            self.lm_head = make_param(
                rngs,
                normal(config.initializer_range),
                (config.hidden_size, config.vocab_size),
                param_dtype,
                (EMBED, VOCAB),
            )

    def _head_kernel(self) -> jax.Array:
        """[hidden, vocab] in the compute dtype."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens[...].astype(self.dtype).T
        return self.lm_head[...].astype(self.dtype)

    def _logits(self, hidden: jax.Array) -> jax.Array:
        kernel = self._head_kernel()
        logits = jnp.einsum(
            "...h,hv->...v", hidden.astype(self.dtype), kernel, preferred_element_type=jnp.float32
        )
        return constrain(logits, (ACT_BATCH, ACT_LENGTH, ACT_VOCAB)) if logits.ndim == 3 else logits

    def __call__(self, input_ids, *, segment_ids=None, positions=None, routing_replay=None) -> CausalLMOutput:
        out = self.model(
            input_ids, segment_ids=segment_ids, positions=positions, routing_replay=routing_replay
        )
        return CausalLMOutput(logits=self._logits(out.hidden_states), routing=out.routing)

    def target_logprobs(
        self, input_ids, target_ids, *, segment_ids=None, positions=None, routing_replay=None,
        temperature: float = 1.0,
    ) -> TargetLogprobs:
        """The training forward reduced to log p(target_ids[b, t] | input_ids[b, :t + 1]), float32
        [B, T] (garbage where a target is not a token of the vocabulary, e.g. on padding), with
        the head applied in strided chunks of about `execution.logits_chunk` positions; p is
        softmax(logits / `temperature`) (a Python float: the distribution a sampler draws from
        at that temperature with no top-p / top-k)."""
        out = self.model(
            input_ids, segment_ids=segment_ids, positions=positions, routing_replay=routing_replay
        )
        target_ids = _check_same_shape("target_ids", target_ids, out.hidden_states.shape[:2])
        with jax.named_scope("lm_head"):
            logprobs = self._chunked_logprobs(out.hidden_states, target_ids, temperature)
        return TargetLogprobs(logprobs=logprobs, routing=out.routing)

    def _chunked_logprobs(self, hidden: jax.Array, target_ids: jax.Array, temperature: float) -> jax.Array:
        return chunked_target_logprobs(
            hidden.astype(self.dtype),
            self._head_kernel(),
            target_ids,
            num_chunks=num_chunks_for(target_ids.shape[1], self.execution.logits_chunk),
            constrain_logits=lambda x: constrain(x, (ACT_BATCH, ACT_LENGTH, ACT_VOCAB)),
            constrain_kernel=lambda x: constrain(x, (EMBED, VOCAB)),
            temperature=temperature,
        )

    def init_cache(self, batch_size: int, max_len: int) -> DecodeCache:
        return init_cache(self.config, batch_size, max_len, self.dtype)

    def extend(
        self, input_ids, cache: DecodeCache, *, valid_lengths=None, routing_replay=None, logits_at=None
    ) -> tuple[CausalLMOutput, DecodeCache]:
        """Chunked prefill. input_ids int32 [B, T]; valid_lengths int32 [B] (default T).
        Returns logits float32 [B, T, vocab] and routing [B, T, L, k] for the new tokens (garbage
        past valid_lengths[b]) and the cache advanced by valid_lengths. With `logits_at` int32
        [B] the logits are float32 [B, vocab], only at index logits_at[b] of each row (a sampler
        needs only the last position's: the head is then applied to B positions, not B * T)."""
        out, cache = self.model.extend(
            input_ids, cache, valid_lengths=valid_lengths, routing_replay=routing_replay
        )
        hidden = out.hidden_states
        if logits_at is not None:
            index = jnp.asarray(logits_at, jnp.int32)[:, None, None]
            hidden = jnp.take_along_axis(hidden, index, axis=1)[:, 0]
        return CausalLMOutput(logits=self._logits(hidden), routing=out.routing), cache

    def decode_step(
        self, token_ids, cache: DecodeCache, *, active=None, kv_chunk: int = DECODE_KV_CHUNK
    ) -> tuple[CausalLMOutput, DecodeCache]:
        """One token per row. token_ids int32 [B]; active bool [B] (default all): inactive rows
        keep their cache and length. Returns logits [B, vocab], routing [B, L, k], new cache.
        Attention reads the cache `kv_chunk` slots at a time up to the longest active row (see
        `attention.decode_attention`), so its cost follows the live lengths, not max_len."""
        out, cache = self.model.decode_step(token_ids, cache, active=active, kv_chunk=kv_chunk)
        logits = self._logits(out.hidden_states[:, 0])
        return CausalLMOutput(logits=logits, routing=out.routing[:, 0]), cache


def _call_layer(layer: DecoderLayer, hidden, **kwargs):
    return layer(hidden, **kwargs)


# ---- input checks (host side, static shapes: safe under jit) -------------------------------------
def _check_token_ids(input_ids, config: Qwen35MoeConfig) -> jax.Array:
    shape = tuple(getattr(input_ids, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"input_ids must be int [batch, seq], got shape {shape}")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(input_ids, jax.core.Tracer):
        import numpy as np

        ids = np.asarray(input_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
            bad = int(ids.max()) if ids.max() >= config.vocab_size else int(ids.min())
            raise ValueError(
                f"input_ids holds token id {bad}, outside the vocabulary [0, {config.vocab_size})"
            )
    return jnp.asarray(input_ids, jnp.int32)


def _check_same_shape(name: str, array, shape) -> jax.Array:
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(array.shape)}, expected input_ids' shape {tuple(shape)}")
    return jnp.asarray(array)


def _check_cache_batch(cache: DecodeCache, batch: int, num_layers: int) -> None:
    if cache.batch_size != batch:
        raise ValueError(f"cache holds {cache.batch_size} rows but the input has {batch}")
    if len(cache.layers) != num_layers:
        raise ValueError(f"cache has {len(cache.layers)} layers, the model {num_layers}")


def _check_capacity(cache: DecodeCache, valid_lengths: jax.Array, new_len: int) -> None:
    if isinstance(valid_lengths, jax.core.Tracer) or isinstance(cache.lengths, jax.core.Tracer):
        return  # under jit the caller (the sampler's scheduler) guarantees capacity
    import numpy as np

    valid = np.asarray(valid_lengths)
    if valid.min(initial=0) < 0 or valid.max(initial=0) > new_len:
        raise ValueError(f"valid_lengths {valid.tolist()} must lie in [0, {new_len}]")
    needed = np.asarray(cache.lengths) + valid
    if needed.max(initial=0) > cache.max_len:
        row = int(needed.argmax())
        raise ValueError(
            f"cache row {row} would hold {int(needed[row])} tokens, more than its max_len {cache.max_len}"
        )
