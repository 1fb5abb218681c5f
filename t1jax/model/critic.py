"""The PPO critic (paper §4.5): the actor's backbone with a scalar value head instead of the LM head.

`Qwen35MoeCritic(input_ids, segment_ids=None, positions=None)` returns float32 values [B, T], one
per position (V(s_j) for the prefix ending at token j). The backbone has the actor's exact
parameter layout under the same names (`model.*`), so a critic is initialised from actor weights
by copying them (`from_actor`, or `critic_from_pretrained` on an actor checkpoint); only the value
head (`value_head.kernel [hidden, 1]`, `value_head.bias [1]`) is new. The critic routes freely: it
never replays (paper §4.3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from t1jax.model.axes import EMBED
from t1jax.model.config import Qwen35MoeConfig
from t1jax.model.execution import DEFAULT_EXECUTION, ExecutionConfig
from t1jax.model.params import abstract_params, make_param, normal, zeros
from t1jax.model.transformer import BackboneOutput, Qwen35MoeForCausalLM, Qwen35MoeModel


class ValueHead(nnx.Module):
    """V(s) = hidden(s) . kernel + bias. A fresh head draws its kernel from N(0, initializer_range)
    (the model's own init) unless `kernel_std` is given; `kernel_std=0` is a zero kernel, so the
    fresh critic predicts a constant and its explained variance starts at exactly 0 instead of
    below it (a random head's values vary with no relation to the returns)."""

    def __init__(
        self,
        hidden_size: int,
        *,
        initializer_range: float,
        param_dtype,
        rngs: nnx.Rngs,
        kernel_std: float | None = None,
    ):
        std = initializer_range if kernel_std is None else kernel_std
        init = zeros if std == 0 else normal(std)
        self.kernel = make_param(rngs, init, (hidden_size, 1), param_dtype, (EMBED, None))
        self.bias = make_param(rngs, zeros, (1,), param_dtype, (None,))

    def __call__(self, hidden: jax.Array) -> jax.Array:
        values = hidden.astype(jnp.float32) @ self.kernel[...].astype(jnp.float32) + self.bias[...].astype(
            jnp.float32
        )
        return values[..., 0]


class Qwen35MoeCritic(nnx.Module):
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
        self.value_head = ValueHead(
            config.hidden_size, initializer_range=config.initializer_range, param_dtype=param_dtype, rngs=rngs
        )

    def backbone(self, input_ids, *, segment_ids=None, positions=None) -> BackboneOutput:
        """Final-norm hidden states [B, T, hidden] and the (free) routing."""
        return self.model(input_ids, segment_ids=segment_ids, positions=positions)

    def __call__(self, input_ids, *, segment_ids=None, positions=None) -> jax.Array:
        """float32 values [B, T]."""
        return self.value_head(
            self.backbone(input_ids, segment_ids=segment_ids, positions=positions).hidden_states
        )

    @classmethod
    def from_actor(
        cls, actor: Qwen35MoeForCausalLM, *, rngs: nnx.Rngs | None = None, value_head_std: float | None = None
    ) -> Qwen35MoeCritic:
        """A critic whose backbone is a copy of the actor's (same dtypes and execution), with a
        fresh value head (`ValueHead`'s `kernel_std` = `value_head_std`)."""
        param_dtype = actor.model.embed_tokens[...].dtype
        with abstract_params():  # the backbone is replaced below; never allocate a second one
            critic = cls(actor.config, dtype=actor.dtype, param_dtype=param_dtype, execution=actor.execution)
        rngs = nnx.Rngs(0) if rngs is None else rngs
        critic.model = nnx.clone(actor.model)
        critic.value_head = ValueHead(
            actor.config.hidden_size,
            initializer_range=actor.config.initializer_range,
            param_dtype=param_dtype,
            rngs=rngs,
            kernel_std=value_head_std,
        )
        return critic
