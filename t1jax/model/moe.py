"""The sparse MoE block of Qwen3.5, with the two router modes that make routing replay work.

Owns two pure functions and the module that wires them:

- `route(router_logits, top_k, replay_ids=None) -> (expert_ids, gate_weights)`.
  free:   expert_ids = top-k of the live logits.
  replay: expert_ids = the given ids (paper §4.3, Eq. 12); a token whose k ids are all
          `NO_RECORD` (-1) has no record (padding, a sample's last token) and routes freely.
  In both modes gate_weights = softmax of the *live* logits restricted to expert_ids, i.e.
  exp(s_e) / sum_{e' in ids} exp(s_e'); this equals transformers' "softmax over all experts, take
  top-k, renormalise". The ids never carry gradient (top-k is not differentiable and replayed ids
  are data); the router weight gets its gradient through the gates only.
- `routed_experts(x, expert_ids, gate_weights, w_gate, w_up, w_down, *, matmul)`: every token's
  k SwiGLU experts as one grouped computation (sort assignments by expert, grouped matmuls by the
  kernel `matmul` (the module's `ExecutionConfig.grouped_matmul()`: `t1jax.ops.grouped_matmul`'s
  `lax.ragged_dot`, or megablox `gmm`), unsort, weighted sum). An expert-parallel all-to-all
  dispatch can replace it behind the same signature.

Parameter layout:
  gate (router) [hidden, experts]              (embed, router)      computed in float32
  experts.w_gate, experts.w_up [E, hidden, I]  (expert, embed, expert_mlp)
  experts.w_down [E, I, hidden]                (expert, expert_mlp, embed)
  shared_expert.{gate,up}_proj [hidden, Is]    (embed, mlp); down_proj [Is, hidden] (mlp, embed)
  shared_expert_gate [hidden, 1]               (embed, None)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from t1jax.model.axes import EMBED, EXPERT, EXPERT_MLP, MLP, ROUTER
from t1jax.model.config import Qwen35MoeConfig
from t1jax.model.execution import DEFAULT_EXECUTION, ExecutionConfig
from t1jax.model.hooks import active_hooks
from t1jax.model.params import make_param, normal
from t1jax.ops.grouped_matmul import grouped_matmul

NO_RECORD = -1  # replay value for a token without a routing record: route it freely


def route(
    router_logits: jax.Array, top_k: int, replay_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """router_logits float [N, E]; replay_ids int [N, k] or None.

    Returns expert_ids int32 [N, k] (the experts used) and gate_weights float32 [N, k] summing to 1
    per token. Replay ids are trusted here (validated on the host before jit, see
    `validate_routing_replay`); rows of NO_RECORD take the free choice.
    """
    logits = router_logits.astype(jnp.float32)
    _, expert_ids = jax.lax.top_k(jax.lax.stop_gradient(logits), top_k)
    if replay_ids is not None:
        replay_ids = replay_ids.astype(jnp.int32)
        has_record = replay_ids[:, :1] != NO_RECORD
        expert_ids = jnp.where(has_record, replay_ids, expert_ids)
    expert_ids = jax.lax.stop_gradient(expert_ids.astype(jnp.int32))
    chosen_logits = jnp.take_along_axis(logits, expert_ids, axis=-1)
    return expert_ids, jax.nn.softmax(chosen_logits, axis=-1)


def routed_experts(
    x: jax.Array,
    expert_ids: jax.Array,
    gate_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    matmul=grouped_matmul,
) -> jax.Array:
    """sum_j gate_weights[n, j] * down(silu(x_n w_gate[e]) * (x_n w_up[e])), e = expert_ids[n, j].

    x [N, H]; expert_ids int32 [N, k]; gate_weights [N, k]; w_gate, w_up [E, H, I]; w_down [E, I, H].
    Returns [N, H] in x's dtype. The grouped matmuls see each (token, expert) pair exactly once.
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = w_gate.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    sorted_tokens = jnp.take(x, order // top_k, axis=0)
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    gate = matmul(sorted_tokens, w_gate, group_sizes)
    up = matmul(sorted_tokens, w_up, group_sizes)
    hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    expert_out = matmul(hidden, w_down, group_sizes)
    unsorted = jnp.take(expert_out, jnp.argsort(order), axis=0)
    unsorted = unsorted.reshape(num_tokens, top_k, -1).astype(jnp.float32)
    combined = jnp.einsum("nkh,nk->nh", unsorted, gate_weights.astype(jnp.float32))
    return combined.astype(x.dtype)


class Experts(nnx.Module):
    def __init__(self, config: Qwen35MoeConfig, *, param_dtype, rngs: nnx.Rngs):
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = normal(config.initializer_range)
        self.w_gate = make_param(rngs, init, (e, h, i), param_dtype, (EXPERT, EMBED, EXPERT_MLP))
        self.w_up = make_param(rngs, init, (e, h, i), param_dtype, (EXPERT, EMBED, EXPERT_MLP))
        self.w_down = make_param(rngs, init, (e, i, h), param_dtype, (EXPERT, EXPERT_MLP, EMBED))


class SharedExpert(nnx.Module):
    def __init__(self, config: Qwen35MoeConfig, *, param_dtype, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.shared_expert_intermediate_size
        init = normal(config.initializer_range)
        self.gate_proj = make_param(rngs, init, (h, i), param_dtype, (EMBED, MLP))
        self.up_proj = make_param(rngs, init, (h, i), param_dtype, (EMBED, MLP))
        self.down_proj = make_param(rngs, init, (i, h), param_dtype, (MLP, EMBED))

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        gate = x @ self.gate_proj[...].astype(dtype)
        up = x @ self.up_proj[...].astype(dtype)
        hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)
        return hidden @ self.down_proj[...].astype(dtype)


class SparseMoeBlock(nnx.Module):
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
        init = normal(config.initializer_range)
        self.gate = make_param(
            rngs, init, (config.hidden_size, config.num_experts), param_dtype, (EMBED, ROUTER)
        )
        self.experts = Experts(config, param_dtype=param_dtype, rngs=rngs)
        self.shared_expert = SharedExpert(config, param_dtype=param_dtype, rngs=rngs)
        self.shared_expert_gate = make_param(rngs, init, (config.hidden_size, 1), param_dtype, (EMBED, None))

    def __call__(self, x: jax.Array, replay_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [B, T, H]; replay_ids int32 [B, T, k] or None.
        Returns (output [B, T, H], expert_ids int32 [B, T, k])."""
        batch, seq_len, hidden = x.shape
        tokens = x.reshape(batch * seq_len, hidden).astype(self.dtype)
        router_logits = tokens.astype(jnp.float32) @ self.gate[...].astype(jnp.float32)
        flat_replay = None if replay_ids is None else replay_ids.reshape(batch * seq_len, -1)
        expert_ids, gate_weights = route(router_logits, self.config.num_experts_per_tok, flat_replay)
        dtype = self.dtype
        dispatch = active_hooks().routed_experts or routed_experts
        with jax.named_scope("routed_experts"):
            routed = dispatch(
                tokens,
                expert_ids,
                gate_weights,
                self.experts.w_gate[...].astype(dtype),
                self.experts.w_up[...].astype(dtype),
                self.experts.w_down[...].astype(dtype),
                matmul=self.execution.grouped_matmul(),
            )
        shared_gate = jax.nn.sigmoid(
            tokens.astype(jnp.float32) @ self.shared_expert_gate[...].astype(jnp.float32)
        )
        shared = self.shared_expert(tokens).astype(jnp.float32) * shared_gate
        out = (routed.astype(jnp.float32) + shared).astype(dtype)
        return out.reshape(batch, seq_len, hidden), expert_ids.reshape(batch, seq_len, -1)


def validate_routing_replay(
    routing_replay, config: Qwen35MoeConfig, token_shape: tuple[int, int]
) -> jax.Array:
    """Check a replay array before it reaches jit; return it as int32.

    Expected: integer [B, T, num_hidden_layers, num_experts_per_tok] with ids in [0, num_experts)
    and no id repeated within one (token, layer), or all k entries NO_RECORD (-1) for a token and
    layer without a record (routed freely). Shape and dtype are always checked; values are checked
    when the array is concrete (on the host), since a traced array cannot raise.
    """
    import numpy as np

    expected = (*token_shape, config.num_hidden_layers, config.num_experts_per_tok)
    shape = tuple(getattr(routing_replay, "shape", ()))
    if shape != expected:
        raise ValueError(
            f"routing_replay has shape {shape}, expected (batch, seq, num_hidden_layers, "
            f"num_experts_per_tok) = {expected}"
        )
    dtype = np.dtype(routing_replay.dtype)
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"routing_replay must hold integer expert ids, got dtype {dtype}")
    if isinstance(routing_replay, jax.core.Tracer):
        return routing_replay.astype(jnp.int32)
    ids = np.asarray(routing_replay)
    no_record = ids == NO_RECORD
    partial = no_record.any(axis=-1) & ~no_record.all(axis=-1)
    if partial.any():
        batch, pos, layer = (int(i) for i in np.argwhere(partial)[0])
        raise ValueError(
            f"routing_replay mixes {NO_RECORD} (no record) with expert ids at layer {layer} (batch row "
            f"{batch}, position {pos}): {ids[batch, pos, layer].tolist()}; mark a missing record with "
            f"{NO_RECORD} in all {config.num_experts_per_tok} slots"
        )
    bad = ((ids < 0) | (ids >= config.num_experts)) & ~no_record
    if bad.any():
        batch, pos, layer, slot = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"routing_replay holds expert id {int(ids[batch, pos, layer, slot])} at layer {layer} "
            f"(batch row {batch}, position {pos}, slot {slot}); ids must lie in [0, {config.num_experts})"
        )
    sorted_ids = np.sort(ids, axis=-1)
    repeated = (sorted_ids[..., 1:] == sorted_ids[..., :-1]).any(axis=-1) & ~no_record.all(axis=-1)
    if repeated.any():
        batch, pos, layer = (int(i) for i in np.argwhere(repeated)[0])
        raise ValueError(
            f"routing_replay repeats an expert at layer {layer} (batch row {batch}, position {pos}): "
            f"{ids[batch, pos, layer].tolist()}; a token's {config.num_experts_per_tok} experts must differ"
        )
    return jnp.asarray(ids, dtype=jnp.int32)
