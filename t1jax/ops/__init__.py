"""Sequence operators of Gated DeltaNet: the gated delta rule (chunked, recurrent, one step), the
depthwise causal conv, and their context-parallel (sequence-sharded) forms."""

from t1jax.ops.causal_conv import causal_conv1d, causal_conv1d_step
from t1jax.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule_step,
    recurrent_gated_delta_rule,
)

__all__ = [
    "causal_conv1d",
    "causal_conv1d_step",
    "chunk_gated_delta_rule",
    "gated_delta_rule_step",
    "recurrent_gated_delta_rule",
]
