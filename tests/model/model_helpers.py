"""Helpers shared by the model tests (imported by conftest.py and test modules): the tiny
config path, the standard padded batch, parameter randomisation, a jitted forward compiled once
per (model structure, shapes, mode), and the transformers config of one of our configs."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from t1jax.model import validate_routing_replay

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "configs" / "tiny_cpu.yaml"

# One padded batch used by several tests: three rows of different lengths, right padding, longer
# than one delta-rule chunk (64) so the inter-chunk recurrence is exercised.
BATCH_LENGTHS = (80, 45, 9)
BATCH_LEN = 80


def randomize_all(model: nnx.Module, seed: int, scale: float = 0.3) -> None:
    """Perturb every parameter (norm weights start at 0/1, A_log and dt_bias at their defaults):
    a mistake in how any of them is used must change the output."""
    rng = np.random.default_rng(seed)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(variable.get_value(), np.float32)
        noise = rng.standard_normal(value.shape).astype(np.float32) * scale * max(float(np.std(value)), 0.1)
        variable.set_value(jnp.asarray(value + noise, variable.get_value().dtype))


@functools.cache
def _jitted_forward(graphdef):
    @jax.jit
    def forward(state, input_ids, segment_ids, positions, routing_replay):
        model = nnx.merge(graphdef, state)
        return model(input_ids, segment_ids=segment_ids, positions=positions, routing_replay=routing_replay)

    return forward


def forward(model, input_ids, segment_ids=None, positions=None, routing_replay=None):
    """The model's forward under jit, compiled once per (model structure, shapes, mode)."""
    graphdef, state = nnx.split(model)
    if routing_replay is not None:
        routing_replay = validate_routing_replay(routing_replay, model.config, tuple(np.shape(input_ids)))
    as_int = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    return _jitted_forward(graphdef)(
        state, as_int(input_ids), as_int(segment_ids), as_int(positions), routing_replay
    )


def hf_text_config(config):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        **{k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "model_type")}
    )


@functools.cache
def _jitted_critic(graphdef):
    @jax.jit
    def run(state, input_ids, segment_ids):
        critic = nnx.merge(graphdef, state)
        hidden = critic.backbone(input_ids, segment_ids=segment_ids).hidden_states
        return hidden, critic.value_head(hidden)

    return run


def critic_forward(critic, input_ids, segment_ids):
    """(final hidden states, values) of a critic under jit."""
    graphdef, state = nnx.split(critic)
    return _jitted_critic(graphdef)(
        state, jnp.asarray(input_ids, jnp.int32), jnp.asarray(segment_ids, jnp.int32)
    )
