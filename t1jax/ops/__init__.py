"""Sequence operators of Gated DeltaNet: the gated delta rule (chunked, recurrent, one step), the
depthwise causal conv, and their context-parallel (sequence-sharded) forms."""

from t1jax.ops.causal_conv import causal_conv1d, causal_conv1d_step
from t1jax.ops.context_parallel import (
    PackedSequenceDescriptor,
    causal_conv1d_shard,
    context_parallel_causal_conv1d,
    context_parallel_gated_delta_rule,
    gated_delta_rule_shard,
    relayout,
    relayout_shard,
)
from t1jax.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule_step,
    recurrent_gated_delta_rule,
)

__all__ = [
    "PackedSequenceDescriptor",
    "causal_conv1d",
    "causal_conv1d_shard",
    "causal_conv1d_step",
    "chunk_gated_delta_rule",
    "context_parallel_causal_conv1d",
    "context_parallel_gated_delta_rule",
    "gated_delta_rule_shard",
    "gated_delta_rule_step",
    "recurrent_gated_delta_rule",
    "relayout",
    "relayout_shard",
]
