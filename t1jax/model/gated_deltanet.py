"""The Gated DeltaNet mixer of Qwen3.5 (the layers whose `layer_types` entry is "linear_attention").

Owns the layer around the recurrence; the recurrence itself (`t1jax.ops.gated_delta_rule`) and the
causal depthwise conv (`t1jax.ops.causal_conv`) are separate ops.

Math (transformers' `Qwen3_5MoeGatedDeltaNet`, separate projections, not Qwen3-Next's fused ones):
  qkv = x W_qkv  laid out [q | k | v] (conv_dim = 2*Hk*dk + Hv*dv); depthwise causal conv (kernel K,
  no bias), SiLU; split; q, k L2-normalised in float32 (x * rsqrt(sum x^2 + 1e-6)), q * dk^-0.5;
  key head j // (Hv/Hk) serves value head j; beta = sigmoid(x W_b); g = -exp(A_log) *
  softplus(x W_a + dt_bias) (float32); chunked gated delta rule (chunk 64, float32);
  per-head gated RMSNorm `w * rmsnorm(o) * silu(z)` with z = x W_z; out_proj.

Parameter layout ([in, out] kernels):
  in_proj_qkv [hidden, conv_dim]  (embed, linear_conv)
  in_proj_z [hidden, Hv, dv]      (embed, linear_heads, head_dim)
  in_proj_b, in_proj_a [hidden, Hv]  (embed, linear_heads)
  conv1d [conv_dim, K]            (linear_conv, conv_kernel)  -- tap K-1 multiplies the newest input
  A_log, dt_bias [Hv]             (linear_heads)
  norm.weight [dv]; out_proj [Hv, dv, hidden]  (linear_heads, head_dim, embed)

Decoding state per layer: conv_state [B, K-1, conv_dim] (the last K-1 *pre-conv* qkv rows, oldest
first, in the compute dtype) and recurrent_state [B, Hv, dk, dv] (float32).

Invariants: with packed rows the conv window and the recurrent state restart at every document
start (segment id change); padding (segment 0) leaves the state untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from t1jax.model.axes import CONV_KERNEL, EMBED, HEAD_DIM, LINEAR_CONV, LINEAR_HEADS
from t1jax.model.config import Qwen35MoeConfig
from t1jax.model.execution import DEFAULT_EXECUTION, ExecutionConfig
from t1jax.model.hooks import active_hooks
from t1jax.model.norms import GatedRMSNorm
from t1jax.model.params import log_uniform_decay, make_param, normal, ones, uniform
from t1jax.ops.causal_conv import causal_conv1d, causal_conv1d_step
from t1jax.ops.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step

_L2_EPS = 1e-6


def l2_normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + _L2_EPS)


class GatedDeltaNet(nnx.Module):
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
        hidden = config.hidden_size
        heads_v, dv = config.linear_num_value_heads, config.linear_value_head_dim
        conv_dim, kernel = config.linear_conv_dim, config.linear_conv_kernel_dim
        init = normal(config.initializer_range)
        self.in_proj_qkv = make_param(rngs, init, (hidden, conv_dim), param_dtype, (EMBED, LINEAR_CONV))
        self.in_proj_z = make_param(
            rngs, init, (hidden, heads_v, dv), param_dtype, (EMBED, LINEAR_HEADS, HEAD_DIM)
        )
        self.in_proj_b = make_param(rngs, init, (hidden, heads_v), param_dtype, (EMBED, LINEAR_HEADS))
        self.in_proj_a = make_param(rngs, init, (hidden, heads_v), param_dtype, (EMBED, LINEAR_HEADS))
        bound = kernel**-0.5  # torch Conv1d's default for a depthwise kernel
        self.conv1d = make_param(
            rngs, uniform(-bound, bound), (conv_dim, kernel), param_dtype, (LINEAR_CONV, CONV_KERNEL)
        )
        self.A_log = make_param(rngs, log_uniform_decay, (heads_v,), param_dtype, (LINEAR_HEADS,))
        self.dt_bias = make_param(rngs, ones, (heads_v,), param_dtype, (LINEAR_HEADS,))
        self.norm = GatedRMSNorm(dv, eps=config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.out_proj = make_param(
            rngs, init, (heads_v, dv, hidden), param_dtype, (LINEAR_HEADS, HEAD_DIM, EMBED)
        )

    # ---- pieces shared by every form -----------------------------------------------------------
    def _project(self, x: jax.Array):
        """x [..., hidden] -> pre-conv qkv [..., conv_dim], z [..., Hv, dv], beta and g [..., Hv]."""
        dtype = self.dtype
        x = x.astype(dtype)
        qkv = x @ self.in_proj_qkv[...].astype(dtype)
        z = jnp.einsum("...h,hnd->...nd", x, self.in_proj_z[...].astype(dtype))
        b = x @ self.in_proj_b[...].astype(dtype)
        a = x @ self.in_proj_a[...].astype(dtype)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        decay_rate = jnp.exp(self.A_log[...].astype(jnp.float32))
        g = -decay_rate * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        return qkv, z, beta, g

    def _split_heads(self, conv_out: jax.Array):
        """Post-conv activations [..., conv_dim] -> q, k (normalised, expanded to Hv heads), v."""
        cfg = self.config
        activated = jax.nn.silu(conv_out.astype(jnp.float32))
        key_dim = cfg.linear_key_dim
        q = activated[..., :key_dim]
        k = activated[..., key_dim : 2 * key_dim]
        v = activated[..., 2 * key_dim :]
        lead = conv_out.shape[:-1]
        q = q.reshape(*lead, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        k = k.reshape(*lead, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        v = v.reshape(*lead, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        # transformers feeds the conv output to the rule in the compute dtype; round the same way.
        q, k, v = (t.astype(self.dtype) for t in (q, k, v))
        q = l2_normalize(q) * (cfg.linear_key_head_dim**-0.5)
        k = l2_normalize(k)
        repeats = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        if repeats > 1:
            q = jnp.repeat(q, repeats, axis=-2)
            k = jnp.repeat(k, repeats, axis=-2)
        return q, k, v.astype(jnp.float32)

    def _output(self, core: jax.Array, z: jax.Array) -> jax.Array:
        normed = self.norm(core.astype(self.dtype), z, dtype=self.dtype)
        return jnp.einsum("...nd,ndh->...h", normed, self.out_proj[...].astype(self.dtype))

    def _conv_weight(self) -> jax.Array:
        return self.conv1d[...].astype(self.dtype)

    # ---- forms ---------------------------------------------------------------------------------
    def __call__(self, x: jax.Array, *, segment_ids: jax.Array) -> jax.Array:
        """Full forward over packed rows. x [B, T, hidden]; segment_ids int32 [B, T]."""
        sequence_ops = active_hooks().recurrent
        if sequence_ops is not None:
            x, segment_ids = sequence_ops.enter(x, segment_ids)
        conv = causal_conv1d if sequence_ops is None else sequence_ops.causal_conv1d
        if sequence_ops is None:
            rule = self.execution.chunk_gated_delta_rule()
        elif self.execution.gated_delta_rule_kernel != "jax":
            raise ValueError(
                f"execution.gated_delta_rule_kernel {self.execution.gated_delta_rule_kernel!r} has no "
                "context-parallel form (context > 1 relays the chunked reference's scan): use 'jax'"
            )
        else:
            rule = sequence_ops.chunk_gated_delta_rule
        qkv, z, beta, g = self._project(x)
        with jax.named_scope("conv"):
            conv_out, _ = conv(qkv, self._conv_weight(), segment_ids=segment_ids)
        q, k, v = self._split_heads(conv_out)
        with jax.named_scope("delta_rule"):
            core, _ = rule(q, k, v, g, beta, segment_ids=segment_ids)
        out = self._output(core, z)
        return out if sequence_ops is None else sequence_ops.leave(out)

    def extend(
        self, x: jax.Array, conv_state: jax.Array, recurrent_state: jax.Array, *, valid_lengths: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Continue each row's sequence by T tokens (the first valid_lengths[b] real, the rest
        right padding) from its cached states. Returns (output [B, T, hidden], conv_state,
        recurrent_state) after the last real token of each row."""
        new_len = x.shape[1]
        is_real = (jnp.arange(new_len, dtype=jnp.int32)[None, :] < valid_lengths[:, None]).astype(jnp.int32)
        qkv, z, beta, g = self._project(x)
        # final_state: the K-1 inputs up to each row's last real token (unchanged for a row with
        # no real token), i.e. the conv cache the next call continues from.
        conv_out, new_conv_state = causal_conv1d(
            qkv, self._conv_weight(), initial_state=conv_state.astype(qkv.dtype), segment_ids=is_real
        )
        q, k, v = self._split_heads(conv_out)
        core, recurrent_state = chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=recurrent_state, segment_ids=is_real
        )
        return self._output(core, z), new_conv_state.astype(conv_state.dtype), recurrent_state

    def step(
        self, x: jax.Array, conv_state: jax.Array, recurrent_state: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One token per row with the recurrent forms. x [B, hidden] -> (y [B, hidden], states)."""
        qkv, z, beta, g = self._project(x)
        conv_out, new_conv_state = causal_conv1d_step(qkv, self._conv_weight(), conv_state.astype(qkv.dtype))
        q, k, v = self._split_heads(conv_out)
        core, new_recurrent_state = gated_delta_rule_step(q, k, v, g, beta, recurrent_state)
        return self._output(core, z), new_conv_state.astype(conv_state.dtype), new_recurrent_state
