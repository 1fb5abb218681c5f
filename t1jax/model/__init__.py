"""The Qwen3.5-MoE model in flax nnx: config, layers, causal LM, critic, decoding cache, HF I/O.

from t1jax.model import from_pretrained
model = from_pretrained("/path/to/Qwen3.5-122B-A10B", dtype=jnp.bfloat16)
out = model(input_ids)              # int32 [B, T]
out.logits                          # float32 [B, T, vocab]
out.routing                         # int32 [B, T, num_hidden_layers, num_experts_per_tok]
"""

from t1jax.model.cache import (
    AttentionLayerCache,
    DecodeCache,
    LinearLayerCache,
    init_cache,
    put_rows,
    take_rows,
)
from t1jax.model.config import Qwen35MoeConfig, RopeParameters, load_config
from t1jax.model.critic import Qwen35MoeCritic
from t1jax.model.execution import ExecutionConfig, load_execution, with_execution
from t1jax.model.hf_io import (
    check_checkpoint,
    critic_from_pretrained,
    from_pretrained,
    read_checkpoint_index,
    save_pretrained,
)
from t1jax.model.moe import NO_RECORD, route, routed_experts, validate_routing_replay
from t1jax.model.params import abstract_params
from t1jax.model.transformer import (
    BackboneOutput,
    CausalLMOutput,
    Qwen35MoeForCausalLM,
    Qwen35MoeModel,
    TargetLogprobs,
    layer_period,
    positions_within_documents,
)

__all__ = [
    "NO_RECORD",
    "AttentionLayerCache",
    "BackboneOutput",
    "CausalLMOutput",
    "DecodeCache",
    "ExecutionConfig",
    "LinearLayerCache",
    "Qwen35MoeConfig",
    "Qwen35MoeCritic",
    "Qwen35MoeForCausalLM",
    "Qwen35MoeModel",
    "RopeParameters",
    "TargetLogprobs",
    "abstract_params",
    "check_checkpoint",
    "critic_from_pretrained",
    "from_pretrained",
    "init_cache",
    "layer_period",
    "load_config",
    "load_execution",
    "positions_within_documents",
    "put_rows",
    "read_checkpoint_index",
    "route",
    "routed_experts",
    "save_pretrained",
    "take_rows",
    "validate_routing_replay",
    "with_execution",
]
